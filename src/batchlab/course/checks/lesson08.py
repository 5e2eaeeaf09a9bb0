"""Checkers for lesson 8 (memory as the limit), against the library's own code and fake-model runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

from ...core.fake import reference_output
from ...core.kv import BlockManager
from ...core.policies import Policy, PriorityPolicy
from ...core.request import Request, SamplingParams, State
from ...core.runner import Chunk
from ...core.scheduler import ContinuousScheduler, OnDemandKV, Scheduler, StallFreeScheduler
from ...measurement.workloads import Workload, WorkloadRequest as _W
from ._core import Case, Verdict, answer_compare, run_cases, show, table
from ._pieces import VOCAB, piece_case, run_piece
from ._lineage import KINDS_OF_OURS, ancestry_problem

__all__ = ["kv_slots", "cached_prefix", "memory_scheduler"]


def _ints(why_not: str):
    def read(got):
        try:
            return [int(x) for x in got], None
        except (TypeError, ValueError):
            return None, why_not

    return read


def _slots(table, start, stop, size):
    return Chunk("r", [], 0, list(table)).kv_addresses(start, stop, size).tolist()


def kv_slots(fn: Callable) -> Verdict:
    """Check ``fn(table, start, stop, block_size) -> list of ints``: the KV slot of tokens start..stop-1."""

    def judge(table, start, stop, size):
        def diagnose(got, expected):
            positions = range(start, stop)
            if len(got) != len(expected):
                return f"{len(got)} slots for {stop - start} tokens: one slot per token start..stop-1"
            if got == list(positions):
                return "those are the token positions: a token lives in block table[position // block_size]"
            if got == [table[p // size] + p % size for p in positions]:
                return "a block holds block_size slots: block b starts at slot b * block_size, not at slot b"
            return ""

        return answer_compare(_ints("return a list of slot numbers (ints), one per token"), diagnose)

    rows = [
        ("one block, table [0], tokens 0..3, block size 4", [0], 0, 4, 4),
        ("table [5], tokens 0..2: block 5 starts at slot 20", [5], 0, 3, 4),
        ("table [3, 0, 7], tokens 0..9, block size 4: from block 3 to 0 to 7", [3, 0, 7], 0, 10, 4),
        ("the same table, tokens 5..8 only (a later chunk starts mid-block)", [3, 0, 7], 5, 9, 4),
        ("a decode row: one token, position 33, table [2, 9, 4], block size 16", [2, 9, 4], 33, 34, 16),
        ("no tokens (start == stop): an empty list", [1], 2, 2, 4),
    ]
    return table("kv_slots", fn, rows, _slots, judge, "token i sits in block table[i // block_size]")


def _cache_of(sequence, block_size, blocks):
    cached, key = {}, b""
    for i, block in enumerate(blocks):
        key = BlockManager.block_key(key, sequence[i * block_size : (i + 1) * block_size])
        cached[key] = block
    return cached


def _lookup_reference(token_ids, cached, block_size):
    manager = BlockManager(1, block_size, enable_prefix_cache=True)
    manager.cached = dict(cached)
    return manager.lookup(token_ids)


def cached_prefix(fn: Callable) -> Verdict:
    """Check ``fn(token_ids, cached, block_size) -> blocks``: the cached prefix, never the last block."""
    system = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # 3 blocks of 4
    cache = _cache_of(system, 4, [7, 2, 5])
    differs = system[:5] + [99] + system[6:] + [1]
    small = _cache_of([5, 6, 7, 8, 9, 10], 2, [0, 3, 1])

    def judge(token_ids, cached, block_size):
        full = (len(token_ids) - 1) // block_size

        def diagnose(got, expected):
            if len(got) > full:
                why = "the block holding the last prompt token is always computed, so the request still"
                return f"only the first {full} block(s) may be shared: {why} gets a next-token distribution"
            if len(got) > len(expected):
                return "a block's key chains its parent's: after another prefix it is another block"
            if len(got) < len(expected) and got == expected[: len(got)]:
                return "you stopped early: keep going while the next block's key is in the cache"
            return ""

        return answer_compare(_ints("return a list of block numbers (the values of the cache)"), diagnose)

    rows = [
        ("nothing cached: no hit", system + [1, 2], {}, 4),
        ("a prompt of the 3 cached blocks, then 2 more tokens: all 3 are shared", system + [1, 2], cache, 4),
        ("the same 12 tokens alone: only 2 blocks, the third holds the last token", list(system), cache, 4),
        ("the prompt differs in its 6th token: only the first block matches", differs, cache, 4),
        ("block 2's tokens after a different first block: no hit", [1] * 4 + system[4:8] + [3], cache, 4),
        ("a prompt shorter than one block: no full block, no hit", system[:3], cache, 4),
        ("block size 2: a 9-token prompt over a cache of its first 3 blocks", list(range(5, 14)), small, 2),
    ]
    return table("cached_prefix", fn, rows, _lookup_reference, judge)


def _prompt(i, n, offset=0):  # token ids < 60
    return [(7 * i + 3 * j + offset) % 59 + 1 for j in range(n)]


VICTIM = "the least important (highest number) gives way; among equals the newest; on a full tie the last"
_POOL = dict(max_batch_size=4, token_budget=24, num_kv_blocks=14)
SCENARIOS = {  # name: (in words, requests arriving at once, (engine options, priorities, must preempt))
    "tight": (
        "6 requests growing on a pool of 14 blocks of 4 tokens (preemptions must happen)",
        [_W(f"r{i}", _prompt(i, 6 + 3 * i), 14 + 2 * i) for i in range(6)],
        (_POOL, None, True),
    ),
    "priorities": (
        "6 requests of priorities [1, 0, 2, 1, 0, 2] on 14 blocks (preemptions must happen)",
        [_W(f"p{i}", _prompt(i, 6 + i, 5), 20) for i in range(6)],
        (_POOL, {f"p{i}": prio for i, prio in enumerate([1, 0, 2, 1, 0, 2])}, True),
    ),
    "long prompts": (
        "5 prompts of 30-50 tokens, a budget of 12 tokens a step (chunked admission)",
        [_W(f"l{i}", _prompt(i, 30 + 5 * i), 6) for i in range(5)],
        (dict(max_batch_size=4, token_budget=12, num_kv_blocks=24), None, False),
    ),
    "shared prefix": (
        "6 requests sharing a 16-token prefix, prefix cache on",
        [_W(f"s{i}", _prompt(99, 16) + _prompt(i, 3 + i), 8) for i in range(6)],
        (dict(max_batch_size=4, token_budget=24, num_kv_blocks=11, enable_prefix_cache=True), None, False),
    ),
}


def _prompt_only_fits(sched, req, max_tokens, decoding: int) -> bool:
    """The lesson's rule applied to the prompt alone, forgetting a preempted request's tokens."""
    hits = sched.blocks.lookup(req.token_ids(0, req.prompt_len))
    cached = len(hits) * sched.blocks.block_size
    n = min(max_tokens, req.prompt_len - cached)
    taken = (
        sched.blocks.blocks_for(cached + n) - len(hits) + sum(sched.blocks.ref_counts[b] == 0 for b in hits)
    )
    return taken + decoding <= sched.blocks.num_free


def _why_fits_differs(sched, req, max_tokens, got: bool) -> str:
    """The situation where the learner's fits disagrees with ours, and each mistake the lesson
    warns about whose rule gives the learner's answer there (none named if none does)."""
    hits, cached, n = sched.first_chunk(req, max_tokens)
    blocks, free = sched.blocks, sched.blocks.num_free
    decoding = len(sched.in_state(State.DECODING))
    evictable = sum(blocks.ref_counts[b] == 0 for b in hits)
    taken = blocks.blocks_for(cached + n) - len(hits) + evictable  # what the first chunk takes from the pool
    again = len(req.output_ids)  # tokens it generated before a preemption, to prefill again
    what = f"a {req.prefill_len}-token prefill ({req.prompt_len} of prompt, {again} generated before a preemption)"
    situation = f"({what if again else f'a {req.prefill_len}-token prompt'}, max_tokens {max_tokens}, "
    situation += (
        f"{len(hits)} cached block(s), {decoding} decoding, {free} free block(s)) your fits said {got}"
    )
    mistakes = [  # (what to do instead, the answer the mistaken rule gives here)
        (
            "cached prefix blocks that a request holds are shared, not taken (they cost no free block)",
            blocks.blocks_for(min(max_tokens, req.prefill_len)) + decoding <= free,
        ),
        (
            "an evictable cached block (held by nobody) leaves the free pool",
            taken - evictable + decoding <= free,
        ),
        (
            "count only the first chunk after the cached prefix, not the whole prompt",
            blocks.blocks_for(req.prefill_len) - len(hits) + evictable + decoding <= free,
        ),
        ("keep one free block of headroom for every DECODING request", taken <= free),
        (
            "count a prefill still under way as needing no headroom (only DECODING requests)",
            taken + decoding + len(sched.in_state(State.PREFILLING)) <= free,
        ),
    ]
    if again:
        mistakes.append(
            (
                "a preempted request prefills its prompt and the tokens it generated (req.prefill_len), not its "
                "prompt alone",
                _prompt_only_fits(sched, req, max_tokens, decoding),
            )
        )
    causes = [fix for fix, answer in mistakes if answer == got]
    return (
        f"{situation}; a likely cause (it gives your answer here): {'; or: '.join(causes)}"
        if causes
        else situation
    )


