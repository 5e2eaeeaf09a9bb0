"""Metrics on hand-made traces whose answers were worked out by hand (in the comments)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from batchlab.core import metrics as M
from batchlab.core.trace import RequestRecord, StepRecord, Trace

approx = pytest.approx


def request(rid, arrival, token_times, finish="length", finished_s=None, prompt_len=10):
    return RequestRecord(
        rid,
        prompt_len,
        max(len(token_times), 1),
        arrival,
        state_times=[(arrival, "queued")],
        first_token_s=token_times[0] if token_times else None,
        token_times_s=list(token_times),
        finished_s=finished_s if finished_s is not None else (token_times[-1] if finish else None),
        finish_reason=finish,
        output_ids=list(range(len(token_times))),
    )


def latency_trace() -> Trace:
    # r1: arrives 0.0, tokens 1.0 1.5 2.5          TTFT 1.0, gaps .5 1.0,        TPOT .75
    # r2: arrives 0.5, tokens 2.0 2.2 2.4 2.6 4.0  TTFT 1.5, gaps .2 .2 .2 1.4,  TPOT .5
    # r3: arrives 1.0, one token at 3.0            TTFT 2.0, no gaps, no TPOT
    reqs = [
        request("r1", 0.0, [1.0, 1.5, 2.5]),
        request("r2", 0.5, [2.0, 2.2, 2.4, 2.6, 4.0]),
        request("r3", 1.0, [3.0]),
    ]
    return Trace("continuous", 4, [], {r.id: r for r in reqs})


def step_trace() -> Trace:
    steps = [
        # index, start, end, forward; rows
        StepRecord(0, 0.0, 1.0, forward_s=0.9, passes=1, prefill=[("a", 0, 10)], padding_tokens=6),
        StepRecord(1, 1.0, 1.2, forward_s=0.18, passes=1, decoded=["a", "b"]),
        StepRecord(2, 1.2, 1.5, forward_s=0.27, passes=2, decoded=["a", "b", "c"], prefill=[("d", 0, 5)]),
        StepRecord(3, 1.5, 1.6, forward_s=0.10, passes=1, decoded=["a", "b", "c", "d"]),
        StepRecord(4, 1.6, 1.7, forward_s=0.10, passes=1, decoded=["a", "b"], padding=["c", "d"]),
        StepRecord(5, 1.7, 1.75, forward_s=0.04, passes=1, decoded=["a", "b"]),
        StepRecord(6, 1.75, 2.05, forward_s=0.29, passes=1, decoded=["a", "b"]),
    ]
    return Trace("static", 4, steps, {})


# -- percentiles ------------------------------------------------------------------------------
def test_percentile_is_numpy_linear_method():
    values = list(range(1, 101))
    assert M.percentile(values, 99) == approx(99.01)  # rank 99 * .99 = 98.01 -> 99.01
    assert M.percentile(values, 50) == approx(50.5)
    assert M.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert M.percentile([1.0, 2.0], 99) == approx(1.99)
    assert M.percentile([], 50) is None


# -- volume and latency ---------------------------------------------------------------------------
def test_throughput_counts_tokens_over_first_arrival_to_last_finish():
    tr = latency_trace()
    assert M.elapsed_s(tr) == approx(4.0)
    assert M.output_tokens(tr) == 9
    assert M.output_tokens_per_s(tr) == approx(9 / 4)
    assert M.completed_requests(tr) == 3
    assert M.requests_per_s(tr) == approx(3 / 4)


def test_ttft_tbt_tpot_known_values():
    tr = latency_trace()
    assert sorted(M.ttft_values(tr)) == approx([1.0, 1.5, 2.0])
    assert sorted(M.tbt_values(tr)) == approx([0.2, 0.2, 0.2, 0.5, 1.0, 1.4])
    assert sorted(M.tpot_values(tr)) == approx([0.5, 0.75])
    s = M.summarize(tr)
    assert s["ttft_p50_s"] == approx(1.5)
    assert s["ttft_p99_s"] == approx(1.99)  # rank 1.98 between 1.5 and 2.0
    assert s["tbt_p50_s"] == approx(0.35)  # rank 2.5 between .2 and .5
    assert s["tbt_p99_s"] == approx(1.38)  # rank 4.95 between 1.0 and 1.4
    assert s["tbt_max_s"] == approx(1.4)
    assert s["tpot_mean_s"] == approx(0.625)
    assert s["tpot_p50_s"] == approx(0.625)


def test_tbt_timeline_in_time_order():
    got = M.tbt_timeline(latency_trace())
    want = [
        (1.5, 0.5, "r1"),
        (2.2, 0.2, "r2"),
        (2.4, 0.2, "r2"),
        (2.5, 1.0, "r1"),
        (2.6, 0.2, "r2"),
        (4.0, 1.4, "r2"),
    ]
    assert [(t, rid) for t, _, rid in got] == [(t, rid) for t, _, rid in want]
    assert [g for _, g, _ in got] == approx([g for _, g, _ in want])


def test_a_one_token_request_has_no_tbt_and_no_tpot():
    tr = Trace("continuous", 2, [], {"x": request("x", 0.0, [0.7])})
    assert M.tbt_values(tr).size == 0
    assert M.tpot_values(tr).size == 0
    s = M.summarize(tr)
    assert s["tbt_p50_s"] is None and s["tbt_p99_s"] is None and s["tbt_max_s"] is None
    assert s["tpot_mean_s"] is None
    assert s["ttft_p50_s"] == approx(0.7)
    assert s["output_tokens"] == 1


def test_unfinished_and_cancelled_requests():
    reqs = {
        # still running: ends (for elapsed) at its last token, 5.0; not completed
        "run": request("run", 1.0, [2.0, 5.0], finish=None),
        # cancelled at 6.0 after one token: its token counts, the request does not
        "can": request("can", 0.5, [3.0], finish="cancelled", finished_s=6.0),
        # cancelled while queued: no token, no TTFT
        "q": request("q", 2.0, [], finish="cancelled", finished_s=2.5),
    }
    tr = Trace("continuous", 2, [], reqs)
    assert M.elapsed_s(tr) == approx(5.5)  # 0.5 -> 6.0
    assert M.output_tokens(tr) == 3
    assert M.completed_requests(tr) == 0
    assert sorted(M.ttft_values(tr)) == approx([1.0, 2.5])
    g = M.goodput(tr, M.SLO(ttft_s=100, max_tbt_s=100))
    assert g["good_requests"] == 0 and g["goodput_tokens_per_s"] == 0.0


# -- goodput ----------------------------------------------------------------------------------
def test_goodput_needs_both_slos():
    tr = latency_trace()
    # TTFT <= 1.6 and every gap <= 1.2: r1 yes; r2 has a 1.4 s gap; r3's TTFT is 2.0.
    g = M.goodput(tr, M.SLO(ttft_s=1.6, max_tbt_s=1.2))
    assert g["good_requests"] == 1
    assert g["slo_attainment"] == approx(1 / 3)
    assert g["goodput_requests_per_s"] == approx(1 / 4)
    assert g["goodput_tokens_per_s"] == approx(3 / 4)
    # Limits are inclusive; a one-token request has no gap to break the TBT objective.
    g = M.goodput(tr, M.SLO(ttft_s=2.0, max_tbt_s=1.0))
    assert g["good_requests"] == 2  # r1 (gap exactly 1.0) and r3 (TTFT exactly 2.0)
    assert g["goodput_tokens_per_s"] == approx(4 / 4)
    g = M.goodput(tr, M.SLO(ttft_s=0.5, max_tbt_s=10))
    assert g["good_requests"] == 0 and g["goodput_requests_per_s"] == 0.0


# -- steps ------------------------------------------------------------------------------------
def test_slot_occupancy_counts_decode_rows_over_decode_steps():
    # decode steps 1-6 with 2, 3, 4, 2, 2, 2 rows = 15 rows of 6 * 4 = 24 slot-steps.
    # (Step 4's padding rows hold slots but decode nothing.)
    assert M.slot_occupancy(step_trace()) == approx(15 / 24)


def test_padding_waste():
    w = M.padding_waste(step_trace())
    # tokens through the model: 10 + 2 + (3 + 5) + 4 + (2 + 2) + 2 + 2 = 32, plus 6 of
    # prompt padding = 38; waste = (2 rows + 6 tokens) / 38.
    assert w == {
        "padding_rows": 2,
        "padding_tokens": 6,
        "computed_tokens": 38,
        "padding_waste": approx(8 / 38),
    }


def test_scheduler_share():
    # step time 2.05 s, forward 1.88 s -> 0.17 / 2.05 outside the forward passes
    assert M.scheduler_share(step_trace()) == approx(0.17 / 2.05)


def test_decode_step_time_uses_only_pure_decode_steps_of_that_batch():
    tr = step_trace()
    # batch 2: steps 1 (0.2 s), 5 (0.05 s), 6 (0.3 s); step 4 has padding rows -> 0.2
    assert M.decode_step_s(tr, 2) == approx(0.2)
    assert M.decode_step_s(tr, 2, forward_only=True) == approx(0.18)
    assert M.decode_step_s(tr) == approx(0.1)  # default: the max batch size, 4 (step 3)
    assert M.decode_step_s(tr, 3) is None  # step 2 also prefilled
    assert M.decode_step_by_batch(tr) == {2: approx(0.2), 4: approx(0.1)}


# -- everything --------------------------------------------------------------------------------
def test_summarize_combines_and_survives_json():
    tr = latency_trace()
    tr.steps = step_trace().steps
    s = M.summarize(tr, slo=M.SLO(1.6, 1.2))
    assert s["slot_occupancy"] == approx(15 / 24)
    assert s["padding_waste"] == approx(8 / 38)
    assert s["good_requests"] == 1
    assert s["output_tokens_per_s"] == approx(2.25)
    assert s["decode_step_s"] == approx(0.1)
    assert s["prompt_tokens"] == 30
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    # a trace read back from JSON measures the same
    assert M.summarize(Trace.from_json(tr.to_json()), slo=M.SLO(1.6, 1.2)) == s


def test_empty_trace():
    s = M.summarize(Trace("continuous", 8), slo=M.SLO(1, 1))
    assert s["requests"] == 0 and s["output_tokens"] == 0 and s["steps"] == 0
    for key in (
        "elapsed_s",
        "output_tokens_per_s",
        "requests_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "tbt_p50_s",
        "tbt_p99_s",
        "tbt_max_s",
        "tpot_mean_s",
        "slot_occupancy",
        "padding_waste",
        "scheduler_share",
        "decode_step_s",
        "slo_attainment",
        "goodput_requests_per_s",
        "goodput_tokens_per_s",
    ):
        assert s[key] is None, key
    json.dumps(s, allow_nan=False)
    assert not any(isinstance(v, float) and math.isnan(v) for v in s.values())


def test_summary_without_slo_has_blank_goodput():
    s = M.summarize(latency_trace())
    assert s["goodput_tokens_per_s"] is None and s["slo_ttft_s"] is None
    assert isinstance(M.tbt_values(latency_trace()), np.ndarray)


def test_the_trace_slo_bounds_the_max_tbt_under_that_name():
    slo = M.SLO(ttft_s=1.6, max_tbt_s=1.2)
    s = M.summarize(latency_trace(), slo=slo)
    assert s["slo_max_tbt_s"] == 1.2 and "slo_tbt_s" not in s
    with pytest.raises(TypeError):
        M.SLO(ttft_s=1.0, tbt_s=1.2)  # one name for one bound: the max gap, not loadgen's TPOT


def test_speculation_over_several_runs_is_their_totals():
    """``metrics.speculation(a, b)``: drafts, acceptances and verify rows summed over the runs,
    the rates taken from the sums (not a mean of the runs' rates)."""
    from batchlab import make_engine
    from batchlab.core.fake import EchoRunner, FakeModel
    from batchlab.measurement.driver import run_workload
    from batchlab.measurement.workloads import Workload, WorkloadRequest

    def run(prompt, new):
        engine = make_engine(
            "stallfree", FakeModel(), runner=EchoRunner, num_speculative_tokens=3, max_batch_size=2
        )
        return run_workload(engine, Workload("w", "w", [WorkloadRequest("r", prompt, new)]), progress=False)

    a, b = run([5, 6, 7, 8, 9] * 3, 30), run([11, 12, 13] * 4, 12)
    one, two, both = M.speculation(a), M.speculation(b), M.speculation(a, b)
    for key in ("spec_drafted", "spec_accepted", "spec_verify_rows"):
        assert both[key] == one[key] + two[key] > 0
    assert both["spec_acceptance_rate"] == pytest.approx(both["spec_accepted"] / both["spec_drafted"])
    assert one["spec_acceptance_rate"] != two["spec_acceptance_rate"], (
        "the runs must differ for the test to mean anything"
    )
    assert both["spec_tokens_per_verify_row"] == pytest.approx(
        1 + both["spec_accepted"] / both["spec_verify_rows"]
    )
