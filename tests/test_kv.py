"""Paged KV memory on the fake model: blocks on demand, preemption by recompute, prefix
caching and priorities. Fast; every answer is checked against the fake model's known
output (``reference_output``), which no engine code computes."""

import random
from collections import Counter

import pytest

from batchlab import make_engine
from batchlab.core.fake import FakeModel, FakeRunner, reference_output
from batchlab.core.kv import BlockManager

LM = FakeModel()
EOS = frozenset({LM.eos_id})


def fake_engine(kind, **options):
    return make_engine(kind, LM, runner=FakeRunner, **options)


def expected(prompt, max_new):
    return reference_output(prompt, max_new, LM.vocab_size, EOS)


def check_blocks(blocks: BlockManager) -> None:
    """Conservation: every block is exactly one of free, evictable (cached, unreferenced)
    or referenced, and its reference count is the number of tables holding it."""
    free, evictable = blocks.free_blocks, list(blocks.evictable)
    holders = Counter(b for table in blocks.tables.values() for b in table)
    assert len(set(free)) == len(free), "a block is on the free list twice"
    for rid, table in blocks.tables.items():
        assert len(set(table)) == len(table), f"{rid}'s table holds a block twice"
    assert not set(free) & set(evictable), "a block is both free and evictable"
    assert not set(free) & set(holders), "a free block is still in a table"
    assert not set(evictable) & set(holders), "an evictable block is still in a table"
    assert len(free) + len(evictable) + len(holders) == blocks.num_blocks, "blocks lost or invented"
    for b in range(blocks.num_blocks):
        assert blocks.ref_counts[b] == holders.get(b, 0), f"block {b}: wrong reference count"
    for b, n in holders.items():
        assert n == 1 or b in blocks.key_of, f"block {b} is shared but not a cached prefix block"
    assert {b: k for k, b in blocks.cached.items()} == blocks.key_of, "cache maps disagree"
    assert all(b in blocks.key_of for b in evictable), "an evictable block has no cache key"
    assert not any(b in blocks.key_of for b in free), "a free-list block still has a cache key"


# -- the block manager alone ------------------------------------------------------------


def test_blocks_are_taken_on_demand_and_returned():
    bm = BlockManager(4, 2)
    assert bm.ensure("a", 3) == [0, 1] and bm.num_free == 2
    assert bm.ensure("a", 4) == [0, 1], "a table that already holds the tokens does not grow"
    assert bm.ensure("b", 1) == [2]
    with pytest.raises(MemoryError):
        bm.ensure("b", 5)  # needs 2 more, 1 free
    assert bm.tables["b"] == [2], "a failed allocation takes nothing"
    bm.release("a")
    bm.release("b")
    assert bm.num_free == 4 and not bm.tables
    check_blocks(bm)


def test_prefix_blocks_are_shared_cached_and_evicted_least_recent_first():
    bm = BlockManager(6, 2, enable_prefix_cache=True)
    seq_a = [5, 6, 7, 8, 9]  # blocks [5, 6] [7, 8] [9]
    bm.ensure("a", 5)
    bm.cache_full_blocks("a", 5, lambda i, j: seq_a[i:j])
    assert len(bm.cached) == 2, "two full blocks are named; the partial third is not"
    # The lookup never covers the block holding the last token (here all 4 tokens are full
    # blocks, yet only the first block may be shared, so a token is still computed).
    assert bm.lookup([5, 6, 7, 8]) == [bm.tables["a"][0]]
    assert bm.lookup([5, 6, 7, 8, 1]) == bm.tables["a"][:2]
    assert bm.lookup([5, 6, 1, 2, 3]) == bm.tables["a"][:1]
    assert bm.lookup([6, 5, 7, 8, 1]) == [], "the same block content after another prefix is a miss"
    hits = bm.lookup([5, 6, 7, 8, 1, 2])
    bm.share("b", hits)
    assert [bm.ref_counts[b] for b in hits] == [2, 2] and bm.hit_blocks == 2 and bm.hit_tokens == 4
    check_blocks(bm)
    bm.release("a")
    bm.release("b")
    assert bm.num_free == 6 and len(bm.evictable) == 2, "cached blocks stay, evictable"
    check_blocks(bm)
    head = bm.lookup([5, 6, 7, 8, 1])[0]
    bm.ensure("c", 10)  # 4 never-used blocks first, then the least recently used cached one:
    assert len(bm.evictable) == 1 and len(bm.cached) == 1  # a's tail, released first
    assert bm.lookup([5, 6, 7, 8, 1]) == [head], "the tail was evicted, the head is still shared"
    check_blocks(bm)


