"""Policies on the fake model and the simulator: admission control (a bounded queue), load
shedding, and priorities. Nothing is lost, every request ends with a reason, the counts add up."""

import pytest

from batchlab import make_engine
from batchlab.core.fake import FakeModel, FakeRunner, reference_output
from batchlab.core.policies import Admission, QueueFull
from batchlab.core.costmodel import CostModel
from batchlab.measurement.simulator import make_sim_engine, simulate
from batchlab.measurement.workloads import synthetic_workload

LM = FakeModel()
EOS = frozenset({LM.eos_id})
# A simple, fixed cost model: these tests are about policy, not about this machine.
COST = CostModel(
    {
        "passes": 0.02,
        "tokens": 0.001,
        "decode_rows": 0.0,
        "decode_context": 0.0,
        "prefill_chunks": 0.0,
        "prefill_attention": 0.0,
    }
)


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_queue=-1),
        dict(max_queue=2.5),
        dict(max_wait_s=-1),
        dict(max_wait_s=float("inf")),
        dict(max_wait_s="1"),
    ],
)
def test_bad_admission_options_are_refused(bad):
    with pytest.raises(ValueError, match="max_"):
        Admission(**bad)


@pytest.mark.parametrize("kind", ["static", "continuous", "stallfree"])
def test_a_full_queue_refuses_and_changes_nothing(kind):
    engine = make_engine(kind, LM, runner=FakeRunner, max_batch_size=2, admission=Admission(max_queue=3))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    ids = [engine.submit(p, max_new_tokens=5) for p in prompts[:3]]
    with pytest.raises(QueueFull, match="queue is full"):
        engine.submit(prompts[3], max_new_tokens=5)
    assert engine.queue_depth() == 3
    assert engine.poll("req-3") == ([], "unknown", None)  # the refused one left no trace
    engine.step()  # requests start, the queue shrinks, and there is room again
    ids.append(engine.submit(prompts[3], max_new_tokens=5))
    engine.run_until_idle()
    for rid, p in zip(ids, prompts):
        assert engine.poll(rid) == (reference_output(p, 5, LM.vocab_size, EOS), "done", "length")


def test_no_bound_by_default():
    engine = make_engine("stallfree", LM, runner=FakeRunner, max_batch_size=2)
    for i in range(500):
        engine.submit([1 + i % 50, 2], max_new_tokens=1)
    assert engine.queue_depth() == 500


@pytest.mark.parametrize(
    "kind,options",
    [
        ("stallfree", dict(max_batch_size=4, token_budget=64)),
        ("continuous", dict(max_batch_size=4, prefill_step=32)),
        ("static", dict(max_batch_size=4)),
    ],
)
def test_shedding_under_overload_loses_nothing(kind, options):
    max_wait = 2.0
    engine = make_sim_engine(kind, COST, admission=Admission(max_wait_s=max_wait), **options)
    workload = synthetic_workload(300, rate=20.0, seed=3, prompt_median=40, output_median=16)
    trace = simulate(engine, workload)
    reasons = [r.finish_reason for r in trace.requests.values()]
    assert len(reasons) == 300 and set(reasons) <= {"length", "shed"}
    shed = [r for r in trace.requests.values() if r.finish_reason == "shed"]
    assert shed, "20 requests/s is far above what 4 slots serve: some must be shed"
    assert engine.finished_by_reason == {"length": 300 - len(shed), "shed": len(shed)}
    assert engine.stats()["finished"]["shed"] == len(shed)
    for r in shed:  # shed: never ran, and only after waiting longer than allowed
        assert r.output_ids == [] and r.first_token_s is None
        assert r.finished_s - r.arrival_s > max_wait
    for r in trace.requests.values():
        if r.finish_reason == "length":  # served: it started before its wait ran out
            started = r.state_times[1][0]
            assert started - r.arrival_s <= max_wait
            assert len(r.output_ids) == r.max_new_tokens
    for rid in trace.requests:  # poll reports each ending, and nothing stays behind
        status, reason = engine.poll(rid)[1:]
        assert status == "done" and reason == trace.requests[rid].finish_reason
    assert (
        engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
        and not engine.scheduler.blocks.reserved
    )


def test_bounded_queue_in_the_simulator_accounts_for_every_request():
    engine = make_sim_engine(
        "stallfree", COST, max_batch_size=4, token_budget=64, admission=Admission(max_queue=10)
    )
    trace = simulate(engine, synthetic_workload(300, rate=20.0, seed=4, prompt_median=40, output_median=16))
    reasons = [r.finish_reason for r in trace.requests.values()]
    rejected = reasons.count("rejected")
    assert rejected > 0 and reasons.count("length") == 300 - rejected
    assert max(s.queued for s in trace.steps) <= 10


# -- priorities: who is served first, who gives way -----------------------------------------


def priority_engine(kind, **options):
    return make_engine(kind, LM, runner=FakeRunner, **options)


def test_queue_is_served_by_priority_then_arrival():
    engine = priority_engine("continuous", max_batch_size=1)
    for rid, prio in [("low", 5), ("mid-1", 1), ("high", 0), ("mid-2", 1)]:
        engine.submit([1, 2, 3], max_new_tokens=2, ignore_eos=True, request_id=rid, priority=prio)
    engine.run_until_idle()
    starts = [p[0] for s in engine.trace.steps for p in s.prefill]
    assert starts == ["high", "mid-1", "mid-2", "low"]


def test_default_priority_keeps_first_come_first_served():
    engine = priority_engine("stallfree", max_batch_size=1, token_budget=4)
    for rid in "abcd":
        engine.submit([1, 2, 3], max_new_tokens=2, ignore_eos=True, request_id=rid)
    engine.run_until_idle()
    assert [p[0] for s in engine.trace.steps for p in s.prefill] == list("abcd")


def test_the_victim_is_the_least_important_then_the_newest():
    engine = priority_engine(
        "stallfree", max_batch_size=3, token_budget=32, kv_block_size=4, num_kv_blocks=12
    )
    engine.submit([1] * 4, max_new_tokens=30, ignore_eos=True, request_id="old-low", priority=2)
    engine.submit([2] * 4, max_new_tokens=30, ignore_eos=True, request_id="vip", priority=0)
    engine.submit([3] * 4, max_new_tokens=30, ignore_eos=True, request_id="new-low", priority=2)
    first = None
    while engine.step():
        preempted = engine.trace.steps[-1].preempted
        if preempted and first is None:
            first = preempted[0]
    assert first == "new-low"
    assert engine.trace.requests["vip"].preemptions == 0, "the most important is never preempted"
    for rid, tok in [("old-low", 1), ("vip", 2), ("new-low", 3)]:
        assert engine.poll(rid)[0] == reference_output([tok] * 4, 30, LM.vocab_size, frozenset())


@pytest.mark.parametrize("bad", [1.5, "high", True, None])
def test_priority_must_be_an_integer(bad):
    engine = priority_engine("continuous")
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.submit([1, 2], priority=bad)
    assert not engine.scheduler.has_work() and engine.stats()["queued"] == 0
