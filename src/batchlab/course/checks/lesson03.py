"""Checkers for lesson 3 (the prefill stall)."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ...core import metrics
from ._core import Verdict, answer_compare, as_numbers, close, mistakes, number_compare, optional_compare
from ._core import show, table

__all__ = ["time_between_tokens", "percentile_linear", "predict_stall"]


def _show_gaps(value: Any) -> str:
    numbers, problem = as_numbers(value)
    return show(value) if problem or len(numbers) > 12 else "[" + ", ".join(f"{x:.6g}" for x in numbers) + "]"


def _same_list(got, expected, sign=1):
    return len(got) == len(expected) and all(close(g, sign * e, 1e-9) for g, e in zip(got, expected))


def _gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


def time_between_tokens(fn: Callable) -> Verdict:
    """Check ``fn(token_times) -> gaps``: the time between each token of one request and the one before."""
    from ._pieces import fake_workload, run_piece

    def diagnose(gaps, expected):
        if expected and len(gaps) == len(expected) + 1:
            n = len(gaps)
            return f"you returned {n} gaps for {n} tokens: the wait for the first token is the TTFT"
        if _same_list(gaps, expected, -1):
            return "every gap has the wrong sign: subtract the earlier time from the later one"
        if _same_list(gaps, list(np.cumsum(expected)) if expected else []):
            return "these are the times since the first token; a gap is from the token just before"
        return ""

    run = run_piece("continuous", fake_workload("tbt", [(5, 6), (39, 2)]), max_batch_size=2)
    times = list(run.trace.requests["r0"].token_times_s)  # the harness's clock ticks: uneven gaps
    rows = [
        ("four tokens, 0.1 s, 0.15 s and 0.05 s apart", [0.0, 0.1, 0.25, 0.3]),
        ("a stall: five tokens with a 2.3 s wait between the 3rd and the 4th", [1.0, 1.1, 1.2, 3.5, 3.6]),
        ("one token: no gap yet", [5.0]),
        ("no tokens at all", []),
        ("times that do not start at 0 (the engine's clock): 12.5, 12.75, 13.0", [12.5, 12.75, 13.0]),
        (f"the {len(times)} token times of a request from an engine run (fake model)", times),
    ]
    judge = answer_compare(as_numbers, diagnose, _same_list)
    hint = "gap i = times[i + 1] - times[i]"
    return table("time_between_tokens", fn, rows, _gaps, lambda t: judge, hint, show=_show_gaps)


def _interpolate(values: list[float], q: float, n_ranks: int) -> float | None:
    """The linear method on ``values`` as given, at rank ``n_ranks * q / 100`` (two usual mistakes)."""
    if not values:
        return None
    rank = n_ranks * q / 100
    lo = min(math.floor(rank), len(values) - 1)
    return values[lo] + (values[min(lo + 1, len(values) - 1)] - values[lo]) * (rank - math.floor(rank))


def percentile_linear(fn: Callable) -> Verdict:
    """Check ``fn(values, q) -> float | None``: numpy's "linear" percentile, as ``metrics.percentile``."""

    def judge(values, q):
        n, xs = len(values), sorted(values)
        ranks = [max(0, math.ceil(n * q / 100) - 1), round((n - 1) * q / 100)] if n else []
        nearest = "that is one of the values itself (a nearest-rank percentile): interpolate"
        unsorted = _interpolate(values, q, n - 1) if values != xs else None
        off = "the rank is off by one: the q-th percentile sits at rank (n - 1) * q / 100, not n * q / 100"
        known = [(xs[min(n - 1, r)], nearest) for r in ranks]
        known += [(unsorted, "it looks like the values were not sorted first"), (_interpolate(xs, q, n), off)]
        empty = "with no values there is no percentile: return None"
        return optional_compare(number_compare(mistakes(*known, rel=1e-9), rel=1e-9), empty)

    hundred = [float(i) for i in range(1, 101)]
    rows = [
        ("the numbers 1, 2, ..., 100, q = 99: rank 98.01, between 99 and 100", hundred, 99),
        ("the numbers 1, 2, ..., 100, q = 50 (the median): rank 49.5, between 50 and 51", hundred, 50),
        ("unsorted values [3.0, 1.0, 2.0, 10.0], q = 50", [3.0, 1.0, 2.0, 10.0], 50),
        ("100 gaps of 0.1 s, one a 2 s stall, q = 99: p99 = 0.1 + 0.01 x 1.9", [0.1] * 99 + [2.0], 99),
        ("a single value [7.0], q = 99", [7.0], 99),
        ("q = 100 gives the largest: [5.0, 1.0, 9.0], q = 100", [5.0, 1.0, 9.0], 100),
        ("q = 0 gives the smallest: [5.0, 1.0, 9.0], q = 0", [5.0, 1.0, 9.0], 0),
        ("no values at all, q = 99", [], 99),
    ]
    hint = "sort; rank = (n - 1) * q / 100; interpolate between the values at floor(rank) and the next"
    return table("percentile_linear", fn, rows, metrics.percentile, judge, hint)


def predict_stall(fn: Callable) -> Verdict:
    """Check ``fn(prompt_len, prefill_tokens_per_s, decode_step_s) -> seconds``: the stall of a decode."""
    rows = [
        ("a 512-token prompt at 256 tokens/s, decode pass 0.1 s", 512, 256.0, 0.1),
        ("a 1000-token prompt at 250 tokens/s, decode pass 0.08 s", 1000, 250.0, 0.08),
        ("a 50-token prompt (a short one) at 200 tokens/s, decode pass 0.1 s", 50, 200.0, 0.1),
        ("no prompt this step (0 tokens): just the decode pass, 0.12 s", 0, 250.0, 0.12),
        ("a slow machine: 600 tokens at 40 tokens/s, decode pass 0.45 s", 600, 40.0, 0.45),
    ]
    add, flip = "the two passes run one after the other: add their times", "you divided the other way round"

    def judge(n, r, s):
        known = [
            (n / r if s else None, "that is the prefill pass alone; the decode pass runs after it"),
            (r / n + s if n else None, f"tokens ÷ (tokens per second) gives seconds: {flip}"),
            (1000 * (n / r + s), "that looks like milliseconds: return seconds"),
            (n / r - s, add),
            (s - n / r, add),
            (s if n else None, "that is the decode pass alone; the prefill runs first in this step"),
        ]
        return number_compare(mistakes(*known))

    hint = "prefill time = prompt_len / prefill_tokens_per_s; then the decode pass"
    return table("predict_stall", fn, rows, lambda n, r, s: n / r + s, judge, hint)
