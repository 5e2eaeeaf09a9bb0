"""Checkers for lesson 8 (memory as the limit).

``kv_slots``       where tokens live: a block table turned into flat KV-pool slots;
``cached_prefix``  the prefix-cache lookup: a chain of block keys, longest cached run;
``choose_victim``  who gives way when the pool runs dry (lowest priority, then newest).

Every answer is compared with the library's own code (``BlockManager.slots``,
``BlockManager.lookup``, ``PriorityPolicy.victim``); the victim is also plugged into a
fake-model engine whose pool is too small, and the run compared with the library's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

from ..batch import Chunk
from ..engine import make_engine
from ..fake import FakeModel, FakeRunner, TickClock
from ..kv import BlockManager
from ..policies import PriorityPolicy
from ._core import Case, Verdict, answer_compare, run_cases, show

__all__ = ["kv_slots", "cached_prefix", "choose_victim"]


def _ints(why_not: str):
    """A reader for ``answer_compare``: a list of ints from anything that converts, else ``why_not``."""
    def read(got):
        try:
            return [int(x) for x in got], None
        except (TypeError, ValueError):
            return None, why_not
    return read


# ---------------------------------------------------------------------------------------
# Exercise 1: block table -> slots.

def _slots_reference(table, start, stop, block_size):
    return Chunk("r", [], 0, list(table)).slot_mapping(start, stop, block_size).tolist()


def kv_slots(fn: Callable) -> Verdict:
    """Check ``fn(table, start, stop, block_size) -> list of ints``: the flat KV-pool slot of
    each token ``start .. stop-1`` of a request whose block table is ``table``."""

    def compare_for(table, start, stop, block_size):
        def diagnose(got, expected):
            if len(got) != len(expected):
                return f"{len(got)} slots for {stop - start} tokens: one slot per token start..stop-1"
            naive = list(range(start, stop))
            if got == naive:
                return ("those are the token positions themselves; a token lives in block "
                        "table[position // block_size], at offset position % block_size")
            wrong_block = [(p // block_size) * block_size + p % block_size for p in range(start, stop)]
            if got == wrong_block:
                return "look the block number up in the table: table[position // block_size]"
            if got == [table[p // block_size] + p % block_size for p in range(start, stop)]:
                return ("a block holds block_size slots: block b starts at slot b * block_size, "
                        "not at slot b")
            return ""
        return answer_compare(_ints("return a list of slot numbers (ints), one per token"), diagnose)

    rows = [
        ("one block, table [0], tokens 0..3, block size 4", [0], 0, 4, 4, ""),
        ("table [5], tokens 0..2: block 5 starts at slot 20", [5], 0, 3, 4,
         "block b holds slots b * block_size .. b * block_size + block_size - 1"),
        ("table [3, 0, 7], tokens 0..9, block size 4: the tokens cross from block 3 to 0 to 7",
         [3, 0, 7], 0, 10, 4, "token i sits in block table[i // block_size]"),
        ("the same table, tokens 5..8 only (a later chunk starts mid-block)", [3, 0, 7], 5, 9, 4, ""),
        ("a decode row: one token, position 33, table [2, 9, 4], block size 16",
         [2, 9, 4], 33, 34, 16, ""),
        ("no tokens (start == stop): an empty list", [1], 2, 2, 4, ""),
    ]
    cases = [Case(label, lambda f, t=table, a=start, b=stop, s=size: f(list(t), a, b, s),
                  _slots_reference(table, start, stop, size), compare_for(table, start, stop, size), hint)
             for label, table, start, stop, size, hint in rows]
    return run_cases("kv_slots", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 2: the prefix-cache lookup.

def _cache_of(sequence, block_size, blocks):
    """A cache holding ``sequence``'s full blocks as the given block numbers."""
    cached, key = {}, b""
    for i, block in enumerate(blocks):
        key = BlockManager.block_key(key, sequence[i * block_size:(i + 1) * block_size])
        cached[key] = block
    return cached


def _lookup_reference(token_ids, cached, block_size):
    manager = BlockManager(1, block_size, enable_prefix_cache=True)
    manager.cached = dict(cached)
    return manager.lookup(token_ids)


