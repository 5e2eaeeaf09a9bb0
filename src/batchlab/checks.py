"""Checkers for the lessons' exercises.

In a lesson, import this module as ``check`` and call the checker named after the
exercise with the learner's function::

    from batchlab import checks as check
    check.greedy_pick(greedy_pick)

A checker runs the function on a few small cases (fake inputs where that keeps it
instant, the real model where it matters), compares each result with the right
answer, **prints** a verdict and **returns** it as a :class:`Verdict`:

* all cases right: one line, ``✓ greedy_pick: 5/5 cases match``;
* a case wrong: which case (numbered, described in words), what was expected, what
  came back, and a hint; then the other failing cases by name;
* the function still raises ``NotImplementedError``: ``✗ greedy_pick: not written yet``.

Checkers never raise because the learner's code is wrong: in a notebook a traceback
would bury the explanation. Code that needs a hard failure tests the returned
:class:`Verdict` (false unless every case matched) or calls ``verdict.raise_if_failed()``.
In the committed lessons, checker cells carry ``# NBVAL_CHECK_OUTPUT``, so a wrong
reference solution also fails the notebook tests.

Writing a checker for a new exercise: build a list of :class:`Case` and return
``run_cases(name, fn, cases)``. See ``tokens_per_second`` below for a small example.
"""

from __future__ import annotations

import math
import os
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from . import _blas  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np

OK, FAIL = "✓", "✗"


# ---------------------------------------------------------------------------------------
# The machinery: cases, verdicts, and the loop that runs one against the other.

def _show(value: Any) -> str:
    """A short, readable rendering of a value for a verdict."""
    if isinstance(value, (mx.array, np.ndarray)):
        kind = "mx.array" if isinstance(value, mx.array) else "numpy array"
        dtype = str(value.dtype).removeprefix("mlx.core.")
        if value.size <= 8:
            return f"{kind}({np.array(value).tolist()}, dtype={dtype})"
        return f"{kind} of shape {list(value.shape)}, dtype={dtype}"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)) and len(value) > 16:
        return repr(list(value[:16]))[:-1] + f", ...] ({len(value)} items)"
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


@dataclass
class Case:
    """One input to try the learner's function on, and the answer it should give.

    ``compare(got, expected)`` returns None when ``got`` is right, otherwise a sentence
    saying what is wrong ("" when "expected X, got Y" says it all)."""

    label: str  # the case in plain words, e.g. "the largest logit is the last one"
    call: Callable[[Callable], Any]  # runs the learner's function on this case's input
    expected: Any
    compare: Callable[[Any, Any], str | None] = lambda got, expected: None if got == expected else ""
    hint: str = ""  # shown under a failing case
    show: Callable[[Any], str] = _show


@dataclass
class Verdict:
    """What a checker found. True only when every case matched."""

    name: str
    passed: int
    total: int
    message: str
    failed: list[str] = field(default_factory=list)  # labels of the failing cases
    not_written: bool = False

    def __bool__(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"Verdict({self.name!r}, {self.passed}/{self.total} cases match)"

    def _ipython_display_(self) -> None:
        """Show nothing when a checker call ends a notebook cell: the checker printed already."""

    def raise_if_failed(self) -> "Verdict":
        if not self:
            raise CheckFailed(self.message)
        return self


class CheckFailed(AssertionError):
    """Raised by ``Verdict.raise_if_failed`` for code that wants a hard failure."""


def _where(exc: BaseException) -> str:
    """The learner's line that raised, as ' (at line: `code`)', if we can find it."""
    here = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(here) and "site-packages" not in f.filename
              and "dist-packages" not in f.filename]
    if frames and frames[-1].line:
        return f" at `{frames[-1].line.strip()}`"
    return ""


def run_cases(name: str, fn: Any, cases: list[Case], quiet: bool = False) -> Verdict:
    """Run ``fn`` on every case, print the verdict (unless ``quiet``) and return it."""
    verdict = _run(name, fn, cases)
    if not quiet:
        print(verdict.message)
    return verdict


