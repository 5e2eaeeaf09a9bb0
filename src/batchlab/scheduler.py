"""Schedulers: the policy half of the engine, in pure Python (no MLX, not even through
an import).

A scheduler owns the waiting queue, the decode slots and the KV blocks (it is the only
code that takes or frees them), and decides what the model runs. Its ``batches()`` is a
generator: it yields one ``Batch`` (one forward pass) at a time; the engine asks it to
``prepare`` the pass (take its blocks, describe it as runner ``Chunk``s), runs it, and
hands the new tokens to ``postprocess``; then the generator resumes and sees the result.
The four kinds differ only in ``batches``:

- ``SequentialScheduler``: one request at a time, start to finish.
- ``StaticScheduler``: up to B requests start together; nobody joins until all finish.
- ``ContinuousScheduler``: iteration-level scheduling in five phases (see ``batches``).
- ``StallFreeScheduler``: a token budget per step, decodes first, one fused pass.

*Write your own*: subclass one of them, give it a ``kind`` name, and pass the class to
``make_engine(MyScheduler, lm, ...)``. A scheduler's options are the keyword arguments of
its constructor after ``(blocks, clock)``, with their defaults; the constructor checks them.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from typing import Callable, Iterator

from .batch import Batch
from .runner import Chunk
from .kv import BlockManager
from .policies import PriorityPolicy
from .request import Request, State


class Scheduler:
    """What every policy shares: a queue, B decode slots, the KV blocks.

    Static and sequential batching reserve a request's whole KV memory up front
    (``reserve``). Continuous and stall-free take blocks on demand (``fits``, ``start``,
    ``make_room``) and preempt when the pool runs dry; ``running`` lists who holds blocks.
    """

    kind = "base"
    kv_on_demand = False  # blocks taken as requests grow (so prefix caching can share them)
    prefill_lane = False  # prefilling requests hold no decode slot (pictures draw a lane)

    def __init__(self, blocks: BlockManager, clock: Callable[[], float], max_batch_size: int = 8,
                 policy: PriorityPolicy | None = None):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        self.blocks, self.clock = blocks, clock
        self.policy = policy or PriorityPolicy()
        self.queue: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_batch_size
        self.running: list[Request] = []  # on demand: requests holding KV blocks, by admission
        self.preempted: list[str] = []  # preempted during the current step
        self.num_preemptions = 0

    @classmethod
    def option_defaults(cls) -> dict:
        """The options this kind takes, with their defaults: its constructor's keyword
        arguments after ``(blocks, clock)``."""
        params = list(inspect.signature(cls.__init__).parameters.values())[3:]
        return {p.name: p.default for p in params
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    # -- bookkeeping shared by all policies --------------------------------------------
    def add(self, req: Request) -> None:
        self.queue.append(req)

    def has_work(self) -> bool:
        return bool(self.queue) or any(self.slots)

    def free_slot(self) -> int | None:
        return next((i for i, r in enumerate(self.slots) if r is None), None)

    def take_slot(self, req: Request) -> None:
        req.slot = self.free_slot()
        self.slots[req.slot] = req

    def reserve(self, req: Request) -> bool:
        """Reserve KV blocks for the whole request (prompt + every token it may generate);
        False if the pool cannot promise them now."""
        if not self.blocks.can_reserve(req.prompt_len + req.max_new_tokens):
            return False
        self.blocks.reserve(req.id, req.prompt_len + req.max_new_tokens)
        return True

    def remove(self, req: Request) -> None:
        """Forget a finished or cancelled request and free everything it held."""
        if req in self.queue:
            self.queue.remove(req)
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        if req in self.running:
            self.running.remove(req)
        req.slot = None
        self.blocks.release(req.id)

    def check_room(self, num_tokens: int) -> None:
        """Refuse (ValueError) a request that could never fit the KV pool."""
        need = self.blocks.blocks_for(num_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"prompt + max_new_tokens = {num_tokens} tokens needs {need} KV blocks, but the "
                f"engine has {self.blocks.num_blocks} blocks of {self.blocks.block_size} tokens; "
                f"raise num_kv_blocks")

    def step(self) -> Iterator[Batch]:
        """This step's passes: what the engine iterates. Starts the step's bookkeeping,
        then runs the kind's own ``batches()``."""
        self.preempted = []
        yield from self.batches()

    # -- one pass: before and after the runner --------------------------------------------
    def prepare(self, batch: Batch) -> list[Chunk]:
        """Take the KV blocks ``batch`` writes and describe it to the runner: one chunk per
        request, in ``batch.requests`` order. (On-demand kinds took them while planning,
        with ``make_room``; for up-front kinds this is where reserved blocks are taken.)"""
        chunks = [self._chunk(r, r.next_input(), sample=True) for r in batch.decode]
        for req, n in batch.prefill:  # the prompt (+ generated tokens, recomputed after preemption)
            end = req.num_computed + n
            chunks.append(self._chunk(req, req.token_ids(req.num_computed, end),
                                      sample=end == req.prefill_len))
        # static: a finished row's last position is recomputed and the result thrown away
        chunks += [self._chunk(r, r.next_input(), sample=False) for r in batch.padding]
        return chunks

    def _chunk(self, req: Request, tokens: list[int], sample: bool) -> Chunk:
        start, end = req.num_computed, req.num_computed + len(tokens)
        table = self.blocks.ensure(req.id, end)
        self.blocks.check_writable(req.id, start, end)
        return Chunk(req.id, tokens, start, list(table), req.sampler if sample else None)

    def postprocess(self, batch: Batch, tokens: list[int | None], now: float
                    ) -> list[tuple[Request, int, str | None]]:
        """After the pass: advance every request by what it computed, name full blocks
        for the prefix cache, hand out the new tokens (one per ``batch.requests`` entry,
        None where none was sampled) and free the requests that finished. Returns
        ``(request, token, finish reason or None)`` for every token handed out."""
        for req in batch.decode:
            req.num_computed += 1
        for req, n in batch.prefill:
            req.num_computed += n
        for req in batch.requests[:len(batch.decode) + len(batch.prefill)]:
            if not req.finished:  # full blocks join the prefix cache
                self.blocks.cache_full_blocks(req.id, req.num_computed, req.token_ids)
        events = []
        for req, token in zip(batch.requests, tokens):
            if token is None or req.finished:  # nothing sampled, or cancelled during the pass
                continue
            reason = req.add_token(token, now)
            if reason is not None:
                req.finish(reason, now)
                self.remove(req)
            events.append((req, token, reason))
        return events

    def fail(self, batch: Batch, cause: BaseException, now: float) -> list[Request]:
        """The pass of ``batch`` raised ``cause``: its requests finish with reason "error"
        and give back everything they hold. Returns the requests it finished."""
        ended = []
        for req in batch.requests:
            if not req.finished:
                req.finish("error", now)
                req.error = cause
                ended.append(req)
            self.remove(req)
        return ended

    def kv_usage(self) -> dict:
        """What KV memory looks like now (for the trace and ``stats``)."""
        b = self.blocks
        return {"num_kv_blocks": b.num_blocks, "free_kv_blocks": b.num_free,
                "kv_blocks_used": b.num_blocks - b.num_free,
                "block_tables": {rid: list(t) for rid, t in b.tables.items()},
                "cached_blocks": list(b.evictable), "preemptions": self.num_preemptions,
                "prefix_cache_hits": b.hit_blocks, "prefix_cache_hit_tokens": b.hit_tokens}

    # -- on-demand KV memory (continuous, stall-free) ------------------------------------
    def _first_chunk(self, req: Request, max_tokens: float) -> tuple[list[int], int, int]:
        """(cached blocks it can share, their tokens, its first chunk's length)."""
        hits = self.blocks.lookup(req.token_ids(0, req.prefill_len))
        cached = len(hits) * self.blocks.block_size
        return hits, cached, min(max_tokens, req.prefill_len - cached)

    def fits(self, req: Request, max_tokens: float) -> bool:
        """Admission by free blocks: the pool must hold the first chunk (at most
        ``max_tokens``, after any cached prefix) and still keep one block of headroom for
        every decoding request, so that admitting does not at once force a preemption."""
        hits, cached, n = self._first_chunk(req, max_tokens)
        taken = self.blocks.blocks_for(cached + n) - len(hits) \
            + sum(self.blocks.ref_counts[b] == 0 for b in hits)  # evictable hits leave the free pool
        headroom = sum(r.state is State.DECODING for r in self.running)
        return taken + headroom <= self.blocks.num_free

    def start(self, req: Request, max_tokens: float) -> int:
        """Admit ``req`` (checked with ``fits``) into prefilling: share its cached prefix,
        take blocks for its first chunk; return that chunk's length."""
        hits, cached, n = self._first_chunk(req, max_tokens)
        if req in self.queue:
            self.queue.remove(req)
        self.blocks.share(req.id, hits)
        req.num_computed = cached
        self.blocks.ensure(req.id, cached + n)
        self.running.append(req)
        req.set_state(State.PREFILLING, self.clock())
        return n

    def make_room(self, req: Request, num_tokens: int) -> bool:
        """Take the blocks ``req`` needs for ``num_tokens`` more tokens, preempting the
        policy's victims while the pool is short. False if ``req`` itself gave way."""
        while self.blocks.blocks_to_grow(req.id, req.num_computed + num_tokens) > self.blocks.num_free:
            victim = self.policy.victim(self.running)
            self.preempt(victim)
            if victim is req:
                return False
        self.blocks.ensure(req.id, req.num_computed + num_tokens)
        return True

    def preempt(self, req: Request) -> None:
        """Preemption by recompute: free all of ``req``'s blocks and put it back at the
        front of the queue; it keeps its generated tokens."""
        self.remove(req)
        if req.finished:  # cancelled meanwhile: nothing to come back for
            return
        req.preempt(self.clock())
        self.queue.appendleft(req)
        self.preempted.append(req.id)
        self.num_preemptions += 1

    def batches(self) -> Iterator[Batch]:
        raise NotImplementedError


