"""Checkers for lesson 3, the prefill stall: ``time_between_tokens(fn)``, ``percentile_linear(fn)``
(as ``metrics.percentile`` computes it) and ``predict_stall(fn)``; hand-made numbers and one
fake-model trace, so they are instant."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .. import metrics
from ._core import (
    Verdict,
    answer_compare,
    as_numbers,
    close,
    mistakes,
    number_compare,
    optional_compare,
    show,
    table,
)

__all__ = ["time_between_tokens", "percentile_linear", "predict_stall"]


def _show_gaps(value: Any) -> str:
    numbers, problem = as_numbers(value)
    return show(value) if problem or len(numbers) > 12 else "[" + ", ".join(f"{x:.6g}" for x in numbers) + "]"


def _same_list(got, expected, sign=1):
    return len(got) == len(expected) and all(close(g, sign * e, 1e-9) for g, e in zip(got, expected))


def time_between_tokens(fn: Callable) -> Verdict:
    """Check ``fn(token_times) -> gaps``: the time between each token of one request and the one before."""
    from ._pieces import fake_workload, run_piece

    def diagnose(gaps, expected):
        if expected and len(gaps) == len(expected) + 1:
            return (
                f"you returned {len(gaps)} gaps for {len(gaps)} tokens: the first token has no "
                f"token before it, so there are only {len(expected)} gaps (the wait for the "
                f"first token is the TTFT, a different number)"
            )
        if _same_list(gaps, expected, -1):
            return "every gap has the wrong sign: subtract the earlier time from the later one"
        if _same_list(gaps, list(np.cumsum(expected)) if expected else []):
            return (
                "these are the times since the first token; a gap is measured from the "
                "token just before, not from the first one"
            )
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
    return table(
        "time_between_tokens",
        fn,
        rows,
        lambda t: [b - a for a, b in zip(t, t[1:])],
        lambda t: answer_compare(as_numbers, diagnose, _same_list),
        "pair each time with the next one: gap i = times[i + 1] - times[i]",
        show=_show_gaps,
    )


def _interpolate(values: list[float], q: float, n_ranks: int) -> float | None:
    """The linear method's arithmetic on ``values`` as given, at rank ``n_ranks * q / 100``
    (the mistakes of forgetting to sort, and of counting ranks from 1)."""
    if not values:
        return None
    rank = n_ranks * q / 100
    lo = min(math.floor(rank), len(values) - 1)
    return values[lo] + (values[min(lo + 1, len(values) - 1)] - values[lo]) * (rank - math.floor(rank))


def percentile_linear(fn: Callable) -> Verdict:
    """Check ``fn(values, q) -> float | None``: numpy's "linear" percentile, as ``metrics.percentile``."""

    def judge(values, q):
        n, xs = len(values), sorted(values)
        near = (
            [xs[min(n - 1, max(0, math.ceil(n * q / 100) - 1))], xs[min(n - 1, round((n - 1) * q / 100))]]
            if n
            else []
        )
        nearest = (
            "that is one of the values itself (a nearest-rank percentile); the linear method "
            "interpolates between the two values around rank (n - 1) * q / 100"
        )
        return optional_compare(
            number_compare(
                mistakes(
                    *[(v, nearest) for v in near],
                    (
                        _interpolate(values, q, n - 1) if values != xs else None,
                        "it looks like the values were not sorted first",
                    ),
                    (
                        _interpolate(xs, q, n),
                        "the rank is off by one: with n values the ranks run from 0 to n - 1, "
                        "so the q-th percentile sits at rank (n - 1) * q / 100, not n * q / "
                        "100",
                    ),
                    rel=1e-9,
                ),
                rel=1e-9,
            ),
            "with no values there is no percentile: return None (a 0 would look "
            "like a real, very good latency)",
        )

    hundred = [float(i) for i in range(1, 101)]
    rows = [
        ("the numbers 1, 2, ..., 100, q = 99: rank 98.01, between 99 and 100", hundred, 99),
        (
            "the numbers 1, 2, ..., 100, q = 50 (the median): rank 49.5, halfway between 50 and 51",
            hundred,
            50,
        ),
        ("unsorted values [3.0, 1.0, 2.0, 10.0], q = 50", [3.0, 1.0, 2.0, 10.0], 50),
        (
            "100 gaps of 0.1 s, one of them a 2 s stall, q = 99: rank 98.01 lies just past the "
            "last 0.1 s gap, so p99 = 0.1 + 0.01 x 1.9 = 0.119 s",
            [0.1] * 99 + [2.0],
            99,
        ),
        ("a single value [7.0], q = 99", [7.0], 99),
        (
            "q = 0 and q = 100 give the smallest and the largest: [5.0, 1.0, 9.0], q = 100",
            [5.0, 1.0, 9.0],
            100,
        ),
        ("[5.0, 1.0, 9.0], q = 0", [5.0, 1.0, 9.0], 0),
        ("no values at all, q = 99", [], 99),
    ]
    return table(
        "percentile_linear",
        fn,
        rows,
        metrics.percentile,
        judge,
        "sort, rank = (n - 1) * q / 100, then value[lo] + (value[lo + 1] - "
        "value[lo]) * (rank - lo) with lo = floor(rank)",
    )


def predict_stall(fn: Callable) -> Verdict:
    """Check ``fn(prompt_len, prefill_tokens_per_s, decode_step_s) -> seconds``: a decoding
    request's gap when its step first prefills a whole prompt, then runs the decode pass."""
    rows = [
        ("a 512-token prompt at 256 tokens/s, decode pass 0.1 s", 512, 256.0, 0.1),
        ("a 1000-token prompt at 250 tokens/s, decode pass 0.08 s", 1000, 250.0, 0.08),
        ("a 50-token prompt (a short one) at 200 tokens/s, decode pass 0.1 s", 50, 200.0, 0.1),
        ("no prompt this step (0 tokens): just the decode pass, 0.12 s", 0, 250.0, 0.12),
        ("a slow machine: 600 tokens at 40 tokens/s, decode pass 0.45 s", 600, 40.0, 0.45),
    ]
    add = "the two passes run one after the other: add their times"
    return table(
        "predict_stall",
        fn,
        rows,
        lambda n, r, s: n / r + s,
        lambda n, r, s: number_compare(
            mistakes(
                (
                    n / r if s else None,
                    "that is the prefill pass alone; the decoding request's next token comes "
                    "from the decode pass, which runs after the prefill in the same step",
                ),
                (
                    r / n + s if n else None,
                    "tokens ÷ (tokens per second) gives seconds: you divided the other way round",
                ),
                (1000 * (n / r + s), "that looks like milliseconds: return seconds"),
                (n / r - s, add),
                (s - n / r, add),
                (
                    s if n else None,
                    "that is the decode pass alone; in this step the prefill runs first, and "
                    "the decoding request waits for it too",
                ),
            )
        ),
        "prefill time = prompt_len / prefill_tokens_per_s; then the decode pass",
    )
