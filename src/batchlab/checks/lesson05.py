"""Checkers for lesson 5 (token budget and hybrid batches).

``plan_step``       the token-budget planner (Sarathi-Serve's stall-free rule);
``pack_chunks``     how a hybrid batch is packed into one ``[1, T]`` sequence;
``skipped_decodes`` the invariant "no decoding request skips a step", read from a trace.

Every case runs on plain Python data or on the fake model, so each checker is instant.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from ..batch import Batch, Chunk
from ..engine import Engine, make_engine
from ..fake import FakeModel, FakeRunner, TickClock
from ..kv import BlockManager
from ..request import Request, State
from ..sampling import SamplingParams
from ..scheduler import StallFreeScheduler
from ..trace import StepRecord, Trace
from ._core import Case, Verdict, as_pairs, is_whole_number, run_cases, show

__all__ = ["plan_step", "pack_chunks", "skipped_decodes"]


# ---------------------------------------------------------------------------------------
# Exercise 1: the token-budget planner.

def _plan_reference(decoding, prefilling, queue, budget, free_slots):
    """The stall-free rule on plain data: the library's ``StallFreeScheduler.plan`` run on
    requests made to match."""
    slots = len(decoding) + len(prefilling) + free_slots
    scheduler = StallFreeScheduler(BlockManager(4096, 16), TickClock(), slots, max(budget, slots))
    scheduler.token_budget = budget  # a case may give fewer tokens than there are slots

    def request(rid, prompt_len):
        return Request(rid, [1] * prompt_len, 1, SamplingParams(), frozenset(), 0.0)

    for rid in decoding:  # a one-token prompt, already prefilled
        req = request(rid, 1)
        scheduler.start(req, 1)
        req.num_computed = 1
        scheduler.take_slot(req)
        req.set_state(State.DECODING, 0.0)
    for rid, left in prefilling:  # a prompt of `left` tokens, none computed yet
        req = request(rid, left)
        scheduler.start(req, 0)
        scheduler.take_slot(req)
        scheduler.prefilling.append(req)
    for rid, prompt_len in queue:
        scheduler.add(request(rid, prompt_len))
    batch = scheduler.plan()
    return [r.id for r in batch.decode], [(r.id, n) for r, n in batch.prefill]


def _normalise_plan(got: Any):
    """(decode ids, [(id, n), ...]) from what the learner returned, or a sentence saying why not."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return None, ("return two things, (decode, chunks): the list of decoding ids and the "
                      "list of (request id, number of tokens) prefill chunks")
    decode, chunks = got
    if not isinstance(decode, (list, tuple)) or not isinstance(chunks, (list, tuple)):
        return None, "both parts of (decode, chunks) should be lists"
    pairs, problem = as_pairs(chunks, "(request id, number of tokens)", _chunk_problem)
    if problem:
        return None, problem
    return (list(decode), pairs), None


def _chunk_problem(rid: Any, n: Any) -> str | None:
    return None if is_whole_number(n) else "the number of tokens should be an int"


def _plan_case(label, decoding, prefilling, queue, budget, free_slots, hint=""):
    expected = _plan_reference(decoding, prefilling, queue, budget, free_slots)

    def compare(got, expected):
        plan, problem = _normalise_plan(got)
        if problem:
            return problem
        decode, chunks = plan
        if (decode, chunks) == expected:
            return None
        if sorted(map(str, decode)) != sorted(map(str, expected[0])):
            return ("every running decode goes first, one token each: the decode list is "
                    "exactly the decoding requests")
        if any(n <= 0 for _, n in chunks):
            return "a chunk of 0 tokens (or fewer) is no chunk: leave it out"
        used = len(decode) + sum(n for _, n in chunks)
        if used > budget:
            return f"that plan runs {used} tokens, over the budget of {budget}"
        left = dict(prefilling)
        for rid, n in chunks:
            if rid in left and n > left[rid]:
                return f"{rid} has only {left[rid]} prompt tokens left, but its chunk has {n}"
        admitted = [rid for rid, _ in chunks if rid not in left]
        if len(admitted) > free_slots:
            return (f"it admits {len(admitted)} new request(s) but only {free_slots} slot(s) "
                    f"are free: an admitted request takes a slot")
        if used < _expected_used(expected) and used < budget:
            return (f"it leaves {budget - used} tokens of the budget unused although work was "
                    f"waiting: fill the budget")
        if [r for r, _ in chunks] != [r for r, _ in expected[1]]:
            return ("the chunks are not in the right order: first the partial prefills (in "
                    "admission order), then new admissions in queue order")
        return ""

    return Case(label, lambda f: f(list(decoding), list(prefilling), list(queue), budget, free_slots),
                expected, compare, hint)