def test_truncate_frees_the_blocks_wholly_past_a_length():
    """Speculative decoding's rewind: a table shrinks to the blocks its first n tokens use."""
    bm = BlockManager(6, 4, enable_prefix_cache=True)
    assert bm.ensure("a", 11) == [0, 1, 2]
    bm.truncate("a", 8)  # positions 0-7: exactly two blocks, the third held only 8-10
    assert bm.tables["a"] == [0, 1] and bm.num_free == 4 and bm.free_blocks[-1] == 2
    bm.truncate("a", 5)  # position 4 is in block 1: it stays
    assert bm.tables["a"] == [0, 1]
    bm.truncate("a", 9)  # never grows
    assert bm.tables["a"] == [0, 1]
    check_blocks(bm)
    # a block another request shares loses one holder, not its keys and values
    seq = [5, 6, 7, 8, 9]
    bm.cache_full_blocks("a", 5, lambda i, j: seq[i:j])
    bm.share("b", bm.lookup(seq + [1]))
    bm.ensure("b", 7)
    bm.truncate("b", 0)
    assert bm.tables["b"] == [] and bm.ref_counts[0] == 1 and bm.tables["a"] == [0, 1]
    bm.truncate("a", 0)  # the cached block stays cached, evictable
    assert list(bm.evictable) == [0] and bm.num_free == 6
    bm.truncate("nobody", 3)  # a request with no blocks: nothing to do
    check_blocks(bm)
    for bad in (-1, 1.5, None, True):
        with pytest.raises(ValueError, match="num_tokens must be an integer >= 0"):
            bm.truncate("a", bad)


def test_prefix_cache_off_caches_nothing():
    bm = BlockManager(4, 2)
    bm.ensure("a", 4)
    bm.cache_full_blocks("a", 4, lambda i, j: [1, 2, 3, 4][i:j])
    assert bm.lookup([1, 2, 3, 4, 5]) == [] and not bm.cached


# -- engine: preemption ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,options",
    [("continuous", {"prefill_step": 8}), ("continuous", {}), ("stallfree", {"token_budget": 16})],
)
def test_preempted_requests_recompute_and_finish_with_the_right_tokens(kind, options):
    rng = random.Random(3)
    requests = [
        ([rng.randrange(1, 64) for _ in range(rng.randint(5, 30))], rng.randint(10, 40)) for _ in range(12)
    ]
    engine = fake_engine(kind, max_batch_size=6, kv_block_size=4, num_kv_blocks=20, **options)
    ids = [engine.submit(p, max_new_tokens=m, ignore_eos=True) for p, m in requests]
    while engine.step():
        check_blocks(engine.scheduler.blocks)
    stats = engine.stats()
    assert stats["preemptions"] > 0, "a pool of 20 blocks for 6 slots must preempt"
    assert (
        stats["preemptions"]
        == sum(len(s.preempted) for s in engine.trace.steps)
        == sum(r.preemptions for r in engine.trace.requests.values())
    )
    for rid, (prompt, max_new) in zip(ids, requests):
        tokens, status, reason = engine.poll(rid)
        assert (tokens, status, reason) == (
            reference_output(prompt, max_new, LM.vocab_size, frozenset()),
            "done",
            "length",
        )
    # A request preempted once went back to the queue; its next prefill restarted at token 0
    # and covered, chunk after chunk, its prompt + every token generated before.
    rid = next(r for r, rec in engine.trace.requests.items() if rec.preemptions == 1)
    record = engine.trace.requests[rid]
    assert [s for _, s in record.state_times].count("queued") == 2
    steps = list(engine.trace.steps)
    when = next(k for k, s in enumerate(steps) if rid in s.preempted)
    made = sum(len(s.emitted.get(rid, [])) for s in steps[: when + 1])
    refill = [p[1:] for s in steps[when + 1 :] for p in s.prefill if p[0] == rid]
    assert [start for start, _ in refill] == [sum(n for _, n in refill[:i]) for i in range(len(refill))]
    assert sum(n for _, n in refill) == record.prompt_len + made
    assert (
        engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
        and not engine.scheduler.blocks.tables
    )