def _run(name: str, fn: Any, cases: list[Case]) -> Verdict:
    total = len(cases)
    if not callable(fn):
        return Verdict(name, 0, total, f"{FAIL} {name}: expected your function, got {_show(fn)}. "
                                       f"Pass the function itself: check.{name}({name})",
                       [c.label for c in cases])
    failures: list[tuple[int, Case, str]] = []
    for number, case in enumerate(cases, 1):
        try:
            got = case.call(fn)
        except NotImplementedError as e:
            why = f"NotImplementedError: {e}" if str(e) else "it still raises NotImplementedError"
            return Verdict(name, 0, total, (
                f"{FAIL} {name}: not written yet ({why}). Write your code where it says "
                f"# YOUR CODE HERE, run that cell, then run this check again."),
                [c.label for c in cases], not_written=True)
        except Exception as e:  # the learner's code crashed on this case
            failures.append((number, case, f"    your function raised {type(e).__name__}: {e}{_where(e)}"))
            continue
        try:
            problem = case.compare(got, case.expected)
        except Exception as e:  # a result so odd that comparing it failed
            problem = f"it could not be compared with the answer ({type(e).__name__}: {e})"
        if problem is not None:
            lines = [f"    expected: {case.show(case.expected)}", f"    got:      {case.show(got)}"]
            if problem:
                lines.append(f"    {problem}")
            failures.append((number, case, "\n".join(lines)))
    passed = total - len(failures)
    if not failures:
        return Verdict(name, passed, total, f"{OK} {name}: {passed}/{total} cases match")
    number, case, detail = failures[0]
    lines = [f"{FAIL} {name}: {passed}/{total} cases match. The first that does not:",
             f"  case {number} of {total}: {case.label}", detail]
    if case.hint:
        lines.append(f"    hint: {case.hint}")
    for number, case, _ in failures[1:]:
        lines.append(f"  case {number} fails too: {case.label}")
    return Verdict(name, passed, total, "\n".join(lines), [c.label for _, c, _ in failures])


# ---------------------------------------------------------------------------------------
# Small helpers for comparing what came back.

def _not_python_int(got: Any) -> str | None:
    """Why ``got`` is not a plain Python int token id (None if it is one)."""
    if isinstance(got, bool):
        return f"{got} is a bool, not a token id"
    if isinstance(got, int):
        return None
    if isinstance(got, (mx.array, np.ndarray, np.generic)):
        return ("that is an array, not a Python int: wrap it in int(...) so the rest of "
                "the code gets a plain number")
    return f"a token id is a Python int, but you returned a {type(got).__name__}"


def _same_token(got: Any, expected: int) -> str | None:
    problem = _not_python_int(got)
    if problem is None and got == expected:
        return None
    return problem or ""


def _close(got: float, expected: float, rel: float = 1e-6) -> bool:
    return math.isclose(got, expected, rel_tol=rel, abs_tol=1e-12)


def _is_whole_number(got: Any) -> bool:
    """An int or numpy integer, but not a bool (which Python counts as an int)."""
    return isinstance(got, (int, np.integer)) and not isinstance(got, bool)


def _number(got: Any) -> str | None:
    """Why ``got`` is not a whole number (None if it is one)."""
    if _is_whole_number(got):
        return None
    return f"expected a whole number (a Python int), but you returned a {type(got).__name__}"


def whole_number_compare(diagnose: Callable[[int, int], str]) -> Callable[[Any, int], str | None]:
    """A case's compare for whole-number answers: not a whole number, say so; right, None;
    otherwise ``diagnose(got, expected)`` names the likely mistake ("" if it knows none)."""
    def compare(got, expected):
        problem = _number(got)
        if problem:
            return problem
        if got == expected:
            return None
        return diagnose(got, expected)
    return compare


def _as_number(got: Any) -> tuple[float | None, str | None]:
    """(value, None) for a real number; (None, why not) otherwise."""
    if isinstance(got, bool) or not isinstance(got, (int, float, np.integer, np.floating)):
        return None, f"expected a number (a Python float), but you returned {_show(got)}"
    value = float(got)
    if math.isnan(value):
        return None, "you returned NaN (not a number)"
    return value, None


def _as_numbers(got: Any) -> tuple[list[float] | None, str | None]:
    """A list of floats from a list, tuple or 1-D array of numbers; or why not."""
    if isinstance(got, np.ndarray):
        if got.ndim != 1:
            return None, f"expected a flat list of numbers, but your array has shape {list(got.shape)}"
        got = got.tolist()
    if not isinstance(got, (list, tuple)):
        return None, f"expected a list of numbers, but you returned a {type(got).__name__}"
    out = []
    for i, value in enumerate(got):
        number, problem = _as_number(value)
        if problem:
            return None, f"item {i}: {problem}"
        out.append(number)
    return out, None


# ---------------------------------------------------------------------------------------
# Lesson 0: the model and one request.

def _row(values) -> mx.array:
    return mx.array(np.asarray(values, dtype=np.float32))


_LOGITS_CACHE: dict = {}


def _france_ids(lm) -> list[int]:
    return lm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])


