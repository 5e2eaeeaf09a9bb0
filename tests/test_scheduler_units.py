"""Each scheduler's planning, driven directly: no engine, no runner, no model.

A step here is what the engine does with a scheduler: for every Batch that ``passes()``
yields, ``prepare`` it (take blocks, make chunks), "run" it (every sampled chunk gets
token 7), and ``postprocess`` the tokens. The tests read the plans, slots and blocks.
"""

from __future__ import annotations

import pytest

from batchlab.core.kv import BlockManager
from batchlab.core.request import Request, SamplingParams, State
from batchlab.core.scheduler import (
    ContinuousScheduler,
    SequentialScheduler,
    StallFreeScheduler,
    StaticScheduler,
    StopRules,
)

EOS = 0


def request(rid: str, prompt_len: int, max_new: int, arrival: float = 0.0, priority: int = 0):
    return Request(
        rid,
        list(range(1, prompt_len + 1)),
        max_new,
        SamplingParams(),
        frozenset({EOS}),
        arrival,
        priority=priority,
    )


def make(cls, num_blocks=64, block_size=4, **options):
    return cls(BlockManager(num_blocks, block_size), lambda: 0.0, **options)


def step(sched, token: int = 7) -> list[tuple[list[str], list[tuple[str, int]], list[str]]]:
    """One engine step; returns each pass as (decode ids, prefill (id, tokens), padding ids)."""
    passes = []
    for batch in sched.passes():
        chunks = sched.prepare(batch)
        assert [c.req_id for c in chunks] == [r.id for r in batch.requests]
        sched.postprocess(batch, [token if c.sampler else None for c in chunks], now=0.0)
        passes.append(
            (
                [r.id for r in batch.decode],
                [(r.id, n) for r, n in batch.prefill],
                [r.id for r in batch.padding],
            )
        )
    return passes


def test_sequential_runs_one_request_to_its_end_before_the_next():
    s = make(SequentialScheduler)
    a, b = request("a", 5, 3), request("b", 2, 1)
    s.add(a), s.add(b)
    assert step(s) == [([], [("a", 5)], [])]  # the whole prompt, one token sampled
    assert step(s) == [(["a"], [], [])]
    assert step(s) == [(["a"], [], [])]
    assert a.finished and a.finish_reason == "length" and a.output_ids == [7, 7, 7]
    assert step(s) == [([], [("b", 2)], [])]
    assert b.finished and not s.has_work()
    assert s.blocks.num_free == s.blocks.num_blocks


def test_static_batch_keeps_finished_rows_as_padding_and_admits_nobody_midway():
    s = make(StaticScheduler, max_batch_size=2)
    a, b, c = request("a", 3, 1), request("b", 6, 3), request("c", 2, 1)
    for r in (a, b, c):
        s.add(r)
    assert s.blocks.reserved == {}
    # prefill together, then the step's decode pass; a is done after its first token and
    # stays as a padding row (computed, thrown away)
    assert step(s) == [([], [("a", 3), ("b", 6)], []), (["b"], [], ["a"])]
    assert a.finished
    assert step(s) == [(["b"], [], ["a"])]  # c waits although a's row is done
    assert b.finished and s.slots == [None, None] and not s.blocks.reserved
    assert step(s) == [([], [("c", 2)], [])]  # the next batch


def test_continuous_admits_one_prefill_at_a_time_and_places_into_free_slots():
    s = make(ContinuousScheduler, max_batch_size=1, prefill_step=4)
    a, b = request("a", 6, 2), request("b", 3, 2)
    s.add(a), s.add(b)
    assert step(s) == [([], [("a", 4)], [])]  # chunk 1 of a; b waits in the queue
    assert a.state is State.PREFILLING and s.queue[0] is b
    assert step(s) == [([], [("a", 2)], []), (["a"], [], [])]  # last chunk samples; placed; decodes
    assert a.finished and a.output_ids == [7, 7]
    assert step(s) == [([], [("b", 3)], []), (["b"], [], [])]


def test_continuous_admits_nobody_while_a_prefilled_request_awaits_a_slot():
    s = make(ContinuousScheduler, max_batch_size=1)
    a, b, c = request("a", 2, 5), request("b", 2, 5), request("c", 2, 5)
    for r in (a, b, c):
        s.add(r)
    step(s)  # a prefills and takes the only slot
    step(s)  # b prefills, then waits: no free slot
    assert b.state is State.AWAITING_SLOT and s.in_state(State.AWAITING_SLOT) == [b]
    assert step(s) == [(["a"], [], [])]  # c is not admitted while b waits
    assert c.state is State.QUEUED