def test_admission_waits_for_free_blocks():
    """With the pool full, a queued request is not admitted even though a slot is free."""
    engine = fake_engine("stallfree", max_batch_size=4, token_budget=64, kv_block_size=4, num_kv_blocks=10)
    engine.submit([1] * 35, max_new_tokens=3, ignore_eos=True, request_id="big")  # 9 blocks
    engine.submit([2] * 8, max_new_tokens=2, ignore_eos=True, request_id="small")  # 3 blocks
    engine.step()
    first = engine.trace.steps[0]
    assert [p[0] for p in first.prefill] == ["big"], "small must wait: 1 block free, it needs 2"
    assert engine.scheduler.slots.count(None) == 3
    engine.run_until_idle()
    assert engine.poll("small")[0] == reference_output([2] * 8, 2, LM.vocab_size, frozenset())


# -- engine: prefix caching -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["continuous", "stallfree"])
def test_prefix_cache_skips_shared_blocks_and_keeps_the_answers(kind):
    system = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 3, 3, 1]  # 13 tokens: 3 full blocks of 4
    prompts = [system + [10 + i, 20 + i] for i in range(5)]
    engine = fake_engine(kind, max_batch_size=2, kv_block_size=4, enable_prefix_cache=True)
    ids = []
    for p in prompts:  # one after another, so the first has filled the cache
        ids.append(engine.submit(p, max_new_tokens=5))
        engine.run_until_idle()
    for rid, p in zip(ids, prompts):
        assert engine.poll(rid)[0] == expected(p, 5)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 4 * 3 and stats["prefix_cache_hit_tokens"] == 4 * 12
    later = [p for s in engine.trace.steps for p in s.prefill if p[0] != ids[0]]
    assert {start for _, start, _ in later} == {12}, "later prompts start after 3 cached blocks"
    check_blocks(engine.scheduler.blocks)


def test_a_prompt_made_only_of_cached_blocks_still_computes_its_last_token():
    engine = fake_engine("continuous", max_batch_size=2, kv_block_size=4, enable_prefix_cache=True)
    prompt = list(range(1, 9))  # exactly 2 blocks
    for rid in ("a", "b"):
        engine.submit(prompt, max_new_tokens=3, request_id=rid)
        engine.run_until_idle()
        assert engine.poll(rid)[0] == expected(prompt, 3)
    assert [p for s in engine.trace.steps for p in s.prefill if p[0] == "b"] == [("b", 4, 4)]


def test_prefix_cache_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="enable_prefix_cache does not apply to the static"):
        fake_engine("static", enable_prefix_cache=True)


