"""Metrics: the numbers a serving engine is judged by, computed from a trace alone.

Every function takes a :class:`~batchlab.core.trace.Trace` (live, recorded, or simulated) and
nothing else, so any run can be measured again later. Times are seconds on the engine's
clock. A metric with nothing to measure (no requests, no second token, ...) is ``None``,
never a made-up 0, so a table shows a blank instead of a lie.

The terms:

- **TTFT** (time to first token) of a request: ``first_token_s - arrival_s``. It
  includes queueing, prefill, and any wait for the step that was running when it came.
- **TBT** (time between tokens, also *inter-token latency*): the gaps between consecutive
  tokens of one request. The TBT distribution pools the gaps of all requests, so a stall
  that freezes 15 decoding requests counts 15 times, once for each user who saw it.
- **TPOT** (time per output token) of a request: ``(last token - first token) / (n - 1)``,
  its average TBT. (``finished_s`` equals the last token's time unless it was cancelled.)
- **Slot occupancy**: decode rows ÷ (slots × decode steps): how full the decode batch
  was, over the steps that decoded at all.
- **Padding waste** (static batching): padding rows (finished requests still computed)
  and prompt padding (what a rectangular batch would compute to line prompts up), over
  all tokens computed counting that padding.
- **Goodput**: throughput counting only requests that met the service-level objectives
  (SLOs): TTFT within ``slo.ttft_s`` and the *largest* gap between tokens within
  ``slo.max_tbt_s`` (a max-TBT SLO: one stall fails the request). Not to be confused with
  ``loadgen``'s client-side goodput, which bounds a request's *mean* TPOT (vLLM's rule),
  so a single stall there is averaged away.
- **Speculative decoding** (prompt lookup): a *verify row* is a decode row that carried
  draft tokens. ``spec_drafted`` / ``spec_accepted``: drafts proposed, and drafts the model
  agreed with that became output tokens; ``spec_acceptance_rate`` the second over the first;
  ``spec_tokens_per_verify_row``: 1 + accepted drafts per verify row, the tokens a verify
  row yields on average (vLLM's "mean acceptance length"); ``spec_passes_per_token``: decode
  rows (each one model pass of its request) per token they yielded, 1.0 without speculation,
  below 1 when drafts pay. (A run cut short by a finishing rule yields a token fewer than
  counted; a prefill's first token is not a decode row's and counts in neither.)
- **Scheduler share**: ``1 - Σ forward_s / Σ step duration``: the fraction of step time
  spent outside the model's forward passes (scheduling, sampling, bookkeeping).

Percentiles use ``numpy.percentile(..., method="linear")`` (numpy's default, type 7 of
Hyndman & Fan): the p-th percentile of n sorted values sits at rank ``(n - 1) * p / 100``,
interpolating linearly between the two neighbours. For 1, 2, ..., 100 the p99 is 99.01.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from .trace import RequestRecord, Trace

PERCENTILE_METHOD = "linear"


@dataclass(frozen=True)
class SLO:
    """Service-level objectives on a trace: a request is *good* if its first token came
    within ``ttft_s`` of its arrival and no gap between its tokens was longer than
    ``max_tbt_s`` (a bound on the max TBT, not on the mean TPOT that ``loadgen`` bounds)."""

    ttft_s: float
    max_tbt_s: float


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by numpy's linear method, or None if no values."""
    arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=float)
    if arr.size == 0:
        return None
    return float(np.percentile(arr, q, method=PERCENTILE_METHOD))


def _median(values) -> float | None:
    return percentile(values, 50)


def _last_time(r: RequestRecord) -> float | None:
    if r.finished_s is not None:
        return r.finished_s
    return r.token_times_s[-1] if r.token_times_s else None


# -- volume ----------------------------------------------------------------------------------
def elapsed_s(trace: Trace) -> float | None:
    """Wall time of the run: first arrival to the last request's end (its finish, or its
    last token if it never finished). None without requests or without any end."""
    reqs = list(trace.requests.values())
    ends = [t for t in map(_last_time, reqs) if t is not None]
    if not reqs or not ends:
        return None
    return max(ends) - min(r.arrival_s for r in reqs)


def output_tokens(trace: Trace) -> int:
    """Tokens generated, over all requests."""
    return sum(len(r.token_times_s) for r in trace.requests.values())


COMPLETED = ("stop", "length")  # an answer ended by EOS or a stop string, or by a length limit


def completed(r: RequestRecord) -> bool:
    """Did the request end with an answer ("stop" or "length"), not cancelled, shed or failed?"""
    return r.finished_s is not None and r.finish_reason in COMPLETED