def _last_logits(lm, ids: list[int]) -> mx.array:
    key = (id(lm.model), tuple(ids))
    if key not in _LOGITS_CACHE:
        row = lm.model(mx.array([ids]))[0, -1]
        mx.eval(row)
        _LOGITS_CACHE[key] = (lm.model, row)  # holding the model keeps its id unique
    return _LOGITS_CACHE[key][1]


def greedy_pick(fn: Callable, lm=None) -> Verdict:
    """Check ``fn(logits) -> int``: the id of the largest logit in a 1-D row of logits.
    With ``lm``, one more case uses the real model's logits."""
    big = np.full(49152, -3.0, dtype=np.float32)
    big[40000] = 1.5
    rows = [
        ("logits [0.1, 2.5, -1.0, 0.3]: the largest is id 1", [0.1, 2.5, -1.0, 0.3]),
        ("logits [3.0, 1.0, 2.0]: the largest is the first, id 0", [3.0, 1.0, 2.0]),
        ("logits [-5.0, -2.0, -9.0, -1.5]: all negative, the largest (-1.5) is the last, id 3",
         [-5.0, -2.0, -9.0, -1.5]),
        ("a vocabulary-sized row (49152 logits) whose largest is at id 40000", big),
    ]
    cases = [Case(label, lambda f, v=values: f(_row(v)), int(np.argmax(values)), _same_token,
                  hint="greedy picks the position (the token id) of the largest logit, "
                       "not the logit itself: mx.argmax gives it")
             for label, values in rows]
    if lm is not None:
        row = _last_logits(lm, _france_ids(lm))
        expected = int(np.argmax(np.array(row)))
        cases.append(Case(
            f"the real model's logits after the France question (greedy says id {expected}, "
            f"{lm.tokenizer.decode([expected])!r})", lambda f: f(row), expected, _same_token))
    return run_cases("greedy_pick", fn, cases)


class _Recorder:
    """Wraps an mlx-lm model and notes, for every forward pass, the input shape and
    whether a KV cache was passed."""

    def __init__(self, model):
        self._model = model
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def __call__(self, inputs, *args, **kwargs):
        cache = kwargs.get("cache", args[0] if args else None)
        self.calls.append((tuple(inputs.shape), cache is not None))
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


_GENERATED: dict = {}


def _reference_tokens(lm, ids: list[int], n: int) -> list[int]:
    from .generate import generate

    key = (id(lm.model), tuple(ids))
    longest = _GENERATED.get(key, (None, []))[1]
    done = bool(longest) and longest[-1] in lm.tokenizer.eos_token_ids
    if len(longest) < n and not done:  # greedy is deterministic: a shorter run is a prefix
        longest = generate(lm, list(ids), max_new_tokens=n).token_ids
        _GENERATED[key] = (lm.model, longest)  # holding the model keeps its id unique
    return longest[:n]


def _token_list_problem(got: Any) -> str | None:
    if isinstance(got, (mx.array, np.ndarray)):
        return "that is an array: return a Python list of ints (array.tolist() makes one)"
    if not isinstance(got, (list, tuple)):
        return f"expected a list of token ids, but you returned a {type(got).__name__}"
    for i, t in enumerate(got):
        problem = _not_python_int(t)
        if problem:
            return f"item {i} is {_show(t)}: {problem}"
    return None