# -- everything at once ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,options",
    [
        ("continuous", {"max_batch_size": 8, "prefill_step": 16}),
        ("stallfree", {"max_batch_size": 8, "token_budget": 40}),
    ],
)
def test_thousand_random_requests_conserve_blocks(kind, options):
    """1,000 requests with shared prefixes, random priorities and random cancels, on a pool
    too small for the batch: after every step the blocks add up; at the end every block is
    back and every request that was not cancelled has the fake model's answer."""
    rng = random.Random(11)
    systems = [[rng.randrange(1, 64) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    engine = fake_engine(kind, kv_block_size=4, num_kv_blocks=48, enable_prefix_cache=True, **options)
    pending = []
    for i in range(1000):
        prefix = rng.choice(systems) if rng.random() < 0.7 else []
        prompt = prefix + [rng.randrange(1, 64) for _ in range(rng.randint(1, 20))]
        pending.append((f"r{i}", prompt, rng.randint(1, 24), rng.randint(0, 3)))
    prompts, cancelled = {}, set()
    while pending or engine.scheduler.has_work():
        for _ in range(rng.randint(0, 3)):
            if pending:
                rid, prompt, max_new, prio = pending.pop(0)
                engine.submit(prompt, max_new_tokens=max_new, request_id=rid, priority=prio)
                prompts[rid] = (prompt, max_new)
        if rng.random() < 0.05:
            live = [r for r in prompts if r not in cancelled]
            victim = rng.choice(live)
            if engine.cancel(victim):
                cancelled.add(victim)
        engine.step()
        check_blocks(engine.scheduler.blocks)
        step = engine.trace.steps[-1]
        if kind == "stallfree":  # one pass a step: nobody may decode and prefill in it
            assert not set(step.decoded) & {rid for rid, _, _ in step.prefill}, (
                "decode and prefill in one pass"
            )
        holders = set(engine.scheduler.blocks.tables)
        assert holders <= {r.id for r in engine.scheduler.running}, "blocks held by nobody running"
    engine.sweep()
    check_blocks(engine.scheduler.blocks)
    assert (
        engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
        and not engine.scheduler.blocks.tables
    )
    assert all(n == 0 for n in engine.scheduler.blocks.ref_counts)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert len(cancelled) > 0
    for rid, (prompt, max_new) in prompts.items():
        record = engine.trace.requests[rid]
        assert record.finish_reason is not None, f"{rid} never finished"
        want = expected(prompt, max_new)
        if rid in cancelled:
            assert record.output_ids == want[: len(record.output_ids)]
        else:
            assert record.output_ids == want, rid
    assert sum(r.preemptions > 0 for r in engine.trace.requests.values()) > 1


# -- the picture ------------------------------------------------------------------------


def test_block_view_shows_owners_shared_and_cached_blocks_from_the_trace():
    from batchlab.core.trace import Trace
    from batchlab.viz import CACHED, FREE, OWNED, SHARED, BlockView, block_states, plot_block_map

    engine = fake_engine(
        "stallfree",
        max_batch_size=2,
        token_budget=16,
        kv_block_size=4,
        num_kv_blocks=16,
        enable_prefix_cache=True,
    )
    system = list(range(1, 13))
    engine.submit(system + [20], max_new_tokens=8, ignore_eos=True, request_id="a")
    engine.step()
    engine.submit(system + [30], max_new_tokens=2, ignore_eos=True, request_id="b")
    engine.run_until_idle()
    trace = Trace.from_json(engine.trace.to_json())  # a recorded trace replays the same
    assert trace.num_kv_blocks == 16
    both = next(k for k, s in enumerate(trace.steps) if {"a", "b"} <= set(s.block_tables))
    states = block_states(trace, both)
    assert sum(kind == SHARED for kind, _ in states) == 3, "the 3 full system-prompt blocks"
    assert all(sorted(who) == ["a", "b"] for kind, who in states if kind == SHARED)
    for kind, who in states:
        assert (kind == OWNED) == (len(who) == 1) and (kind in (FREE, CACHED)) == (not who)
    last = block_states(trace, len(trace.steps) - 1)
    assert {kind for kind, _ in last} <= {FREE, CACHED} and any(k == CACHED for k, _ in last)
    view = BlockView(trace)
    view.show_step(both)
    page = view.to_html()
    assert page.count("shared by a, b") == 3 and "×2" in page and "of 16 in use" in page
    assert "image/png" in view._repr_mimebundle_()
    assert plot_block_map(trace).axes[0].get_ylabel() == "KV block"