class SequentialScheduler(Scheduler):
    """One request at a time: prefill its whole prompt, decode it to the end, next."""

    kind = "sequential"

    def __init__(self, blocks: BlockManager, clock):
        super().__init__(blocks, clock, 1)

    def batches(self):
        current = self.slots[0]
        if current is None:
            if not self.queue or not self.reserve(self.queue[0]):
                return
            current = self.queue.popleft()
            self.take_slot(current)
            current.set_state(State.PREFILLING, self.clock())
            yield Batch(prefill=[(current, current.prompt_len)])
            if not current.finished:
                current.set_state(State.DECODING, self.clock())
            return
        yield Batch(decode=[current])


class StaticScheduler(Scheduler):
    """Static batching: take up to B queued requests, prefill them together, decode until
    the longest is done. Finished rows stay in the batch as padding (computed, thrown
    away, their KV memory held) because a rectangular batch cannot shrink."""

    kind = "static"

    def __init__(self, blocks: BlockManager, clock, max_batch_size: int = 8):
        super().__init__(blocks, clock, max_batch_size)
        self.batch: list[Request] = []

    def has_work(self) -> bool:
        return bool(self.queue) or bool(self.batch)

    def remove(self, req: Request) -> None:
        if req not in self.batch:  # still queued: forget it now
            super().remove(req)
        # in the batch: it stays as a padding row until the whole batch ends

    def batches(self):
        if not self.batch:
            while self.queue and len(self.batch) < self.max_batch_size and self.reserve(self.queue[0]):
                req = self.queue.popleft()
                self.take_slot(req)
                req.set_state(State.PREFILLING, self.clock())
                self.batch.append(req)
            if not self.batch:
                return
            longest = max(r.prompt_len for r in self.batch)
            yield Batch(prefill=[(r, r.prompt_len) for r in self.batch],
                        padding_tokens=sum(longest - r.prompt_len for r in self.batch))
            for r in self.batch:
                if not r.finished:
                    r.set_state(State.DECODING, self.clock())
        live = [r for r in self.batch if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.batch if r.finished])
        if all(r.finished for r in self.batch):  # the batch is over: free its rows
            for r in self.batch:
                super().remove(r)
            self.batch = []


