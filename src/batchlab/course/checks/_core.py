"""What every checker is made of: :class:`Case`, :class:`Verdict`, ``run_cases``, ``table``, comparisons."""

from __future__ import annotations

import copy
import math
import operator
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ... import _blas  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np

from .. import guard
from ..guard import ours as _ours

OK, FAIL = "✓", "✗"


def show(value: Any) -> str:
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
    """An input, its answer and ``compare(got, expected)``: None if right, else what is wrong (or "")."""

    label: str  # the case in plain words, e.g. "the largest logit is the last one"
    call: Callable[[Callable], Any]  # runs the learner's function on this case's input
    expected: Any
    compare: Callable[[Any, Any], str | None] = lambda got, expected: None if got == expected else ""
    hint: str = ""  # shown under a failing case
    show: Callable[[Any], str] = show


class Differs(str):
    """A judge's finding that is not a mistake: the learner's rule keeps the contract every engine
    must keep, and differs from the lesson's only where the lesson leaves the design open (a
    "Going further" design). The case passes; the verdict says where the rules part, the piece
    stays the learner's in later lessons, and the lesson measures it beside ours."""


@dataclass
class Verdict:
    """What a checker found. True only when every case matched."""

    name: str
    passed: int
    total: int
    message: str
    failed: list[str] = field(default_factory=list)  # labels of the failing cases
    not_written: bool = False
    differs: list[str] = field(default_factory=list)  # labels of passing cases run by another rule

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
    """The learner's line that raised, as ' at `code`', if we can find it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _ours(f.filename)]
    return f" at `{frames[-1].line.strip()}`" if frames and frames[-1].line else ""


def run_cases(name: str, fn: Any, cases: list[Case]) -> Verdict:
    """Run ``fn`` on every case, print the verdict and return it."""
    verdict = _run(name, fn, cases)
    print(verdict.message)
    return verdict


MAX_LATE_CASES = 2  # after this many cases ran out of time, the rest are not run
_NOT_RUN = "    not run"


class WrongType(Exception):
    """Raised by a checker's call when the learner's code returned or yielded the wrong kind of
    thing; its message says which method and what it gave, and is the verdict's detail."""


def _run(name: str, fn: Any, cases: list[Case]) -> Verdict:
    total, labels = len(cases), [c.label for c in cases]
    missing = getattr(fn, "missing_reason", None)  # course.Missing: no usable piece yet
    if missing is not None:
        state = "cannot run yet" if getattr(fn, "written", False) else "not written yet"
        why = f"{FAIL} {name}: {state} ({missing})."
        return Verdict(name, 0, total, why, labels, not_written=True)
    if not callable(fn):
        why = f"expected your function, got {show(fn)}. Pass the function itself: check.{name}({name})"
        return Verdict(name, 0, total, f"{FAIL} {name}: {why}", labels)
    failures: list[tuple[int, Case, str]] = []
    differs: list[tuple[int, Case, str]] = []
    late = 0
    for number, case in enumerate(cases, 1):
        if late >= MAX_LATE_CASES:
            failures += [(n, c, _NOT_RUN) for n, c in enumerate(cases[number - 1 :], number)]
            break
        outcome, detail = _one_case(case, fn)
        if isinstance(outcome.error, NotImplementedError):
            e = outcome.error
            why = f"NotImplementedError: {e}" if str(e) else "it still raises NotImplementedError"
            then = "Write your code where it says # YOUR CODE HERE, run that cell, then run this check again."
            why = f"{FAIL} {name}: not written yet ({why}). {then}"
            return Verdict(name, 0, total, why, labels, not_written=True)
        late += outcome.late is not None
        if detail is not None:
            (differs if isinstance(detail, Differs) else failures).append((number, case, detail))
    passed = total - len(failures)
    if not failures:
        return _passed(name, total, differs)
    number, case, detail = failures[0]
    head = f"{FAIL} {name}: {passed}/{total} cases match. The first that does not:"
    lines = [head, f"  case {number} of {total}: {case.label}", detail]
    lines += [f"    hint: {case.hint}"] if case.hint else []
    for number, case, detail in failures[1:]:
        lines.append(f"  case {number} {'was not run' if detail is _NOT_RUN else 'fails too'}: {case.label}")
        lines += [detail] if "did not finish" in detail else []
    if late >= MAX_LATE_CASES and failures[-1][2] is _NOT_RUN:
        lines.append(f"  ({late} cases ran out of time, so the rest were not run)")
    return Verdict(name, passed, total, "\n".join(lines), [c.label for _, c, _ in failures])


def _one_case(case: Case, fn: Any) -> tuple[guard.Outcome, str | None]:
    """Run one case guarded (a thread of its own, a time limit, the library restored after it);
    its outcome and the verdict's lines for it (None: right; ``Differs``: right by another rule)."""
    before = guard.snapshot()  # the case runs in a thread of its own, its result is judged there too
    outcome = guard.run_guarded(lambda: _attempt(case, fn))  # (MLX arrays belong to their thread)
    changed = guard.restore(before)
    detail = _detail(outcome)
    if changed:
        detail = "\n".join(filter(None, [detail, f"    {guard.library_changed(changed)}"]))
    return outcome, detail