def greedy_generate(fn: Callable, lm) -> Verdict:
    """Check ``fn(lm, ids, n) -> list[int]``: greedy decoding with a KV cache of up to
    ``n`` new tokens after the prompt ``ids``, stopping after an EOS token (kept in the
    list). The right answer is ``batchlab.generate(lm, ids, max_new_tokens=n).token_ids``."""
    tok = lm.tokenizer
    france = _france_ids(lm)

    def show(ids):
        if isinstance(ids, (list, tuple)) and all(isinstance(t, int) for t in ids):
            return f"{_show(list(ids))}  = {tok.decode(ids)!r}"
        return _show(ids)

    def compare(got, expected):
        problem = _token_list_problem(got)
        if problem:
            return problem
        got = list(got)
        if got == expected:
            return None
        if got[:len(expected)] == expected and expected and expected[-1] in tok.eos_token_ids:
            return (f"the first {len(expected)} tokens are right, but you kept going after the "
                    f"EOS token {expected[-1]} ({tok.decode([expected[-1]])!r})")
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                     min(len(got), len(expected)))
        return f"they first differ at position {first} (counting from 0)"

    recorded: dict[str, list] = {}

    def case(label, ids, n, hint="", record=None):
        expected = _reference_tokens(lm, ids, n)

        def call(f):
            recorder = _Recorder(lm.model)
            if record:
                recorded[record] = recorder.calls
            return f(replace(lm, model=recorder), list(ids), n)
        return Case(label, call, expected, compare, hint, show)

    answer = _reference_tokens(lm, france, 12)
    stop = tok.decode(answer[-1:])
    cases = [
        case("the France question (chat template), n=1: just the first new token", france, 1,
             "the first new token comes from the last row of the prefill's logits"),
        case("the France question, n=5: five tokens, each fed back in as the next input", france, 5,
             "each step feeds the token just picked, as mx.array([[token]]), with the same cache",
             record="france5"),
        case(f"the France question, n=12: the answer ends with {stop} (an EOS token) after "
             f"{len(answer)} tokens, so stop there and keep it", france, 12,
             "after appending a token, stop if it is in lm.tokenizer.eos_token_ids"),
        case("a plain text prompt (no chat template) 'Once upon a time', n=6",
             tok.encode("Once upon a time"), 6),
        case("a one-token prompt [504] ('The'), n=4", [504], 4),
    ]

    def cache_ok(calls, _expected):
        if not calls:
            return "your function never called lm.model"
        for i, (shape, with_cache) in enumerate(calls, 1):
            if not with_cache:
                return (f"forward pass {i} ran without a cache: make one with "
                        f"lm.model.make_cache() and pass it as cache=... to every call")
            if i > 1 and shape[-1] != 1:
                return (f"forward pass {i} was given {shape[-1]} tokens: with a KV cache, "
                        f"each step after the prompt feeds only the newest token")
        return None

    def show_calls(calls):
        if not isinstance(calls, list):
            return calls
        parts = [f"[{', '.join(map(str, s))}]{'' if c else ' (no cache)'}" for s, c in calls]
        return "input shapes " + ", ".join(parts[:8]) + (" ..." if len(parts) > 8 else "")

    cases.append(Case(
        "uses the KV cache: the prompt in one pass, then one new token per pass "
        "(the forward passes of case 2)",
        lambda f: recorded.get("france5", []),
        f"input shapes [1, {len(france)}], then [1, 1] for every step, all with the cache",
        cache_ok, show=show_calls))
    return run_cases("greedy_generate", fn, cases)


def tokens_per_second(fn: Callable) -> Verdict:
    """Check ``fn(step_times, batch) -> float``: the decode throughput of steps that each
    took ``step_times[i]`` seconds and each produced one token for every one of ``batch``
    sequences."""

    def compare_for(steps, batch):
        def compare(got, expected):
            got, problem = _as_number(got)
            if problem:
                return problem
            if _close(got, expected):
                return None
            if _close(got, float(np.mean([batch / t for t in steps]))):
                return ("that is the average of the per-step rates; throughput is all the tokens "
                        "made divided by all the time taken")
            if _close(got, len(steps) / sum(steps)) and batch != 1:
                return f"that leaves out the batch: every step makes {batch} tokens, one per sequence"
            if got and _close(1 / got, expected):
                return "that is seconds per token; tokens per second is the other way up"
            return ""
        return compare

    rows = [
        ("10 steps of 0.1 s at batch 1", [0.1] * 10, 1),
        ("the same 10 steps at batch 16 (every step makes 16 tokens)", [0.1] * 10, 16),
        ("2 uneven steps, 0.05 s and 0.15 s, at batch 4", [0.05, 0.15], 4),
        ("1 step of 62 ms at batch 1", [0.062], 1),
        ("3 steps of 238 ms at batch 64", [0.238] * 3, 64),
    ]
    cases = [Case(label, lambda f, s=steps, b=batch: f(list(s), b), batch * len(steps) / sum(steps),
                  compare_for(steps, batch),
                  hint="tokens made = batch x number of steps; time taken = the sum of the step times")
             for label, steps, batch in rows]
    return run_cases("tokens_per_second", fn, cases)
from .checks_lesson3 import *  # noqa: E402,F401,F403
from .checks_lesson4 import *  # noqa: E402,F401,F403
from .checks_lesson5 import *  # noqa: E402,F401,F403
from .checks_lesson6 import *  # noqa: E402,F401,F403
from .checks_lesson1 import *  # noqa: E402,F401,F403
from .checks_lesson2 import *  # noqa: E402,F401,F403
from .checks_lesson7 import *  # noqa: E402,F401,F403
from .checks_lesson8 import *  # noqa: E402,F401,F403
from .checks_lesson9 import *  # noqa: E402,F401,F403