def completed_requests(trace: Trace) -> int:
    """Requests that completed ("stop": EOS or a stop string; "length"), not cancelled, shed or failed."""
    return sum(1 for r in trace.requests.values() if completed(r))


def _per_second(count: float, trace: Trace) -> float | None:
    t = elapsed_s(trace)
    return count / t if t else None


def output_tokens_per_s(trace: Trace) -> float | None:
    """Output tokens per second of elapsed time."""
    return _per_second(output_tokens(trace), trace)


def requests_per_s(trace: Trace) -> float | None:
    """Completed requests per second of elapsed time."""
    return _per_second(completed_requests(trace), trace)


# -- latency ---------------------------------------------------------------------------------
def ttft_values(trace: Trace) -> np.ndarray:
    """TTFT of every request that got a first token (workload order)."""
    return np.array(
        [r.first_token_s - r.arrival_s for r in trace.requests.values() if r.first_token_s is not None],
        dtype=float,
    )


def request_tbts(r: RequestRecord) -> np.ndarray:
    """The gaps between one request's consecutive tokens (empty with fewer than 2)."""
    return np.diff(np.asarray(r.token_times_s, dtype=float))


def tbt_values(trace: Trace) -> np.ndarray:
    """All inter-token gaps of all requests, pooled."""
    parts = [request_tbts(r) for r in trace.requests.values()]
    return np.concatenate(parts) if parts else np.zeros(0)


def tbt_timeline(trace: Trace) -> list[tuple[float, float, str]]:
    """``(time, gap, request id)`` for every gap, sorted by the time the gap ended: what
    lesson 3 plots to show the stalls."""
    out = [
        (t, g, r.id) for r in trace.requests.values() for t, g in zip(r.token_times_s[1:], request_tbts(r))
    ]
    return sorted(out)


