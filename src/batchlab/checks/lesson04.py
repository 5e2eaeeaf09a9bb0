"""Checkers for lesson 4, chunked prefill.

* ``chunk_plan(fn)``: ``fn(prompt_len, prefill_step) -> [(start, length), ...]``, the chunks
  the continuous engine cuts a prompt into, compared with what the real scheduler does
  (driven by the fake model, so it is instant);
* ``predict_long_ttft(fn)``: ``fn(prompt_len, prefill_step, prefill_tokens_per_s,
  decode_step_s)``, the time to first token of a long prompt that is prefilled chunk by
  chunk while others decode;
* ``largest_chunk(fn)``: ``fn(tbt_target_s, prefill_tokens_per_s, decode_step_s, choices)``,
  the largest chunk size whose predicted time between tokens meets a target.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ._core import (Case, Verdict, answer_compare, as_pairs, close, is_whole_number, number_compare,
                    optional_compare, run_cases, whole_number_compare)

__all__ = ["chunk_plan", "predict_long_ttft", "largest_chunk"]


def _n_chunks(prompt_len: int, prefill_step: int | None) -> int:
    return 1 if prefill_step is None else math.ceil(prompt_len / prefill_step)


# ---------------------------------------------------------------------------------------
# Exercise 1: the chunking rule.

def engine_chunks(prompt_len: int, prefill_step: int | None) -> list[tuple[int, int]]:
    """The (start, length) chunks the continuous engine really runs for a prompt of
    ``prompt_len`` tokens, read from the trace of a run on the fake model (two other
    requests decode meanwhile)."""
    from ..engine import make_engine
    from ..fake import FakeModel, FakeRunner

    eng = make_engine("continuous", FakeModel(), runner=FakeRunner, max_batch_size=3,
                      prefill_step=prefill_step)
    for i in range(2):
        eng.submit([5 + i] * 4, max_new_tokens=4, ignore_eos=True)
    rid = eng.submit([1 + i % 60 for i in range(prompt_len)], max_new_tokens=2, ignore_eos=True)
    eng.run_until_idle()
    return [(start, n) for step in eng.trace.steps for r, start, n in step.prefill if r == rid]


def _chunk_problem(start: Any, length: Any) -> str | None:
    if is_whole_number(start) and is_whole_number(length):
        return None
    return "starts and lengths are whole numbers of tokens"


def _chunks(got: Any) -> tuple[list[tuple[int, int]] | None, str | None]:
    if isinstance(got, (list, tuple)) and any(is_whole_number(item) for item in got):
        return None, ("your list holds plain numbers; return (start, length) pairs, e.g. "
                      "[(0, 128), (128, 128), (256, 44)]")
    pairs, problem = as_pairs(got, "(start, length)", _chunk_problem)
    if problem:
        return None, problem
    return [(int(a), int(b)) for a, b in pairs], None


def chunk_plan(fn: Callable) -> Verdict:
    """Check ``fn(prompt_len, prefill_step) -> list of (start, length)``: the chunks of a
    prompt, in order, when each engine step prefills at most ``prefill_step`` tokens
    (``None``: the whole prompt in one step). The right answer is what the engine's
    ``ContinuousScheduler`` does, read from a trace."""

    def compare_for(prompt_len, step):
        def diagnose(pairs, expected):
            covered = sum(n for _, n in pairs)
            if covered < prompt_len and pairs == expected[:len(pairs)]:
                return (f"your chunks cover only {covered} of the {prompt_len} prompt tokens: "
                        f"the last, shorter chunk is missing")
            if covered > prompt_len:
                return (f"your chunks add up to {covered} tokens, more than the prompt's "
                        f"{prompt_len}: the last chunk takes only what is left")
            starts = [s for s, _ in pairs]
            if len(pairs) == len(expected) and [n for _, n in pairs] == [n for _, n in expected] \
                    and starts != [s for s, _ in expected]:
                return "the lengths are right but the starts are not: each chunk starts where the last one ended"
            return ""
        return answer_compare(_chunks, diagnose)

    rows = [
        ("a 300-token prompt, chunks of 128: two full chunks and a short last one", 300, 128),
        ("a 256-token prompt, chunks of 128: exactly two chunks", 256, 128),
        ("a 100-token prompt, chunks of 128: shorter than one chunk", 100, 128),
        ("a 520-token prompt, prefill_step=None: the whole prompt at once", 520, None),
        ("a 5-token prompt, chunks of 1 token", 5, 1),
        ("a 1-token prompt, chunks of 64", 1, 64),
        ("a 520-token prompt, chunks of 64", 520, 64),
    ]
    cases = [Case(label, lambda f, p=p, s=s: f(p, s), engine_chunks(p, s), compare_for(p, s),
                  hint="each step takes min(prefill_step, tokens still to prefill) tokens, "
                       "starting where the previous chunk ended; None means no limit")
             for label, p, s in rows]
    return run_cases("chunk_plan", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 2: the long prompt's time to first token.

def predict_long_ttft(fn: Callable) -> Verdict:
    """Check ``fn(prompt_len, prefill_step, prefill_tokens_per_s, decode_step_s) -> seconds``:
    the TTFT of a prompt admitted at once while other requests decode. Each step runs one
    chunk of it, then a decode pass for the others; the step with the last chunk produces
    the first token right after that chunk. So TTFT = prompt_len / prefill_tokens_per_s
    + (number of chunks - 1) x decode_step_s."""

    def compare_for(p, step, rate, dec):
        def diagnose(value, expected):
            n = _n_chunks(p, step)
            if close(value, p / rate + n * dec):
                if n == 1:
                    return ("that adds a decode pass; with the whole prompt in one step, the first "
                            "token is sampled right after the prefill pass, before the decode pass")
                return (f"that counts one decode pass per chunk ({n}); the step with the last chunk "
                        f"samples the first token right after that chunk, before its decode pass, "
                        f"so only {n - 1} decode passes come first")
            if step is not None and close(value, p / rate + (p // step - 1) * dec) and p % step:
                return ("the number of chunks is off: a last, shorter chunk is a step too "
                        "(round the division up)")
            if close(value, p / rate):
                return "that leaves out the decode passes that run between the chunks"
            return ""
        return number_compare(diagnose)

    rows = [
        ("512 tokens, whole prompt (prefill_step=None), 256 tokens/s, decode pass 0.1 s: no "
         "decode pass comes before the first token", 512, None, 256.0, 0.1),
        ("512 tokens in chunks of 128 (4 chunks), 256 tokens/s, decode pass 0.1 s", 512, 128, 256.0, 0.1),
        ("520 tokens in chunks of 64 (9 chunks, the last of 8 tokens), 260 tokens/s, "
         "decode pass 0.1 s", 520, 64, 260.0, 0.1),
        ("100 tokens in chunks of 128 (1 chunk), 250 tokens/s, decode pass 0.1 s", 100, 128, 250.0, 0.1),
        ("512 tokens in chunks of 32 (16 chunks), 256 tokens/s, decode pass 0.05 s", 512, 32, 256.0, 0.05),
    ]
    cases = [Case(label, lambda f, a=(p, s, r, d): f(*a), p / r + (_n_chunks(p, s) - 1) * d,
                  compare_for(p, s, r, d),
                  hint="all the prompt's tokens are prefilled once whatever the chunk size; "
                       "between two chunks comes one decode pass")
             for label, p, s, r, d in rows]
    return run_cases("predict_long_ttft", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 3: pick the chunk size.

def _largest(target, rate, dec, choices):
    fits = [c for c in choices if c / rate + dec <= target]
    return max(fits) if fits else None


def largest_chunk(fn: Callable) -> Verdict:
    """Check ``fn(tbt_target_s, prefill_tokens_per_s, decode_step_s, choices) -> int | None``:
    the largest chunk size in ``choices`` whose predicted time between tokens (one chunk,
    then the decode pass: ``chunk / prefill_tokens_per_s + decode_step_s``) is at most the
    target; None when not even the smallest fits."""

    def compare_for(target, rate, dec, choices):
        def diagnose(got, expected):
            fits = [c for c in choices if c / rate + dec <= target]
            if got == min(fits, default=None):
                return "that is the smallest chunk that fits; we want the largest"
            if got == _largest(target, rate, 0.0, choices):
                return ("that leaves out the decode pass: a decoding request waits for the chunk "
                        "AND for its own decode pass")
            if got not in choices:
                return f"{got} is not one of the choices {sorted(choices)}"
            if got / rate + dec > target:
                return (f"a chunk of {got} gives {got / rate + dec:.3f} s between tokens, over the "
                        f"{target} s target")
            return ""
        return optional_compare(whole_number_compare(diagnose),
                                "no chunk size meets this target, so the answer is None (then the "
                                "target cannot be met by chunking alone)",
                                "a chunk size does fit this target")

    sizes = [32, 64, 128, 256]
    rows = [
        ("target 0.5 s, 256 tokens/s, decode pass 0.1 s, choices 32/64/128/256", 0.5, 256.0, 0.1, sizes),
        ("target 1.0 s, same machine", 1.0, 256.0, 0.1, sizes),
        ("target 5.0 s: every choice fits, so the largest", 5.0, 256.0, 0.1, sizes),
        ("target exactly met: 0.75 s with 128 tokens at 256 tokens/s (0.5 s) + 0.25 s decode "
         "pass; equal to the target is within it", 0.75, 256.0, 0.25, sizes),
        ("choices not in order: [256, 32, 128, 64], target 0.5 s", 0.5, 256.0, 0.1, [256, 32, 128, 64]),
        ("target 0.1 s with a 0.1 s decode pass: no chunk fits, None", 0.1, 256.0, 0.1, sizes),
        ("a slow machine: target 2.0 s, 44 tokens/s, decode pass 0.45 s", 2.0, 44.0, 0.45, sizes),
    ]
    cases = [Case(label, lambda f, a=(t, r, d, c): f(a[0], a[1], a[2], list(a[3])), _largest(t, r, d, c),
                  compare_for(t, r, d, c),
                  hint="predicted TBT for a chunk c = c / prefill_tokens_per_s + decode_step_s; "
                       "keep the chunks with that <= target, return the largest (or None)")
             for label, t, r, d, c in rows]
    return run_cases("largest_chunk", fn, cases)
