"""The learner's pieces as the lessons have them write (the lineage of ``my_engine/``), in
their simplest right form: what the checkers must accept. The wrong pieces of
``test_checkers_reject*`` are these with one mistake each."""

from __future__ import annotations

import asyncio
import math

import numpy as np
from dataclasses import dataclass

from batchlab.core.engine import EngineBase
from batchlab.core.policies import AdmissionBase, Policy, QueueFull
from batchlab.core.request import State
from batchlab.core.structured import Constraint, compile_constraint
from batchlab.course.automaton import Automaton, token_texts
from batchlab.core.scheduler import Batch, OnDemandKV, Scheduler
from batchlab.serving.server import HEARTBEAT_S, ServerBase, StopMatcher, StreamEnded


class MyStaticScheduler(Scheduler):
    """Lesson 1: start a batch (reserve + begin + take_slot, up to B from the queue front),
    one prefill pass, decode passes with finished rows as padding, release at the end; and
    the finishing rules."""

    kind = "my-static"
    rectangular = True  # a finished row keeps its slot until the whole batch ends

    def batches(self):
        if not self.running:
            while self.queue and len(self.running) < self.max_batch_size and self.reserve(self.queue[0]):
                req = self.queue[0]
                self.begin(req)
                self.take_slot(req)
            if not self.running:
                return
            longest = max(r.prompt_len for r in self.running)
            yield Batch(
                prefill=[(r, r.prompt_len) for r in self.running],
                padding_tokens=sum(longest - r.prompt_len for r in self.running),
            )
        live = [r for r in self.running if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.running if r.finished])
        if all(r.finished for r in self.running):
            for r in list(self.running):
                self.release(r)

    def finish_reason(self, req, token):
        if token in req.stop_ids:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None


class MyContinuousScheduler(MyStaticScheduler):
    """Lesson 2: the step in phases: admit one request at a time (only if it fits), its
    whole prompt as a pass of its own, awaiting requests into free slots in order, one
    decode pass over every slot."""

    kind = "my-continuous"
    rectangular = False  # a finished request gives its slot back at once
    prefill_lane = True  # a prefilling request holds no slot yet

    def batches(self):
        self.admit()
        yield from self.prefill()
        self.place()
        yield from self.decode()

    def admit(self):
        if self.queue and not self.in_state(State.PREFILLING, State.AWAITING_SLOT):
            self.admit_next(math.inf)

    def admit_next(self, max_tokens):
        req = self.policy.next_queued(self.queue)
        n = min(max_tokens, self.chunk(req))
        if not self.fits(req, n):
            return None
        return req, self.start(req, n)

    def chunk(self, req):
        return req.prefill_left

    def prefill(self):
        for req in self.in_state(State.PREFILLING)[:1]:
            yield Batch(prefill=[(req, self.chunk(req))])

    def place(self):
        for req in self.in_state(State.AWAITING_SLOT):
            if self.free_slot() is None:
                break
            self.take_slot(req)
            req.set_state(State.DECODING, self.clock())

    def decode(self):
        rows = [r for r in self.slots if r is not None]
        if rows:
            yield Batch(decode=rows)


class MyChunkedScheduler(MyContinuousScheduler):
    """Lesson 4: at most ``prefill_step`` tokens of the prefilling request a step."""

    kind = "my-chunked"

    def __init__(self, blocks, clock, max_batch_size=8, prefill_step=None, policy=None):
        super().__init__(blocks, clock, max_batch_size, policy=policy)
        if prefill_step is not None and (
            isinstance(prefill_step, bool) or not isinstance(prefill_step, int) or prefill_step < 1
        ):
            raise ValueError(f"prefill_step must be an integer >= 1 or None, got {prefill_step!r}")
        self.prefill_step = prefill_step or math.inf

    def chunk(self, req):
        return min(self.prefill_step, req.prefill_left)


class MyStallFreeScheduler(MyChunkedScheduler):
    """Lesson 5a: the token-budget planner (Sarathi-Serve's Algorithm 3) on the learner's
    admission and chunk rule."""

    kind = "my-stallfree"
    prefill_lane = False

    def __init__(self, blocks, clock, max_batch_size=8, token_budget=64, policy=None):
        super().__init__(blocks, clock, max_batch_size, policy=policy)
        self.token_budget = token_budget

    def batches(self):
        batch = self.plan()
        if batch.decode or batch.prefill:
            yield batch

    def plan(self):
        decode = self.in_state(State.DECODING)
        budget = self.token_budget - len(decode)
        prefill = []
        for req in self.in_state(State.PREFILLING):
            n = min(budget, self.chunk(req))
            if n > 0:
                prefill.append((req, n))
                budget -= n
        while budget > 0 and self.queue and self.free_slot() is not None:
            started = self.admit_next(budget)
            if started is None:
                break
            req, n = started
            self.take_slot(req)
            prefill.append((req, n))
            budget -= n
        return Batch(decode=decode, prefill=prefill)