def _whole_run(scheduler_cls, policy_cls, name) -> str | None:
    """Scenario ``name`` run by the learner's classes: the first fits or victim unlike the reference's."""
    _, reqs, (options, priorities, must_preempt) = SCENARIOS[name]
    notes: dict[str, str] = {}

    class Probe(scheduler_cls):
        def fits(self, req, max_tokens):
            got = super().fits(req, max_tokens)
            if bool(got) != ContinuousScheduler.fits(self, req, max_tokens) and "fits" not in notes:
                notes["fits"] = f"fits: {_why_fits_differs(self, req, max_tokens, bool(got))}"
            return got

        def preempt(self, req):
            want = self.policy.victim(list(self.running))
            if req is not want and "grow" not in notes:
                notes["grow"] = (
                    f"grow: preempted {req.id}, but the policy's victim among the running was {want.id}: "
                    f"while the pool is short, give way with self.preempt(self.policy.victim(self.running))"
                )
            return super().preempt(req)

    Probe.__name__ = Probe.__qualname__ = scheduler_cls.__name__  # what its messages name

    class PolicyProbe(policy_cls):
        def victim(self, running):
            got, want = super().victim(running), PriorityPolicy.victim(self, running)
            if got is not want and "victim" not in notes:
                among = f"victim: among {[(r.id, r.priority) for r in running]} (id, priority)"
                notes["victim"] = f"{among}, yours was {getattr(got, 'id', got)!r}, not {want.id!r}"
            if got not in running:
                raise RuntimeError(f"victim returned {show(got)}, not one of the running requests")
            return got

    PolicyProbe.__name__ = PolicyProbe.__qualname__ = policy_cls.__name__
    hints = {"stuck": "does your fits ever say True?"}
    options = dict(options, kv_block_size=4, policy=PolicyProbe(), priorities=priorities, hints=hints)
    run = run_piece(Probe, Workload(name, name, reqs), **options)
    if run.problem or notes:
        return run.problem or notes.get("fits") or notes.get("victim") or notes["grow"]
    right = {r.id: reference_output(r.prompt_ids, r.max_new_tokens, VOCAB, frozenset()) for r in reqs}
    wrong = [rid for rid in right if run.trace.requests[rid].output_ids != right[rid]]
    over = [s.index for s in run.trace.steps if s.num_tokens > options["token_budget"]]
    untested = "this scenario must preempt, but no preemption happened: the run did not test the victim"
    found = [
        wrong and f"the outputs of {wrong} differ from the fake model's",
        run.blocks_held and f"{run.blocks_held} KV block(s) still held after every request ended",
        over and f"steps {over[:5]} ran more tokens than the budget",
        must_preempt and not run.preemptions and untested,
    ]
    return next(filter(None, found), None)


