"""Checkers for lesson 0 (the model and one request)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Callable

from ... import _blas  # noqa: F401  (before mlx)
import mlx.core as mx
import numpy as np

from ._core import Case, Verdict, answer_compare, mistakes, number_compare, run_cases, show, table

__all__ = ["greedy_pick", "greedy_generate", "tokens_per_second", "decode_intensity"]


def _not_python_int(got: Any) -> str | None:
    if isinstance(got, bool):
        return f"{got} is a bool, not a token id"
    if isinstance(got, int):
        return None
    if isinstance(got, (mx.array, np.ndarray, np.generic)):
        return "that is an array, not a Python int: wrap it in int(...)"
    return f"a token id is a Python int, but you returned a {type(got).__name__}"


_same_token = answer_compare(lambda got: (got, _not_python_int(got)))
_CACHE: dict = {}  # (kind, id(model), prompt) -> (model, value): holding the model keeps its id unique


def _france_ids(lm) -> list[int]:
    return lm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])


def _last_logits(lm, ids: list[int]) -> mx.array:
    key = ("logits", id(lm.model), tuple(ids))
    if key not in _CACHE:
        _CACHE[key] = (lm.model, lm.model(mx.array([ids]))[0, -1])
    return _CACHE[key][1]


def greedy_pick(fn: Callable, lm=None) -> Verdict:
    """Check ``fn(logits) -> int``, the id of the largest logit (with ``lm``, also on the real model's)."""
    big = np.where(np.arange(49152) == 40000, 1.5, -3.0)
    rows = [
        ("logits [0.1, 2.5, -1.0, 0.3]: the largest is id 1", [0.1, 2.5, -1.0, 0.3]),
        ("logits [3.0, 1.0, 2.0]: the largest is the first, id 0", [3.0, 1.0, 2.0]),
        ("logits [-5.0, -2.0, -9.0, -1.5]: all negative, the last is largest", [-5.0, -2.0, -9.0, -1.5]),
        ("a vocabulary-sized row (49152 logits) whose largest is at id 40000", big),
    ]
    hint = "greedy picks the position (the token id) of the largest logit, not the logit: mx.argmax"
    cases = [
        Case(label, lambda f, v=v: f(mx.array(v, dtype=mx.float32)), int(np.argmax(v)), _same_token, hint)
        for label, v in rows
    ]
    if lm is not None:
        row = _last_logits(lm, _france_ids(lm))
        values = np.array(row.astype(mx.float32))
        expected = int(np.argmax(values))
        label = f"the real model's logits after the France question (id {expected})"
        cases.append(Case(label, lambda f: _tied_as_first(values, f(row)), expected, _same_token))
    return run_cases("greedy_pick", fn, cases)


def _tied_as_first(values: np.ndarray, got):
    """``got``, or the first id of the largest logit when ``got`` is another id equal to it:
    float16 logits (a Mac's) tie often, and ``mx.argmax`` may pick any of the tied ids."""
    if (
        isinstance(got, (int, np.integer))
        and not isinstance(got, bool)
        and 0 <= got < values.size
        and values[got] == values.max()
    ):
        return type(got)(int(np.argmax(values)))
    return got


class _Recorder:
    """Wraps an mlx-lm model and notes, per forward pass, the input shape and whether it had a cache."""

    def __init__(self, model):
        self._model, self.calls = model, []

    def __call__(self, inputs, *args, **kwargs):
        self.calls.append((tuple(inputs.shape), kwargs.get("cache", args[0] if args else None) is not None))
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _reference_tokens(lm, ids: list[int], n: int) -> list[int]:
    from ...model.baseline import generate

    key = ("tokens", id(lm.model), tuple(ids))
    longest = _CACHE.get(key, (None, []))[1]
    if len(longest) < n and not (longest and longest[-1] in lm.tokenizer.eos_token_ids):
        longest = generate(lm, list(ids), max_new_tokens=n).token_ids  # greedy: a shorter run is a prefix
        _CACHE[key] = (lm.model, longest)
    return longest[:n]


def _tokens_problem(tok, got, expected) -> str | None:
    """greedy_generate's answer: a list of Python ints, the reference's tokens up to and with EOS."""
    if isinstance(got, (mx.array, np.ndarray)):
        return "that is an array: return a Python list of ints (array.tolist() makes one)"
    if not isinstance(got, (list, tuple)):
        return f"expected a list of token ids, but you returned a {type(got).__name__}"
    for i, t in enumerate(got):
        if _not_python_int(t):
            return f"item {i} is {show(t)}: {_not_python_int(t)}"
    got = list(got)
    if got == expected:
        return None
    last = f"the EOS token {expected[-1]} ({tok.decode(expected[-1:])!r})" if expected else ""
    if got[: len(expected)] == expected and expected and expected[-1] in tok.eos_token_ids:
        return f"the first {len(expected)} tokens are right, but you kept going after {last}"
    if got == expected[:-1] and expected[-1] in tok.eos_token_ids:
        return f"you stopped at {last} but left it out: append it, then stop"
    if len(got) > len(expected) and got[len(got) - len(expected) :] == expected:
        extra = f"the new tokens are right, but {len(got) - len(expected)} tokens come before them"
        return f"{extra} (the prompt?): return only the new tokens"
    n = min(len(got), len(expected))
    first = next((i for i in range(n) if got[i] != expected[i]), n)
    return f"they first differ at position {first} (counting from 0)"


def _cache_problem(calls, _expected) -> str | None:
    """The prompt in one forward pass with a cache, then one new token a pass, all with the cache."""
    for i, (shape, with_cache) in enumerate(calls, 1):
        if not with_cache:
            return f"forward pass {i} ran without a cache: pass cache=lm.model.make_cache() to every call"
        if i > 1 and shape[-1] != 1:
            newest = "each step after the prompt feeds only the newest token"
            return f"forward pass {i} was given {shape[-1]} tokens: {newest}"
    return None if calls else "your function never called lm.model"


def _show_calls(calls):  # the expected answer is already in words
    if isinstance(calls, str):
        return calls
    parts = [f"{list(shape)}{'' if cached else ' (no cache)'}" for shape, cached in calls]
    return "input shapes " + ", ".join(parts[:8]) + (" ..." if len(parts) > 8 else "")


def greedy_generate(fn: Callable, lm) -> Verdict:
    """Check ``fn(lm, ids, n) -> list[int]``: greedy decoding with a KV cache, up to ``n`` new tokens."""
    tok, france, five = lm.tokenizer, _france_ids(lm), _Recorder(lm.model)  # five: case 2's model

    def show_ids(ids):
        if isinstance(ids, (list, tuple)) and all(isinstance(t, int) for t in ids):
            return f"{show(list(ids))}  = {tok.decode(ids)!r}"
        return show(ids)

    compare = partial(_tokens_problem, tok)

    def case(label, ids, n, hint="", model=None):
        on, ids = replace(lm, model=model or _Recorder(lm.model)), list(ids)  # the learner's own copies
        return Case(label, lambda f: f(on, ids, n), _reference_tokens(lm, ids, n), compare, hint, show_ids)

    answer = _reference_tokens(lm, france, 12)
    first, once = "the first new token is the prefill's last row's", tok.encode("Once upon a time")
    twelve = f"the France question, n=12: the answer ends with an EOS token after {len(answer)} tokens"
    cases = [
        case("the France question (chat template), n=1", france, 1, first),
        case("the France question, n=5", france, 5, "feed the token just picked, with the same cache", five),
        case(twelve, france, 12, "after appending a token, stop if it is in lm.tokenizer.eos_token_ids"),
        case("a plain text prompt (no chat template) 'Once upon a time', n=6", once, 6),
        case("a one-token prompt [504] ('The'), n=4", [504], 4),
    ]
    want = f"input shapes [1, {len(france)}], then [1, 1] for every step, all with the cache"
    label = "uses the KV cache: the prompt in one pass, then one new token per pass (case 2's passes)"
    cases.append(Case(label, lambda f: five.calls, want, _cache_problem, show=_show_calls))
    return run_cases("greedy_generate", fn, cases)


def tokens_per_second(fn: Callable) -> Verdict:
    """Check ``fn(step_times, batch) -> float``: tokens made (one per sequence a step) per second."""
    rows = [
        ("10 steps of 0.1 s at batch 1", [0.1] * 10, 1),
        ("the same 10 steps at batch 16 (every step makes 16 tokens)", [0.1] * 10, 16),
        ("2 uneven steps, 0.05 s and 0.15 s, at batch 4", [0.05, 0.15], 4),
        ("1 step of 62 ms at batch 1", [0.062], 1),
        ("3 steps of 238 ms at batch 64", [0.238] * 3, 64),
    ]

    def judge(s, b):
        per_step = float(np.mean([b / t for t in s]))
        known = [
            (per_step, "that is the average of the per-step rates: divide the totals"),
            (len(s) / sum(s) if b != 1 else None, f"that leaves out the batch: every step makes {b} tokens"),
            (sum(s) / (b * len(s)), "that is seconds per token; tokens per second is the other way up"),
        ]
        return number_compare(mistakes(*known))

    hint = "tokens made = batch x number of steps; time taken = the sum of the step times"
    return table("tokens_per_second", fn, rows, lambda s, b: b * len(s) / sum(s), judge, hint=hint)


SMOL = dict(
    parameters=134_515_008, weight_bytes=538_060_032, kv_bytes_per_token=46_080
)  # about the course model, float32


def decode_intensity(fn: Any) -> Verdict:
    """Check ``fn(parameters, weight_bytes, batch, context, kv_bytes_per_token)``: a decode step's
    arithmetic intensity, FLOP per byte read (the weights once, each sequence's KV cache)."""
    p, w, k = SMOL["parameters"], SMOL["weight_bytes"], SMOL["kv_bytes_per_token"]
    rows = [
        ("batch 1, no context yet: the weights alone", p, w, 1, 0, k),
        ("batch 64, no context yet", p, w, 64, 0, k),
        ("batch 64, 1,000 tokens of context each", p, w, 64, 1000, k),
        ("batch 1, 8,000 tokens of context", p, w, 1, 8000, k),
        (
            "bfloat16 weights and cache (2 bytes a number), batch 16, 256 tokens each",
            p,
            w // 2,
            16,
            256,
            k // 2,
        ),
    ]

    def right(p, w, b, c, k):
        return 2 * p * b / (w + b * c * k)

    def judge(p, w, b, c, k):
        flops, moved = 2 * p * b, w + b * c * k
        return number_compare(
            mistakes(
                (
                    flops / w if c else None,
                    "count the KV cache too: each sequence reads its own context's keys and values",
                ),
                (
                    flops / (w + c * k) if b > 1 and c else None,
                    "every sequence of the batch reads its own cache: batch x context x kv_bytes_per_token",
                ),
                (flops / 2 / moved, "a multiply and an add per weight: 2 x parameters operations per token"),
                (moved / flops, "intensity is operations per byte, not bytes per operation"),
                (2 * p / moved, "the batch's operations: 2 x parameters for EACH of its sequences"),
            )
        )

    hint = (
        "operations 2 x parameters x batch; bytes: the weights once plus batch x context x kv_bytes_per_token"
    )
    return table("decode_intensity", fn, rows, right, judge, hint)