class ContinuousScheduler(Scheduler):
    """Continuous (iteration-level) batching. Each step:

    1. (engine) sweep cancelled requests out;
    2. ``admit``: the next queued request starts prefilling;
    3. ``prefill_chunk``: its prefill advances by ``prefill_step`` tokens (a separate pass);
    4. ``place``: fully prefilled requests move into free decode slots, or keep waiting;
    5. ``decode_rows``: one batched decode pass over every occupied slot.

    ``prefill_step=None`` prefills a whole prompt at once: the naive variant whose long
    prompts stall everybody's decoding (lesson 3). KV blocks are taken on demand; when a
    chunk or a decode row finds none free, the policy's victim is preempted (lesson 8).
    """

    kind = "continuous"
    kv_on_demand = True
    prefill_lane = True

    def __init__(self, blocks: BlockManager, clock, max_batch_size: int = 8,
                 prefill_step: int | None = None, policy: PriorityPolicy | None = None):
        super().__init__(blocks, clock, max_batch_size, policy)
        if prefill_step is not None and (isinstance(prefill_step, bool) or not isinstance(prefill_step, int)
                                         or prefill_step < 1):
            raise ValueError(f"prefill_step must be an integer >= 1, got {prefill_step!r}")
        self.prefill_step = prefill_step or math.inf
        self.prefilling: Request | None = None
        self.awaiting: deque[Request] = deque()

    def has_work(self) -> bool:
        return super().has_work() or self.prefilling is not None or bool(self.awaiting)

    def remove(self, req: Request) -> None:
        if self.prefilling is req:
            self.prefilling = None
        if req in self.awaiting:
            self.awaiting.remove(req)
        super().remove(req)

    def batches(self):
        self.admit()
        yield from self.prefill_chunk()
        self.place()
        yield from self.decode_rows()

    def admit(self) -> None:
        """2. Admit one request at a time, and none while a prefilled one still waits for a
        slot; only if the free blocks hold its first chunk."""
        if self.prefilling is None and not self.awaiting and self.queue:
            req = self.policy.next_queued(self.queue)
            if self.fits(req, self.prefill_step):
                self.start(req, self.prefill_step)
                self.prefilling = req

    def prefill_chunk(self) -> Iterator[Batch]:
        """3. One chunk of the prefilling request; the chunk that ends it samples a token."""
        req = self.prefilling
        if req is None:
            return
        n = min(self.prefill_step, req.prefill_left)
        if not self.make_room(req, n):
            return
        yield Batch(prefill=[(req, n)])
        if req.finished or req.prefill_left == 0:
            self.prefilling = None
            if not req.finished:
                req.set_state(State.AWAITING_SLOT, self.clock())
                self.awaiting.append(req)

    def place(self) -> None:
        """4. Move prefilled requests into free slots, first come first placed."""
        while self.awaiting and self.free_slot() is not None:
            req = self.awaiting.popleft()
            self.take_slot(req)
            req.set_state(State.DECODING, self.clock())

    def decode_rows(self) -> Iterator[Batch]:
        """5. One decode step for every occupied slot. Blocks go to the most important
        rows first, so if the pool is short the least important give way."""
        for req in sorted((r for r in self.slots if r is not None), key=self.policy.importance):
            if req.slot is not None:  # not preempted for a more important row
                self.make_room(req, 1)
        rows = [r for r in self.slots if r is not None]
        if rows:
            yield Batch(decode=rows)