def _expected_used(plan) -> int:
    return len(plan[0]) + sum(n for _, n in plan[1])


class _Recording(StallFreeScheduler):
    """The library's stall-free scheduler, noting the state it saw and the batch it chose.
    No constructor of its own: ``make_engine`` reads a scheduler's options from it."""

    seen: list[tuple[tuple, tuple]] | None = None

    def batches(self):
        if self.seen is None:
            self.seen = []
        state = ([r.id for r in self.slots if r is not None and r.state is State.DECODING],
                 [(r.id, r.prefill_left) for r in self.prefilling],
                 [(r.id, r.prompt_len) for r in self.queue],
                 self.token_budget, self.slots.count(None))
        for batch in super().batches():
            self.seen.append((state, ([r.id for r in batch.decode],
                                      [(r.id, n) for r, n in batch.prefill])))
            yield batch


def _engine_with(scheduler_cls, batch: int, budget: int, vocab: int = 64) -> Engine:
    return make_engine(scheduler_cls, FakeModel(vocab_size=vocab), runner=FakeRunner,
                       max_batch_size=batch, token_budget=budget, num_kv_blocks=4096,
                       clock=TickClock())


def _small_workload(seed: int, n: int = 10, vocab: int = 64):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(1, vocab) for _ in range(rng.randint(3, 40))], rng.randint(1, 9))
            for i in range(n)]


def _run_engine(engine: Engine, requests) -> dict[str, list[int]]:
    for rid, prompt, out in requests:
        engine.submit(prompt, max_new_tokens=out, ignore_eos=True, request_id=rid)
    engine.run_until_idle()
    return {rid: list(engine.trace.requests[rid].output_ids) for rid, _, _ in requests}


def _drive_case() -> Case:
    """The learner's plan, asked at every step of a real (fake-model) stall-free run."""
    batch, budget = 4, 24
    requests = _small_workload(5)
    engine = _engine_with(_Recording, batch, budget)
    _run_engine(engine, requests)
    seen = engine.scheduler.seen

    def call(f):
        for number, (state, chosen) in enumerate(seen):
            decoding, prefilling, queue, b, free = state
            plan, problem = _normalise_plan(f(list(decoding), list(prefilling), list(queue), b, free))
            if problem:
                return ("bad", number, state, problem)
            if plan != (chosen[0], chosen[1]):
                return ("differs", number, state, plan)
        return ("ok", len(seen))

    def compare(got, expected):
        if got[0] == "ok":
            return None
        _, number, state, what = got
        decoding, prefilling, queue, b, free = state
        where = (f"at step {number}: decoding={decoding}, prefilling={prefilling}, "
                 f"queue={queue[:4]}{' ...' if len(queue) > 4 else ''}, budget={b}, free_slots={free}")
        if got[0] == "bad":
            return f"{where}: {what}"
        chosen = seen[number][1]
        return f"{where}: the scheduler planned {chosen}, yours {what}"

    def show(got):
        return "the same plan at every step" if got[0] == "ok" else "a different plan (see below)"

    return Case(f"a whole run of the stall-free engine on the fake model (10 requests, B={batch}, "
                f"budget {budget}, {len(seen)} steps): at every step, your plan equals the "
                f"scheduler's", call, ("ok", len(seen)), compare, show=show)