class MyMemoryScheduler(OnDemandKV, MyStallFreeScheduler):
    """Lesson 8: blocks on demand, admission by free blocks, and preemption by recompute."""

    kind = "my-memory"

    def grow(self, batch):
        rows = [(r, 1) for r in batch.decode] + list(batch.prefill)
        for req, n in sorted(rows, key=lambda row: self.policy.importance(row[0])):
            while (
                req in self.running
                and self.blocks.blocks_to_grow(req.id, req.num_computed + n) > self.blocks.num_free
            ):
                self.preempt(self.policy.victim(self.running))
            if req in self.running:
                self.blocks.ensure(req.id, req.num_computed + n)
        decode = [r for r in batch.decode if r in self.running]
        prefill = [(r, n) for r, n in batch.prefill if r in self.running]
        return Batch(decode=decode, prefill=prefill)

    def fits(self, req, max_tokens):
        hits, cached, n = self.first_chunk(req, max_tokens)
        taken = (
            self.blocks.blocks_for(cached + n) - len(hits) + sum(self.blocks.ref_counts[b] == 0 for b in hits)
        )
        headroom = sum(r.state is State.DECODING for r in self.running)
        return taken + headroom <= self.blocks.num_free

    def preempt(self, req):
        self.release(req)
        if req.finished:
            return
        req.num_computed = 0
        req.prefill_len = req.prompt_len + len(req.output_ids)
        req.set_state(State.QUEUED, self.clock())
        self.queue.appendleft(req)


def propose(tokens, k, min_n=1, max_n=4):
    """Lesson 11: the longest pattern first (n from max_n down to min_n), the last n tokens' most
    recent earlier occurrence, and the up to k tokens that followed it there."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the most recent first; never the pattern itself
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


class MySpeculativeScheduler(MyMemoryScheduler):
    """Lesson 11: the lesson-8 engine, speculating: after its growth, a decode row may carry
    drafts, paid from what is left of the token budget, in free KV blocks only; ``accept`` keeps
    the drafts the picks confirm, then the model's own token."""

    kind = "my-speculative"

    def __init__(
        self,
        blocks,
        clock,
        max_batch_size=8,
        token_budget=64,
        num_speculative_tokens=3,
        prompt_lookup_min=1,
        prompt_lookup_max=4,
        policy=None,
    ):
        super().__init__(blocks, clock, max_batch_size, token_budget, policy=policy)
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max

    def grow(self, batch):
        batch = super().grow(batch)
        budget = self.token_budget - batch.num_tokens
        drafts = {}
        for req in sorted(batch.decode, key=self.policy.importance):
            tokens_left = req.max_new_tokens - len(req.output_ids)
            k = min(self.num_speculative_tokens, budget, tokens_left - 1)
            if k <= 0:
                continue
            guess = propose(
                req.prompt_ids + req.output_ids, k, self.prompt_lookup_min, self.prompt_lookup_max
            )
            end = req.num_computed + 1  # its decode token's slot is taken already
            room = (len(self.blocks.tables[req.id]) + self.blocks.num_free) * self.blocks.block_size - end
            guess = guess[: max(room, 0)]
            if guess:
                self.blocks.ensure(req.id, end + len(guess))
                drafts[req.id] = guess
                budget -= len(guess)
        batch.drafts = drafts
        return batch

    def accept(self, req, drafts, picks):
        kept = []
        for draft, pick in zip(drafts, picks):
            if draft != pick:
                break
            kept.append(draft)
        return kept + [picks[len(kept)]]


class MyVictimPolicy(Policy):
    """Lesson 8: the least important, the newest among equals, the last admitted on a tie."""

    def victim(self, running):
        return max(reversed(running), key=lambda r: (r.priority, r.arrival_s))


class MyEngine(EngineBase):
    """Lesson 6: poll drains the new tokens and reads the status under one hold of the
    lock, and forgets a request once "done" is reported; cancel finishes a running
    request as "cancelled" and leaves freeing its slot to the next step's sweep; submit checks
    the request first, then chooses its id, refuses an id in use, checks the queue's room and
    enqueues it under one hold of the lock."""

    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        checked = self.check_request(prompt_ids, **params)
        with self._lock:
            rid = request_id if request_id is not None else self.new_id()
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            self.admission.check_room(self._queue_depth)
            self.enqueue(rid, checked, arrival_s)
        return rid

    def poll(self, req_id):
        with self._lock:
            req = self._requests.get(req_id)
            if req is None:
                return [], "unknown", None
            tokens, req.pending = req.pending, []
            if req.finished:
                del self._requests[req_id]
                if self.trace_limit is not None:
                    self.trace.requests.pop(req_id, None)
                return tokens, "done", req.finish_reason
            return tokens, "running", None

    def cancel(self, req_id):
        with self._lock:
            req = self._requests.get(req_id)
            if req is None or req.finished:
                return False
            self._finish(req, "cancelled")
            self._cancelled.append(req)
            return True