def tpot_values(trace: Trace) -> np.ndarray:
    """TPOT of every request with at least 2 tokens."""
    return np.array(
        [
            (r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
            for r in trace.requests.values()
            if len(r.token_times_s) >= 2
        ],
        dtype=float,
    )


# -- how well the batch was used ---------------------------------------------------------------
def slot_occupancy(trace: Trace) -> float | None:
    """Decode rows ÷ (slots × steps that decoded): 1.0 means every slot decoded every step."""
    steps = [s for s in trace.steps if s.decoded]
    if not steps or trace.max_batch_size < 1:
        return None
    return sum(len(s.decoded) for s in steps) / (trace.max_batch_size * len(steps))


def padding_waste(trace: Trace) -> dict:
    """Padding rows, prompt-padding tokens, all tokens computed (counting padding), and
    the share of computed tokens that were padding (None if nothing was computed)."""
    rows = sum(len(s.padding) for s in trace.steps)
    pad_tokens = sum(s.padding_tokens for s in trace.steps)
    computed = sum(s.num_tokens for s in trace.steps) + pad_tokens
    return {
        "padding_rows": rows,
        "padding_tokens": pad_tokens,
        "computed_tokens": computed,
        "padding_waste": (rows + pad_tokens) / computed if computed else None,
    }


def scheduler_share(trace: Trace) -> float | None:
    """Fraction of step time spent outside forward passes (None without steps)."""
    total = sum(s.duration_s for s in trace.steps)
    if total <= 0:
        return None
    return 1.0 - sum(s.forward_s for s in trace.steps) / total


def _decode_only(trace: Trace):
    """Steps of plain decode rows only: no prefill, no padding, no drafts (a verify row is a
    chunk of 1 + k tokens, not a decode row's one)."""
    return [s for s in trace.steps if s.decoded and not s.prefill and not s.padding and not s.drafts]


def decode_step_s(trace: Trace, batch_size: int | None = None, forward_only: bool = False) -> float | None:
    """Median duration of the steps that only decoded, with exactly ``batch_size`` rows
    (default: the trace's maximum batch size). ``forward_only`` takes the forward-pass
    time instead of the whole step. None if no step qualifies."""
    b = trace.max_batch_size if batch_size is None else batch_size
    return _median(
        [s.forward_s if forward_only else s.duration_s for s in _decode_only(trace) if len(s.decoded) == b]
    )


def decode_step_by_batch(trace: Trace) -> dict[int, float]:
    """Median decode-only step time for every batch size that occurred."""
    by: dict[int, list[float]] = {}
    for s in _decode_only(trace):
        by.setdefault(len(s.decoded), []).append(s.duration_s)
    return {b: _median(v) for b, v in sorted(by.items())}


# -- speculative decoding ---------------------------------------------------------------------
def speculation(*traces: Trace) -> dict:
    """Drafts proposed and accepted over the run, the acceptance rate, the tokens a verify row
    yields on average and the decode rows per token they yielded (None where undefined). Given
    several runs (the rounds of one engine), their totals."""
    steps = [s for trace in traces for s in trace.steps]
    drafted = sum(sum(s.drafts.values()) for s in steps)
    accepted = sum(sum(s.accepted.values()) for s in steps)
    verify_rows = sum(len(s.drafts) for s in steps)
    rows = sum(len(s.decoded) for s in steps)
    return {
        "spec_drafted": drafted,
        "spec_accepted": accepted,
        "spec_acceptance_rate": accepted / drafted if drafted else None,
        "spec_verify_rows": verify_rows,
        "spec_tokens_per_verify_row": 1 + accepted / verify_rows if verify_rows else None,
        "spec_passes_per_token": rows / (rows + accepted) if rows else None,
    }


# -- goodput ----------------------------------------------------------------------------------
def meets_slo(r: RequestRecord, slo: SLO) -> bool:
    """Did this request complete within both objectives: its TTFT within ``slo.ttft_s``
    and its largest gap between tokens within ``slo.max_tbt_s``?"""
    if not completed(r) or r.first_token_s is None:
        return False
    if r.first_token_s - r.arrival_s > slo.ttft_s:
        return False
    gaps = request_tbts(r)
    return not (gaps.size and gaps.max() > slo.max_tbt_s)


def goodput(trace: Trace, slo: SLO) -> dict:
    """Requests meeting ``slo`` (TTFT and max TBT): how many, their share of all requests, and the requests
    and output tokens per second they amount to."""
    good = [r for r in trace.requests.values() if meets_slo(r, slo)]
    n = len(trace.requests)
    return {
        "good_requests": len(good),
        "slo_attainment": len(good) / n if n else None,
        "goodput_requests_per_s": _per_second(len(good), trace),
        "goodput_tokens_per_s": _per_second(sum(len(r.token_times_s) for r in good), trace),
    }


# -- everything at once -----------------------------------------------------------------------
def summarize(trace: Trace, slo: SLO | None = None, decode_batch: int | None = None) -> dict:
    """Every metric of a run in one flat dict (JSON-ready; None where undefined).
    Goodput keys are None when no ``slo`` is given; ``decode_step_s`` is the median
    decode-only step at ``decode_batch`` rows (default: the maximum batch size)."""
    ttft, tbt, tpot = ttft_values(trace), tbt_values(trace), tpot_values(trace)
    out = {
        "kind": trace.kind,
        "max_batch_size": trace.max_batch_size,
        "requests": len(trace.requests),
        "completed": completed_requests(trace),
        "steps": len(trace.steps),
        "prompt_tokens": sum(r.prompt_len for r in trace.requests.values()),
        "output_tokens": output_tokens(trace),
        "elapsed_s": elapsed_s(trace),
        "output_tokens_per_s": output_tokens_per_s(trace),
        "requests_per_s": requests_per_s(trace),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tbt_p50_s": percentile(tbt, 50),
        "tbt_p99_s": percentile(tbt, 99),
        "tbt_max_s": float(tbt.max()) if tbt.size else None,
        "tpot_mean_s": float(tpot.mean()) if tpot.size else None,
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "slot_occupancy": slot_occupancy(trace),
        **padding_waste(trace),
        "scheduler_share": scheduler_share(trace),
        "decode_step_s": decode_step_s(trace, decode_batch),
        **speculation(trace),
    }
    if slo is not None:
        out.update(goodput(trace, slo), slo_ttft_s=slo.ttft_s, slo_max_tbt_s=slo.max_tbt_s)
    else:
        out.update(
            good_requests=None,
            slo_attainment=None,
            goodput_requests_per_s=None,
            goodput_tokens_per_s=None,
            slo_ttft_s=None,
            slo_max_tbt_s=None,
        )
    return out


# -- repetitions ------------------------------------------------------------------------------
def median_range(
    traces: Iterable[Trace], key: str | Callable[[Trace], float | None]
) -> tuple[float | None, tuple[float, float] | None]:
    """The median of one figure over repeated runs, and its range ``(min, max)``: ``key`` is
    a ``summarize`` key (``"output_tokens_per_s"``) or a function of a trace. Runs where the
    figure is undefined (None) are left out; ``(None, None)`` if none has it. The runs of
    ``driver.run_interleaved`` are what this is for: report the median, show the range."""
    get = key if callable(key) else (lambda t: summarize(t)[key])
    values = [v for v in (get(t) for t in traces) if v is not None]
    if not values:
        return None, None
    return float(np.median(values)), (float(min(values)), float(max(values)))


def ranges_overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    """Whether two ``(min, max)`` ranges share a value: then repeated runs do not tell the
    two apart, whatever their medians say."""
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]