def plan_step(fn: Callable) -> Verdict:
    """Check ``fn(decoding, prefilling, queue, budget, free_slots) -> (decode, chunks)``.

    ``decoding``: ids of the requests decoding (slot order); ``prefilling``: ``(id,
    prompt tokens left)`` of requests part-way through their prefill, in admission order;
    ``queue``: ``(id, prompt length)`` of waiting requests in arrival order; ``budget``:
    tokens this step may run (never less than the number decoding); ``free_slots``:
    empty decode slots. Returns the ids that decode (one token each) and the prefill
    chunks ``(id, tokens)``: partial prefills first, then admissions from the queue."""
    cases = [
        _plan_case("only decodes: 3 requests decoding, nothing else waiting, budget 16",
                   ["a", "b", "c"], [], [], 16, 1),
        _plan_case("2 decoding and one partial prefill with 40 tokens left, budget 16: the "
                   "decodes go first, the prefill takes the 14 tokens left",
                   ["a", "b"], [("p", 40)], [], 16, 0,
                   "budget left for prefill = budget - number of decodes"),
        _plan_case("a partial prefill with 5 tokens left, then a queued request (30 tokens) "
                   "is admitted with what remains: 16 - 2 - 5 = 9 tokens",
                   ["a", "b"], [("p", 5)], [("q1", 30)], 16, 1,
                   "after the partial prefills, admit from the queue while budget and free slots remain"),
        _plan_case("budget left but no free slot: the queue waits",
                   ["a", "b"], [], [("q1", 30)], 16, 0,
                   "an admitted request needs a slot; with free_slots == 0 nobody is admitted"),
        _plan_case("no decodes, 2 free slots, queue of 3, 4 and 50 tokens, budget 16: the "
                   "first two are admitted whole, then the slots are full",
                   [], [], [("q1", 3), ("q2", 4), ("q3", 50)], 16, 2,
                   "each admission uses one free slot"),
        _plan_case("the decodes use the whole budget (8 decoding, budget 8): no prefill this step",
                   [f"d{i}" for i in range(8)], [("p", 20)], [("q1", 10)], 8, 3),
        _plan_case("two partial prefills in admission order, budget 16: the first gets all "
                   "the 10 it needs, the second the 6 that remain",
                   [], [("p1", 10), ("p2", 10)], [], 16, 0,
                   "serve partial prefills in order, each min(what it needs, what is left)"),
        _plan_case("the budget runs out inside an admission: 1 decode, queued request of 100 "
                   "tokens, budget 16, so its first chunk is 15 tokens",
                   ["a"], [], [("q1", 100)], 16, 1,
                   "the last chunk may be short: min(prompt length, budget left)"),
        _plan_case("the queue keeps its order: a long request first, a short one behind it, "
                   "budget 20: only the long one starts",
                   [], [], [("q1", 100), ("q2", 2)], 20, 2,
                   "admission is first come, first served; stop when the budget is spent"),
        _drive_case(),
    ]
    return run_cases("plan_step", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 2: packing a hybrid batch into one sequence.

def _pack_reference(chunks):
    tokens = [t for c in chunks for t in c.tokens]
    positions = [p for c in chunks for p in range(c.start, c.start + len(c.tokens))]
    ends, total = [], 0
    for c in chunks:
        total += len(c.tokens)
        ends.append(total - 1)
    return tokens, positions, ends


def pack_chunks(fn: Callable) -> Verdict:
    """Check ``fn(chunks) -> (tokens, positions, last)`` for a list of ``Chunk``s, in the
    order given: all their tokens in one flat list, each token's position in its own
    sequence, and the index (in the flat list) of each chunk's last token."""

    def compare(got, expected):
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return "return three lists: (tokens, positions, last)"
        got = tuple([int(x) for x in part] for part in got)
        if got == expected:
            return None
        tokens, positions, last = got
        if tokens != expected[0]:
            return "the tokens are wrong: every chunk's tokens, one chunk after the other, in the order given"
        if len(positions) != len(tokens):
            return f"{len(positions)} positions for {len(tokens)} tokens: one position per token"
        if positions != expected[1]:
            if positions == list(range(len(tokens))):
                return ("those are positions in the packed row; each token needs its position "
                        "in its OWN sequence, starting at its chunk's start")
            return "the positions are wrong: chunk c's tokens sit at c.start, c.start + 1, ..."
        if len(last) != len(expected[2]):
            return f"{len(last)} last indices for {len(expected[2])} chunks: one per chunk"
        if last == [e + 1 for e in expected[2]]:
            return "off by one: the index of a chunk's last token is (tokens so far) - 1"
        return "the last indices are wrong: where each chunk's last token sits in the flat list"

    def case(label, chunks, hint=""):
        return Case(label, lambda f: f(list(chunks)), _pack_reference(chunks), compare, hint)

    one_step = [Chunk(f"d{i}", [100 + i], s) for i, s in enumerate([52, 7, 130, 88, 41, 64, 19, 23])]
    one_step.append(Chunk("p", list(range(500, 564)), 128))
    return run_cases("pack_chunks", fn, [
        case("one decode row: token 42 at position 9", [Chunk("a", [42], 9)]),
        case("one prefill chunk starting a prompt: tokens 5, 6, 7 at positions 0, 1, 2",
             [Chunk("p", [5, 6, 7], 0)]),
        case("a prefill chunk that continues a prompt: 4 tokens from position 16",
             [Chunk("p", [11, 12, 13, 14], 16)],
             "a chunk that continues a prompt starts at c.start, not 0"),
        case("a hybrid batch: 3 decode rows (positions 40, 7, 100), then a 5-token chunk from 16",
             [Chunk("a", [1], 40), Chunk("b", [2], 7), Chunk("c", [3], 100),
              Chunk("p", [20, 21, 22, 23, 24], 16)],
             "a decode row is a chunk of one token; its last token is itself"),
        case("two prefill chunks of different requests back to back",
             [Chunk("p", [9, 8, 7], 0), Chunk("q", [6, 5], 30)]),
        case("a step like the mixed workload's: 8 decode rows + a 64-token chunk (T = 72)", one_step),
    ])


# ---------------------------------------------------------------------------------------
# Exercise 3: no decode is skipped.

def _skipped_reference(trace: Trace) -> list[tuple[int, str]]:
    steps = list(trace.steps)
    emitted_at: dict[str, list[int]] = {}
    for k, s in enumerate(steps):
        for rid in s.emitted:
            emitted_at.setdefault(rid, []).append(k)
    out = []
    for rid, ks in emitted_at.items():
        for k in range(ks[0] + 1, ks[-1] + 1):
            if rid not in steps[k].decoded:
                out.append((steps[k].index, rid))
    return sorted(out)


class _PrefillFirst(StallFreeScheduler):
    """A wrong policy for the checker: prefill takes the budget first, decodes get what is left."""

    def plan(self) -> Batch:
        prefill = self.continue_prefills(self.token_budget)
        prefill += self.admit(self.token_budget - sum(n for _, n in prefill))
        budget = self.token_budget - sum(n for _, n in prefill)
        return Batch(decode=self.decodes()[:max(budget, 0)], prefill=prefill)


def _fake_trace(scheduler_cls, batch: int, budget: int, seed: int) -> Trace:
    engine = _engine_with(scheduler_cls, batch, budget)
    _run_engine(engine, _small_workload(seed, n=8))
    return engine.trace


def _hand_trace() -> Trace:
    """Five steps, two requests; b gets no decode row in step 2."""
    def step(i, decoded, emitted):
        return StepRecord(i, float(i), float(i) + 1, decoded=decoded, emitted=emitted)
    steps = [step(0, [], {"a": [5]}),
             step(1, ["a"], {"a": [6], "b": [9]}),
             step(2, ["a"], {"a": [7]}),
             step(3, ["a", "b"], {"a": [8], "b": [3]}),
             step(4, ["b"], {"b": [4]})]
    return Trace("hand-made", 2, steps, {})


def _one_token_trace() -> Trace:
    steps = [StepRecord(0, 0.0, 1.0, emitted={"a": [1], "b": [2]}),
             StepRecord(1, 1.0, 2.0, decoded=["a"], emitted={"a": [3]}),
             StepRecord(2, 2.0, 3.0, decoded=["a"], emitted={"a": [4]})]
    return Trace("hand-made", 2, steps, {})


def skipped_decodes(fn: Callable) -> Verdict:
    """Check ``fn(trace) -> [(step index, request id), ...]``: every step in which a request
    that is decoding (it got its first token in an earlier step, and its last token in
    this step or later) has no decode row."""

    def compare(got, expected):
        if not isinstance(got, (list, tuple, set)):
            return f"return a list of (step index, request id) pairs, not a {type(got).__name__}"
        try:
            pairs = [(int(k), str(r)) for k, r in got]
        except (TypeError, ValueError):
            return "each item should be a pair (step index, request id)"
        if len(set(pairs)) != len(pairs):
            return "a pair appears twice: list each skipped (step, request) once"
        if sorted(pairs) == expected:
            return None
        missing = sorted(set(expected) - set(pairs))
        extra = sorted(set(pairs) - set(expected))
        if extra:
            return (f"{extra[:3]} {'is' if len(extra) == 1 else 'are'} not skips: a request is "
                    f"decoding only after the step of its first token and up to the step of "
                    f"its last")
        return f"missed {missing[:3]}{' ...' if len(missing) > 3 else ''}"

    def show_sorted(value):
        return show(sorted(value) if isinstance(value, (list, set)) else value)

    def case(label, make, hint=""):
        trace = make()
        return Case(label, lambda f: f(trace), _skipped_reference(trace), compare, hint, show_sorted)

    wrong = _fake_trace(_PrefillFirst, 4, 12, 3)
    return run_cases("skipped_decodes", fn, [
        case("a stall-free run on the fake model (B=4, budget 12): nobody is skipped",
             lambda: _fake_trace(_Recording, 4, 12, 3)),
        case("a hand-made trace: b gets its first token in step 1, no decode row in step 2, "
             "then decodes in steps 3 and 4", _hand_trace,
             "b is decoding from step 2 (the step after its first token) to step 4"),
        case("a request that got only one token (it never decoded) is never skipped",
             _one_token_trace, "a request with a single token has no decoding steps"),
        case(f"a wrong policy that gives the budget to prefill first and decodes what is left "
             f"(B=4, budget 12): {len(_skipped_reference(wrong))} skipped decodes",
             lambda: wrong),
    ])