def _passed(name: str, total: int, differs: list[tuple[int, "Case", str]]) -> Verdict:
    """Every case keeps the contract; where the learner's rule is not the lesson's, say where."""
    if not differs:
        return Verdict(name, total, total, f"{OK} {name}: {total}/{total} cases match")
    lines = [
        f"{OK} {name}: {total}/{total} cases keep the contract, so this piece is yours from now on.",
        f"  Your rule differs from the lesson's in {len(differs)} of them (a design of your own; "
        "the lesson measures it beside ours). The first:",
        f"  case {differs[0][0]} of {total}: {differs[0][1].label}",
        differs[0][2],
    ]
    return Verdict(name, total, total, "\n".join(lines), differs=[c.label for _, c, _ in differs])


def _detail(outcome: guard.Outcome) -> str | None:
    """The verdict's lines for one case's outcome (None: right)."""
    if outcome.late is not None:
        return f"    {FAIL} {outcome.late}"
    e = outcome.error
    if e is not None:  # e.g. SystemExit: reported, never raised into the notebook
        return f"    your function raised {type(e).__name__}: {e}{_where(e)}"
    return outcome.value


def _attempt(case: Case, fn: Any) -> str | None:
    """Run ``case`` on ``fn`` and judge what came back: the verdict's lines, or None if right."""
    try:
        got = case.call(fn)
    except NotImplementedError:
        raise  # not written yet: _run says so
    except WrongType as e:
        return f"    {e}"
    except Exception as e:  # the learner's code crashed on this case
        return f"    your function raised {type(e).__name__}: {e}{_where(e)}"
    try:
        problem = case.compare(got, case.expected)
    except Exception as e:  # a result so odd that comparing it failed
        problem = f"it could not be compared with the answer ({type(e).__name__}: {e})"
    if problem is None:
        return None
    if isinstance(problem, Differs):
        return Differs(f"    {problem}")
    lines = [f"    expected: {case.show(case.expected)}", f"    got:      {case.show(got)}"]
    return "\n".join(lines + ([f"    {problem}"] if problem else []))


# Comparing what came back. Each ``*_compare`` rejects an answer of the wrong kind with a
# sentence, accepts the right one, and otherwise asks ``diagnose(got, expected)`` to name
# the likely mistake ("" if it knows none).
Compare = Callable[[Any, Any], "str | None"]


def close(got: float, expected: float, rel: float = 1e-6) -> bool:
    return math.isclose(got, expected, rel_tol=rel, abs_tol=1e-12)


def as_number(got: Any) -> tuple[float | None, str | None]:
    if isinstance(got, bool) or not isinstance(got, (int, float, np.integer, np.floating)):
        return None, f"expected a number (a Python float), but you returned {show(got)}"
    value = float(got)
    return (None, "you returned NaN (not a number)") if math.isnan(value) else (value, None)


def as_numbers(got: Any) -> tuple[list[float] | None, str | None]:
    """A list of floats from a list, tuple or 1-D array of numbers; or why not."""
    if isinstance(got, np.ndarray):
        if got.ndim != 1:
            return None, f"expected a flat list of numbers, but your array has shape {list(got.shape)}"
        got = got.tolist()
    if not isinstance(got, (list, tuple)):
        return None, f"expected a list of numbers, but you returned a {type(got).__name__}"
    out = []
    for i, value in enumerate(got):
        number, problem = as_number(value)
        if problem:
            return None, f"item {i}: {problem}"
        out.append(number)
    return out, None


def as_whole_number(got: Any) -> tuple[int | None, str | None]:
    if isinstance(got, (int, np.integer)) and not isinstance(got, bool):
        return got, None
    return None, f"expected a whole number (a Python int), but you returned a {type(got).__name__}"


def answer_compare(read: Callable, diagnose=lambda got, expected: "", same=operator.eq) -> Compare:
    """``read(got)`` gives (value, None) or (None, why it is the wrong kind of answer)."""

    def compare(got, expected):
        value, problem = read(got)
        return problem or (None if same(value, expected) else diagnose(value, expected))

    return compare


def number_compare(diagnose: Callable = lambda got, expected: "", rel: float = 1e-6) -> Compare:
    return answer_compare(as_number, diagnose, lambda got, expected: close(got, expected, rel))


def whole_number_compare(diagnose: Callable = lambda got, expected: "") -> Compare:
    return answer_compare(as_whole_number, diagnose)


def optional_compare(compare: Compare, when_none_expected: str, when_none_got: str | None = None) -> Compare:
    """``compare`` for answers that may rightly be None."""

    def optional(got, expected):
        if expected is None:
            return None if got is None else when_none_expected
        if got is None and when_none_got is not None:
            return when_none_got
        return compare(got, expected)

    return optional


def mistakes(*known, rel: float = 1e-6) -> Callable[[Any, Any], str]:
    """A numeric diagnose: the ``why`` of the first ``known`` (value or None, why) close to the answer."""
    return lambda got, _: next(
        (why for value, why in known if value is not None and close(got, value, rel)), ""
    )


def table(name: str, fn: Any, rows, right: Callable | None, judge: Callable, hint="", **case) -> Verdict:
    """A case per row ``(label, *args)``: answer ``right(*args)`` (None: the last arg), ``judge(*args)``."""
    cases = []
    for label, *args in rows:
        args, expected = (args[:-1], args[-1]) if right is None else (args, right(*args))
        compare = judge(*args)
        cases.append(Case(label, lambda f, a=args: f(*copy.deepcopy(a)), expected, compare, hint, **case))
    return run_cases(name, fn, cases)