class MyServer(ServerBase):
    """Lesson 7: each request's stream: poll after every engine step, one piece of text per
    token (EOS adds none) with the count so far, a stop string ends the request as 'stop', the
    finish reason last; StreamEnded for a failed request or a closing server; a stream
    closed before its request ended cancels it."""

    async def events(self, rid, stops):
        detok, stopper = self.lm.tokenizer.detokenizer(), StopMatcher(stops)
        eos, count, ended = self.lm.tokenizer.eos_token_ids, 0, False
        try:
            while True:
                progress = self.next_progress()
                tokens, status, reason = self.loop.poll(rid)
                for token in tokens:
                    count += 1
                    text, hit = stopper.feed("" if token in eos else detok.add(token))
                    if hit:
                        self.loop.stop_string_met(rid)
                        ended = True
                        yield text, "stop", count
                        return
                    if text:
                        yield text, None, count
                if reason == "error":
                    ended = True
                    raise StreamEnded("the engine failed while running this request", 500)
                if status != "running":
                    ended = True
                    text, hit = stopper.feed(detok.flush())
                    yield (
                        text + ("" if hit else stopper.flush()),
                        "stop" if hit or reason == "cancelled" else reason,
                        count,
                    )
                    return
                if self.unavailable():
                    raise StreamEnded(self.unavailable(), 503)
                try:
                    await asyncio.wait_for(progress.wait(), HEARTBEAT_S)
                except asyncio.TimeoutError:  # Python 3.10: not the builtin TimeoutError
                    pass
        finally:
            if not ended:
                self.loop.cancel(rid)


@dataclass(frozen=True)
class MyAdmission(AdmissionBase):
    """Lesson 9: refuse at the door when max_queue wait; shed the queued requests that never
    started and waited over max_wait_s."""

    def check_room(self, queue_depth):
        if self.max_queue is not None and queue_depth() >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} waiting)")

    def to_shed(self, queue, now):
        if self.max_wait_s is None:
            return []
        return [
            r
            for r in queue
            if r.state is State.QUEUED and not r.output_ids and now - r.arrival_s > self.max_wait_s
        ]


class MyAgingPolicy(MyVictimPolicy):
    """Lesson 10: priorities with aging: a waiting request gains one level every age_s seconds,
    which orders the queue by arrival_s + age_s * priority (the clock cancels out)."""

    def __init__(self, age_s=30.0):
        if isinstance(age_s, bool) or not isinstance(age_s, (int, float)) or not 0 < age_s < math.inf:
            raise ValueError(f"age_s must be a number of seconds > 0, got {age_s!r}")
        self.age_s = age_s

    def importance(self, req):
        return req.arrival_s + self.age_s * req.priority, req.priority

    def next_queued(self, queue):
        return min(queue, key=self.importance)


# -- lesson 12: structured output -------------------------------------------------------------


def token_mask(automaton, state, texts):
    """A numpy bool array, one entry per token text: True where reading the text's characters one by
    one from `state` (automaton.step) never reaches None. An empty text is never allowed."""
    mask = np.zeros(len(texts), dtype=bool)
    for i, text in enumerate(texts):
        s = state
        for ch in text:
            s = automaton.step(s, ch)
            if s is None:
                break
        mask[i] = bool(text) and s is not None
    return mask


class MyConstraint(Constraint):
    """One request's pattern while it generates: the automaton, the state its text has reached, and
    `masks`, a dict state -> mask that every request with this pattern shares."""

    def __init__(self, automaton, texts, eos_ids, masks):
        self.automaton, self.texts, self.eos_ids, self.masks = automaton, texts, eos_ids, masks
        self.state = automaton.start

    def allowed(self):
        # the mask of the current state, computed once per state (then taken from self.masks);
        # EOS ids are allowed exactly where the text so far is a whole match
        if self.state not in self.masks:
            mask = token_mask(self.automaton, self.state, self.texts)
            mask[list(self.eos_ids)] = self.automaton.accepting(self.state)
            self.masks[self.state] = mask
        return self.masks[self.state]

    def advance(self, token):
        # the state after the token's text (an EOS id ends the answer: nothing to read)
        if token not in self.eos_ids:
            for ch in self.texts[token]:
                self.state = self.automaton.step(self.state, ch)


class MyStructuredEngine(MyEngine):
    """My lesson-6 engine, constraining answers: my own masks for a regex or a choice, the library's
    grammar for a JSON schema."""

    masks_during_pass = False  # where the masks are filled: section 5 measures both ways

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.masks = {}  # pattern -> {state: mask}, shared by all its requests

    def compile(self, spec):
        if spec.regex is None and spec.choice is None:  # a JSON schema: the library's grammar
            return compile_constraint(spec, self.lm.tokenizer)
        automaton = Automaton(spec.regex) if spec.regex is not None else Automaton.from_choices(spec.choice)
        tok = self.lm.tokenizer
        return MyConstraint(
            automaton, token_texts(tok), tok.eos_token_ids, self.masks.setdefault(automaton.pattern, {})
        )

    def constrain(self, batch, chunks):
        # every chunk that samples this pass (chunk.sampler is not None) and whose request has a
        # constraint (req.constraint) gets that constraint's mask as chunk.sampler.allowed
        constrained = {r.id: r.constraint for r in batch.requests if r.constraint is not None}
        for chunk in chunks:
            if chunk.sampler is not None and chunk.req_id in constrained:
                chunk.sampler.allowed = constrained[chunk.req_id].allowed()
