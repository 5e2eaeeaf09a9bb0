"""Checkers for lesson 3, the prefill stall.

* ``time_between_tokens(fn)``: ``fn(token_times) -> gaps``, one request's TBTs;
* ``percentile_linear(fn)``: ``fn(values, q)``, a percentile the way ``metrics.percentile``
  computes it;
* ``predict_stall(fn)``: ``fn(prompt_len, prefill_tokens_per_s, decode_step_s)``, the gap a
  decoding request sees in a step that prefills a whole prompt first.

They run on hand-made numbers (and one trace of the fake model), so they are instant.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .. import metrics
from ._core import (Case, Verdict, answer_compare, as_numbers, close, number_compare, optional_compare,
                    run_cases, show)

__all__ = ["time_between_tokens", "percentile_linear", "predict_stall"]


# ---------------------------------------------------------------------------------------
# Exercise 1: the gaps between one request's tokens.

def _fake_token_times() -> list[float]:
    """The token times of one request from an engine run on the fake model (the harness's
    clock ticks once a reading, so the gaps are uneven whole numbers)."""
    from ._pieces import fake_workload, run_piece

    trace = run_piece("continuous", fake_workload("tbt", [(5, 6), (39, 2)]), max_batch_size=2).trace
    return list(trace.requests["r0"].token_times_s)


def _show_gaps(value: Any) -> str:
    """Gaps rounded for reading (0.05, not 0.04999999999999999)."""
    numbers, problem = as_numbers(value)
    if problem or len(numbers) > 12:
        return show(value)
    return "[" + ", ".join(f"{x:.6g}" for x in numbers) + "]"


def time_between_tokens(fn: Callable) -> Verdict:
    """Check ``fn(token_times) -> list of gaps``: given the times (seconds) at which one
    request received its tokens, in order, return the time between each token and the one
    before it. A request with n tokens has n - 1 gaps."""

    def same(gaps, expected):
        return len(gaps) == len(expected) and all(close(g, e, 1e-9) for g, e in zip(gaps, expected))

    def diagnose(gaps, expected):
        n_tokens = len(expected) + 1 if expected else None
        if n_tokens and len(gaps) == n_tokens:
            return (f"you returned {len(gaps)} gaps for {n_tokens} tokens: the first token has no "
                    f"token before it, so there are only {n_tokens - 1} gaps (the wait for the "
                    f"first token is the TTFT, a different number)")
        if len(gaps) == len(expected) and all(close(g, -e, 1e-9) for g, e in zip(gaps, expected)):
            return "every gap has the wrong sign: subtract the earlier time from the later one"
        cumulative = list(np.cumsum(expected)) if expected else []
        if len(gaps) == len(expected) and all(close(g, c, 1e-9) for g, c in zip(gaps, cumulative)):
            return ("these are the times since the first token; a gap is measured from the "
                    "token just before, not from the first one")
        return ""

    compare = answer_compare(as_numbers, diagnose, same)

    stall_times = [1.0, 1.1, 1.2, 3.5, 3.6]
    rows = [
        ("four tokens, 0.1 s, 0.15 s and 0.05 s apart", [0.0, 0.1, 0.25, 0.3]),
        ("a stall: five tokens with a 2.3 s wait between the 3rd and the 4th", stall_times),
        ("one token: no gap yet", [5.0]),
        ("no tokens at all", []),
        ("times that do not start at 0 (the engine's clock): 12.5, 12.75, 13.0", [12.5, 12.75, 13.0]),
    ]
    cases = [Case(label, lambda f, t=times: f(list(t)), [b - a for a, b in zip(times, times[1:])],
                  compare, hint="pair each time with the next one: gap i = times[i + 1] - times[i]",
                  show=_show_gaps)
             for label, times in rows]
    times = _fake_token_times()
    cases.append(Case(f"the {len(times)} token times of a request from an engine run (fake model)",
                      lambda f: f(list(times)), [b - a for a, b in zip(times, times[1:])], compare,
                      show=_show_gaps))
    return run_cases("time_between_tokens", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 2: a percentile, numpy's linear way.

def _interpolate(values: list[float], q: float) -> float | None:
    """The linear method's arithmetic on ``values`` in the order given (the right answer
    when they are sorted; a learner's answer when they forgot to sort)."""
    if not values:
        return None
    rank = (len(values) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (rank - lo)


def percentile_linear(fn: Callable) -> Verdict:
    """Check ``fn(values, q) -> float | None``: the q-th percentile (q from 0 to 100) of a list
    of numbers the way ``batchlab.metrics.percentile`` computes it (numpy's "linear"
    method): sort the values; the percentile sits at rank ``(n - 1) * q / 100``, between the
    values at the ranks just below and just above, in proportion. No values: None."""

    def compare_for(values, q):
        def diagnose(value, expected):
            n, xs = len(values), sorted(values)
            nearest = xs[min(n - 1, max(0, math.ceil(n * q / 100) - 1))]
            if close(value, nearest, 1e-9) or close(value, xs[min(n - 1, round((n - 1) * q / 100))], 1e-9):
                return ("that is one of the values itself (a nearest-rank percentile); the "
                        "linear method interpolates between the two values around rank "
                        "(n - 1) * q / 100")
            unsorted = _interpolate(values, q)
            if unsorted is not None and close(value, unsorted, 1e-9) and values != xs:
                return "it looks like the values were not sorted first"
            rank = n * q / 100
            lo = min(math.floor(rank), n - 1)
            shifted = xs[lo] + (xs[min(lo + 1, n - 1)] - xs[lo]) * (rank - math.floor(rank))
            if close(value, shifted, 1e-9):
                return ("the rank is off by one: with n values the ranks run from 0 to n - 1, "
                        "so the q-th percentile sits at rank (n - 1) * q / 100, not n * q / 100")
            return ""
        return optional_compare(number_compare(diagnose, rel=1e-9),
                                "with no values there is no percentile: return None (a 0 would look "
                                "like a real, very good latency)")

    hundred = [float(i) for i in range(1, 101)]
    one_stall = [0.1] * 99 + [2.0]
    rows = [
        ("the numbers 1, 2, ..., 100, q = 99: rank 98.01, between 99 and 100", hundred, 99),
        ("the numbers 1, 2, ..., 100, q = 50 (the median): rank 49.5, halfway between 50 and 51",
         hundred, 50),
        ("unsorted values [3.0, 1.0, 2.0, 10.0], q = 50", [3.0, 1.0, 2.0, 10.0], 50),
        ("100 gaps of 0.1 s, one of them a 2 s stall, q = 99: rank 98.01 lies just past the "
         "last 0.1 s gap, so p99 = 0.1 + 0.01 x 1.9 = 0.119 s", one_stall, 99),
        ("a single value [7.0], q = 99", [7.0], 99),
        ("q = 0 and q = 100 give the smallest and the largest: [5.0, 1.0, 9.0], q = 100",
         [5.0, 1.0, 9.0], 100),
        ("[5.0, 1.0, 9.0], q = 0", [5.0, 1.0, 9.0], 0),
        ("no values at all, q = 99", [], 99),
    ]
    cases = [Case(label, lambda f, v=values, q=q: f(list(v), q), metrics.percentile(values, q),
                  compare_for(values, q),
                  hint="sort, rank = (n - 1) * q / 100, then value[lo] + (value[lo + 1] - "
                       "value[lo]) * (rank - lo) with lo = floor(rank)")
             for label, values, q in rows]
    return run_cases("percentile_linear", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 3: predict the stall.

def predict_stall(fn: Callable) -> Verdict:
    """Check ``fn(prompt_len, prefill_tokens_per_s, decode_step_s) -> seconds``: the time
    between two tokens of a decoding request when the step between them first prefills a
    whole prompt of ``prompt_len`` tokens at ``prefill_tokens_per_s``, then runs the decode
    pass (which takes ``decode_step_s``)."""

    def compare_for(n, rate, step):
        def diagnose(value, expected):
            if close(value, n / rate) and step:
                return ("that is the prefill pass alone; the decoding request's next token comes "
                        "from the decode pass, which runs after the prefill in the same step")
            if n and close(value, rate / n + step):
                return "tokens ÷ (tokens per second) gives seconds: you divided the other way round"
            if close(value, 1000 * expected):
                return "that looks like milliseconds: return seconds"
            if close(value, n / rate - step) or close(value, step - n / rate):
                return "the two passes run one after the other: add their times"
            if n and close(value, step):
                return ("that is the decode pass alone; in this step the prefill runs first, and "
                        "the decoding request waits for it too")
            return ""
        return number_compare(diagnose)

    rows = [
        ("a 512-token prompt at 256 tokens/s, decode pass 0.1 s", 512, 256.0, 0.1),
        ("a 1000-token prompt at 250 tokens/s, decode pass 0.08 s", 1000, 250.0, 0.08),
        ("a 50-token prompt (a short one) at 200 tokens/s, decode pass 0.1 s", 50, 200.0, 0.1),
        ("no prompt this step (0 tokens): just the decode pass, 0.12 s", 0, 250.0, 0.12),
        ("a slow machine: 600 tokens at 40 tokens/s, decode pass 0.45 s", 600, 40.0, 0.45),
    ]
    cases = [Case(label, lambda f, n=n, r=rate, s=step: f(n, r, s), n / rate + step,
                  compare_for(n, rate, step),
                  hint="prefill time = prompt_len / prefill_tokens_per_s; then the decode pass")
             for label, n, rate, step in rows]
    return run_cases("predict_stall", fn, cases)