class StallFreeScheduler(Scheduler):
    """Sarathi-Serve's stall-free batching: a budget of ``token_budget`` tokens a step.
    Every running decode goes first (one token each), then the partial prefills continue
    with what is left, then new requests are admitted while budget and slots remain.
    Everything runs as ONE forward pass, so decodes never wait for a prompt.
    A prefilling request holds its slot from admission, so nobody waits for a slot."""

    kind = "stallfree"
    kv_on_demand = True

    def __init__(self, blocks: BlockManager, clock, max_batch_size: int = 8, token_budget: int = 256,
                 policy: PriorityPolicy | None = None):
        super().__init__(blocks, clock, max_batch_size, policy)
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < max_batch_size:
            raise ValueError(f"token_budget must be an integer >= max_batch_size "
                             f"({max_batch_size}), got {token_budget!r}")
        self.token_budget = token_budget
        self.prefilling: list[Request] = []  # in admission order

    def remove(self, req: Request) -> None:
        if req in self.prefilling:
            self.prefilling.remove(req)
        super().remove(req)

    def batches(self):
        batch = self.plan()
        if batch.decode or batch.prefill:
            yield batch
        self.end_prefills(batch)

    def plan(self) -> Batch:
        """The step's one pass: decodes, then partial prefills, then admissions."""
        decode = self.decodes()
        prefill = self.continue_prefills(self.token_budget - len(decode))
        prefill += self.admit(self.token_budget - len(decode) - sum(n for _, n in prefill))
        held = set(map(id, self.running))  # a later phase may have preempted an earlier pick
        return Batch(decode=[r for r in decode if id(r) in held],
                     prefill=[(r, n) for r, n in prefill if id(r) in held])

    def decodes(self) -> list[Request]:
        """Every decoding request, one token each (blocks to the most important first)."""
        decode = [r for r in self.slots if r is not None and r.state is State.DECODING]
        for req in sorted(decode, key=self.policy.importance):
            if req.slot is not None:
                self.make_room(req, 1)
        return [r for r in decode if r.slot is not None]

    def continue_prefills(self, budget: int) -> list[tuple[Request, int]]:
        """Partial prefills continue, in admission order, while the budget lasts."""
        prefill = []
        for req in list(self.prefilling):
            n = min(budget, req.prefill_left)
            if n > 0 and req in self.prefilling and self.make_room(req, n):
                prefill.append((req, n))
                budget -= n
        return prefill

    def admit(self, budget: int) -> list[tuple[Request, int]]:
        """New requests while budget, a free slot and free blocks for a first chunk remain.
        A request preempted while planning this step waits for the next one."""
        prefill = []
        while budget > 0 and self.queue and self.free_slot() is not None:
            req = self.policy.next_queued(self.queue)
            if req.id in self.preempted or not self.fits(req, budget):
                break
            n = self.start(req, budget)
            self.take_slot(req)
            self.prefilling.append(req)
            prefill.append((req, n))
            budget -= n
        return prefill

    def end_prefills(self, batch: Batch) -> None:
        """A request whose prefill is done starts decoding next step."""
        for req, _ in batch.prefill:
            if req.prefill_left == 0 and req in self.prefilling:
                self.prefilling.remove(req)
                if not req.finished:
                    req.set_state(State.DECODING, self.clock())


KINDS = {cls.kind: cls for cls in (SequentialScheduler, StaticScheduler, ContinuousScheduler,
                                   StallFreeScheduler)}