def test_stallfree_plans_decodes_first_then_prefills_within_the_budget():
    s = make(StallFreeScheduler, max_batch_size=3, token_budget=8)
    a, b, c = request("a", 3, 4), request("b", 10, 4), request("c", 4, 4)
    for r in (a, b, c):
        s.add(r)
    assert step(s) == [([], [("a", 3), ("b", 5)], [])]  # one fused pass, 8 tokens
    assert step(s) == [(["a"], [("b", 5), ("c", 2)], [])]  # decode first, then continue, admit
    for _ in range(6):
        for decode, prefill, _ in step(s):
            assert len(decode) + sum(n for _, n in prefill) <= 8
    assert all(r.finished for r in (a, b, c)) and s.blocks.num_free == s.blocks.num_blocks


def test_on_demand_kinds_preempt_the_least_important_newest_request_when_blocks_run_out():
    s = make(StallFreeScheduler, num_blocks=4, block_size=4, max_batch_size=2, token_budget=8)
    old, new = request("old", 4, 8, arrival=0.0), request("new", 4, 8, arrival=1.0)
    s.add(old), s.add(new)
    step(s)  # both prefill: 2 blocks, 2 free; each decode row then needs a second block,
    for _ in range(5):  # and at position 8 a third: the pool is dry
        step(s)
    assert new.record.preemptions >= 1 and old.record.preemptions == 0
    assert new.state in (State.QUEUED, State.PREFILLING, State.DECODING)
    while s.has_work():
        step(s)
    assert old.output_ids == new.output_ids == [7] * 8  # recompute loses nothing


def test_prepare_refuses_to_write_into_a_shared_block():
    s = make(ContinuousScheduler, block_size=4)
    a = request("a", 6, 2)
    s.blocks.tables["a"] = [0, 1]
    s.blocks.ref_counts[0] = s.blocks.ref_counts[1] = 2  # as if a prefix-cached twin held them
    from batchlab.core.scheduler import Batch

    with pytest.raises(RuntimeError, match="would overwrite KV block 0"):
        s.prepare(Batch(prefill=[(a, 6)]))


# -- a request's lifecycle ----------------------------------------------------------------
def test_request_lifecycle_and_finish_reasons():
    r = request("r", 3, 3)
    assert r.state is State.QUEUED and r.prefill_left == 3
    r.set_state(State.PREFILLING, 1.0)
    r.num_computed = 3
    assert r.prefill_left == 0
    rules = StopRules()
    r.add_token(5, 2.0)
    assert rules.finish_reason(r, 5) is None and r.pending == [5]
    r.add_token(EOS, 3.0)
    assert rules.finish_reason(r, EOS) == "stop"
    r.finish("stop", 3.0)
    assert r.finished and r.record.finish_reason == "stop"
    assert [s for _, s in r.record.state_times] == ["queued", "prefilling", "finished"]
    assert r.record.first_token_s == 2.0 and r.record.token_times_s == [2.0, 3.0]
    long = request("l", 2, 2)
    long.add_token(4, 0.0)
    assert rules.finish_reason(long, 4) is None
    long.add_token(4, 0.0)
    assert rules.finish_reason(long, 4) == "length"


def test_preempted_request_recomputes_prompt_and_outputs():
    sched = make(ContinuousScheduler)
    waiting, r = request("w", 2, 5), request("r", 3, 5)
    sched.add(r), sched.add(waiting)
    sched.start(r, 3)
    r.num_computed = 3
    r.add_token(8, 0.0), r.add_token(9, 0.0)
    sched.blocks.ensure("r", 5)
    r.num_computed = 4
    free = sched.blocks.num_free
    sched.preempt(r)
    assert r.state is State.QUEUED and r.num_computed == 0 and r.slot is None
    assert list(sched.queue) == [r, waiting] and r not in sched.running  # the front: it started first
    assert sched.blocks.num_free == free + 2 and sched.preempted == ["r"] and sched.num_preemptions == 1
    assert r.prefill_len == 5 and r.token_ids(0, 5) == [1, 2, 3, 8, 9]
    assert r.token_ids(2, 4) == [3, 8] and r.record.preemptions == 1
    assert r.next_input() == [9]


def test_a_cancelled_request_preempted_gives_its_blocks_back_and_is_not_queued():
    sched = make(ContinuousScheduler)
    r = request("r", 3, 5)
    sched.add(r)
    sched.start(r, 3)
    free = sched.blocks.num_free
    r.finish("cancelled", 0.0)  # cancelled, not swept yet
    sched.preempt(r)
    assert not sched.queue and r not in sched.running and sched.blocks.num_free == free + 1
    assert sched.num_preemptions == 0 and r.record.preemptions == 0  # it was not preempted: it ended