def cached_prefix(fn: Callable) -> Verdict:
    """Check ``fn(token_ids, cached, block_size) -> list of blocks``: the blocks of the
    longest run of full blocks at the start of ``token_ids`` found in ``cached`` (block
    key -> block), keys chained with ``BlockManager.block_key(parent_key, tokens)`` from
    ``b""``; never the block that holds the last token."""
    system = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # 3 blocks of 4
    cache = _cache_of(system, 4, [7, 2, 5])

    def compare_for(token_ids, cached, block_size):
        full = (len(token_ids) - 1) // block_size

        def diagnose(got, expected):
            if len(got) > full:
                return (f"only the first {full} block(s) may be shared: the block holding the "
                        f"last prompt token is always computed, so the request still gets a "
                        f"next-token distribution")
            if len(got) > len(expected):
                return ("a block's key chains its parent's key (b\"\" for the first block); the "
                        "same tokens after a different prefix are a different block")
            if len(got) < len(expected) and got == expected[:len(got)]:
                return "you stopped early: keep going while the next block's key is in the cache"
            return ""
        return answer_compare(_ints("return a list of block numbers (the values of the cache)"),
                              diagnose)

    rows = [
        ("nothing cached: no hit", system + [1, 2], {}, 4, ""),
        ("a prompt that starts with the 3 cached blocks, then 2 more tokens: all 3 are shared",
         system + [1, 2], cache, 4, "hash block by block, each key from the previous key and the block's tokens"),
        ("the same 12 tokens and nothing after: only 2 blocks, the third holds the last token",
         list(system), cache, 4, "stop before the block that holds the last token"),
        ("the prompt differs in its 6th token: only the first block matches",
         system[:5] + [99] + system[6:] + [1], cache, 4, "stop at the first key not in the cache"),
        ("the second block's tokens, but after a different first block: no hit",
         [1, 1, 1, 1] + system[4:8] + [3], cache, 4,
         "a key includes everything before the block (through the parent's key)"),
        ("a prompt shorter than one block: no full block, no hit", system[:3], cache, 4, ""),
        ("block size 2: a 9-token prompt over a cache of its first 3 blocks",
         [5, 6, 7, 8, 9, 10, 11, 12, 13], _cache_of([5, 6, 7, 8, 9, 10], 2, [0, 3, 1]), 2, ""),
    ]
    cases = [Case(label, lambda f, t=tokens, c=cached, s=size: f(list(t), dict(c), s),
                  _lookup_reference(tokens, cached, size), compare_for(tokens, cached, size), hint)
             for label, tokens, cached, size, hint in rows]
    return run_cases("cached_prefix", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 3: the preemption victim.

def _req(rid, priority, arrival_s):
    return SimpleNamespace(id=rid, priority=priority, arrival_s=arrival_s)


class _LearnerPolicy(PriorityPolicy):
    """The library's policy with the victim chosen by the learner's function."""

    def __init__(self, fn):
        self.fn = fn

    def victim(self, running):
        chosen = self.fn(list(running))
        if chosen not in running:
            raise RuntimeError(f"choose_victim returned {show(chosen)}, which is not one of "
                               f"the running requests: return one of them")
        return chosen


def _preempting_run(policy: PriorityPolicy):
    """Six requests of mixed priority on a pool too small for them (fake model): the
    preemptions of each step and the tokens of each request."""
    engine = make_engine("stallfree", FakeModel(), runner=FakeRunner, max_batch_size=4,
                         token_budget=24, policy=policy, num_kv_blocks=14, kv_block_size=4,
                         clock=TickClock())
    for i, prio in enumerate([1, 0, 2, 1, 0, 2]):
        engine.submit([(7 * i + j) % 60 + 1 for j in range(6 + i)], max_new_tokens=20,
                      ignore_eos=True, request_id=f"r{i}", priority=prio)
    engine.run_until_idle()
    return ([s.preempted for s in engine.trace.steps if s.preempted],
            {rid: list(r.output_ids) for rid, r in engine.trace.requests.items()})


def choose_victim(fn: Callable) -> Verdict:
    """Check ``fn(running) -> request``: ``running`` lists the requests holding KV blocks in
    admission order (each has ``.id``, ``.priority``, lower is more important, and
    ``.arrival_s``); return the one to preempt: the least important (highest priority
    number), and among those the newest arrival (the latest admitted if arrivals tie)."""

    def case(label, running, hint=""):
        def call(f):
            got = f(list(running))
            return getattr(got, "id", got)

        def compare(got, expected):
            if got == expected:
                return None
            if isinstance(got, str) and got in {r.id for r in running}:
                picked = next(r for r in running if r.id == got)
                want = next(r for r in running if r.id == expected)
                if picked.priority < want.priority:
                    return (f"{got} has priority {picked.priority}, more important than "
                            f"{expected}'s {want.priority}: lower numbers are MORE important")
                if picked.priority == want.priority:
                    return (f"{got} and {expected} have the same priority; the newer one "
                            f"(later arrival) gives way: it has the least work to lose")
                return ""
            return "return one of the running requests (the object itself)"

        return Case(label, call, PriorityPolicy().victim(running).id, compare, hint)

    def engine_case():
        expected = _preempting_run(PriorityPolicy())

        def compare(got, exp):
            if got == exp:
                return None
            if got[0] != exp[0]:
                k = next((i for i, (a, b) in enumerate(zip(got[0], exp[0])) if a != b),
                         min(len(got[0]), len(exp[0])))
                return (f"preemption number {k + 1}: yours preempted "
                        f"{got[0][k] if k < len(got[0]) else 'nobody'}, the library "
                        f"{exp[0][k] if k < len(exp[0]) else 'nobody'}")
            return "the preemptions match but the outputs differ"

        return Case("in the engine: 6 requests of priorities [1, 0, 2, 1, 0, 2] share a pool of "
                    "14 blocks of 4 tokens (fake model); every preemption must match the "
                    "library's", lambda f: _preempting_run(_LearnerPolicy(f)), expected, compare,
                    show=lambda v: f"preemptions {v[0][:6]}{' ...' if len(v[0]) > 6 else ''}")

    return run_cases("choose_victim", fn, [
        case("all priority 0, arrivals 1, 2, 3: the newest gives way",
             [_req("a", 0, 1.0), _req("b", 0, 2.0), _req("c", 0, 3.0)],
             "with equal priorities, the newest arrival is the victim"),
        case("an old request of priority 5 among newer ones of priority 0",
             [_req("old", 5, 1.0), _req("b", 0, 2.0), _req("c", 0, 3.0)],
             "the least important (highest number) goes first, however old"),
        case("two of priority 2 (arrivals 1 and 4) and one of priority 1 (arrival 9)",
             [_req("x", 2, 1.0), _req("y", 1, 9.0), _req("z", 2, 4.0)],
             "among the least important, the newest"),
        case("only one request runs: it is the victim", [_req("solo", 0, 1.0)]),
        case("equal priority and equal arrival: the one admitted last (end of the list)",
             [_req("p", 1, 2.0), _req("q", 1, 2.0), _req("r", 0, 2.0)],
             "break a full tie by admission order: the last in the list"),
        engine_case(),
    ])