PREEMPT = (
    "give back every block; unless finished, wait QUEUED at the queue's front to prefill prompt + tokens"
)
_SITUATIONS = {  # name: (in words, [(prompt length, tokens generated, cancelled)] admitted in order, who gives way)
    "decoding": ("a request decoding its 4th token gives way, 2 others queued", [(9, 3, False)], [0]),
    "prefilling": ("a request halfway through its prompt (no token yet) gives way", [(20, 0, False)], [0]),
    "cancelled": (
        "a request cancelled meanwhile (finished, blocks still held) gives way",
        [(9, 2, True)],
        [0],
    ),
    "two": ("of two running, the newer gives way, then the older", [(7, 2, False), (10, 1, False)], [1, 0]),
}


def _after_preempt(cls, name):
    """What a client of the scheduler can see after ``cls.preempt`` in situation ``name``."""
    _, admitted, order = _SITUATIONS[name]
    sched = cls(BlockManager(24, 4), lambda: 1.0, max_batch_size=4, token_budget=24, policy=PriorityPolicy())
    reqs = [
        Request(f"r{i}", _prompt(i, n), 10, SamplingParams(), frozenset(), 0.1 * i)
        for i, (n, *_) in enumerate(admitted)
    ] + [Request(f"q{i}", _prompt(9 + i, 5), 10, SamplingParams(), frozenset(), 1.0) for i in range(2)]
    for req in reqs:
        sched.add(req)
    for req, (n, made, cancelled) in zip(reqs, admitted):
        OnDemandKV.start(sched, req, n if made else n // 2)
        req.num_computed = n if made else n // 2
        for token in range(made):
            req.add_token(30 + token, 1.0)
            sched.blocks.ensure(req.id, n + token + 1)
            req.num_computed = n + token
        if made:
            sched.take_slot(req)
            req.set_state(State.DECODING, 1.0)
        if cancelled:
            req.finish("cancelled", 1.0)
    for i in order:
        sched.preempt(reqs[i])
    gave = [reqs[i] for i in order]
    return {
        "queue": [r.id for r in sched.queue],
        "running": [r.id for r in sched.running],
        "free": sched.blocks.num_free,
        "slots": [r is not None and r.id for r in sched.slots],
        "states": [r.state.value for r in gave],
        "tokens": [list(r.output_ids) for r in gave],
        "prefill": [None if r.finished else r.prefill_left for r in gave],
        "prompt": [r.prompt_len for r in gave],
    }


def _why_preempt_differs(got, want) -> str:
    kept = got["tokens"] != want["tokens"] and "it keeps the tokens it generated: they are its answer so far"
    still = set(got["running"]) - set(want["running"]) or {s for s in got["slots"] if s} - set(
        want["running"]
    )
    redo = [p for p, w in zip(got["prefill"], want["prefill"]) if p != w]
    why = [
        still and f"{sorted(still)} still running or in a slot: self.release(req) frees its slot and blocks",
        got["free"] < want["free"] and f"{want['free'] - got['free']} block(s) still held: release them all",
        kept,
        got["states"] != want["states"]
        and f"states {got['states']}, want {want['states']}: a request "
        "that comes back waits QUEUED; one that finished meanwhile stays finished",
        set(got["queue"]) != set(want["queue"])
        and f"queue {got['queue']}, want {want['queue']}: a "
        "preempted request waits in the queue, unless it finished (cancelled) meanwhile",
        got["queue"] != want["queue"]
        and f"queue {got['queue']}, want {want['queue']}: it goes to the "
        "FRONT (it was admitted before everything waiting), so the last preempted is first",
        redo
        and f"its next prefill would take {redo[0]} token(s), want {want['prefill'][got['prefill'].index(redo[0])]}: "
        "its KV cache is gone (num_computed 0), and prefill_len is its prompt plus the tokens it generated",
    ]
    return next(filter(None, why), "")


def _preempt_cases() -> list[Case]:
    def case(name):
        words = _SITUATIONS[name][0]

        def judge(pieces):
            got, want = _after_preempt(pieces()[0], name), _after_preempt(StallFreeScheduler, name)
            return None if got == want else _why_preempt_differs(got, want) or f"{got}, want {want}"

        return piece_case(f"preempt: {words}", judge, PREEMPT)

    return [case(name) for name in _SITUATIONS]


def memory_scheduler(scheduler_cls, policy_cls) -> Verdict:
    """Check ``MyMemoryScheduler.fits(req, max_tokens)``, ``grow(batch)``, ``preempt(req)`` and
    ``MyVictimPolicy.victim(running)``."""
    missing = next((p for p in (scheduler_cls, policy_cls) if getattr(p, "missing_reason", None)), None)

    def victim_case(label, *running):
        running = [SimpleNamespace(id=rid, priority=p, arrival_s=t) for rid, p, t in running]

        def call(pieces):
            got = pieces()[1]().victim(list(running))
            return getattr(got, "id", got)

        def compare(got, expected):
            if got == expected:
                return None
            if not (isinstance(got, str) and got in {r.id for r in running}):
                return "return one of the running requests (the object itself)"
            picked, want = (next(r for r in running if r.id == i) for i in (got, expected))
            if picked.priority < want.priority:
                return f"{got} has priority {picked.priority}: lower numbers are MORE important"
            if picked.arrival_s < want.arrival_s:  # the same priority: the answer is the least important
                return f"{got} and {expected} have the same priority; the NEWER one (later arrival) gives way"
            return "on a full tie, the one admitted last (the end of the list) gives way"

        return Case(label, call, PriorityPolicy().victim(running).id, compare, VICTIM)

    rows = [  # (label, running requests as (id, priority, arrival_s))
        ("victim: all priority 0, arrivals 1, 2, 3", ("a", 0, 1.0), ("b", 0, 2.0), ("c", 0, 3.0)),
        ("victim: an old priority 5 among newer 0s", ("old", 5, 1.0), ("b", 0, 2.0), ("c", 0, 3.0)),
        ("victim: two of priority 2, one of 1", ("x", 2, 1.0), ("y", 1, 9.0), ("z", 2, 4.0)),
        ("victim: equal priority and arrival", ("p", 1, 2.0), ("q", 1, 2.0), ("r", 0, 2.0)),
    ]
    lineage = piece_case(
        "the victim policy derives from Policy (not from our PriorityPolicy)",
        lambda pieces: ancestry_problem(Policy, (PriorityPolicy,), pieces()[1]),
    )
    on_demand = piece_case(
        "the scheduler mixes OnDemandKV into your own planner (none of our kinds)",
        lambda pieces: (
            ancestry_problem(Scheduler, KINDS_OF_OURS, pieces()[0])
            or ancestry_problem(OnDemandKV, (), pieces()[0])
        ),
    )
    cases = (
        [lineage, on_demand]
        + [victim_case(*row) for row in rows]
        + _preempt_cases()
        + [
            piece_case(f"a whole run: {words}", lambda pieces, name=name: _whole_run(*pieces(), name))
            for name, (words, *_) in SCENARIOS.items()
        ]
    )
    pieces = (lambda: (scheduler_cls, policy_cls)) if missing is None else missing
    return run_cases("memory_scheduler", pieces, cases)
