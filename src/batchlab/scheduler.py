"""Schedulers: the policy half of the engine, in pure Python (no MLX, not even through
an import).

A scheduler owns the waiting queue, the decode slots and the KV blocks (it is the only
code that takes or frees them), and decides what the model runs. One flow serves every
kind:

- **Planning** is the kind's ``batches()``: a generator that yields one ``Batch`` (one
  forward pass) at a time. It is the only code a kind writes; it reads the requests'
  states and changes them (admits, places, preempts).
- **The result** of each pass goes to ``postprocess`` (shared by every kind): requests
  advance by what they computed, get their new tokens, finish, and a request whose
  prompt is done moves on -- to decoding if it holds a slot, else to await one.
- **Leaving** (finish, cancel, preemption) is ``remove`` / ``release``, also shared: a
  kind keeps no containers of its own to keep in sync. Who is prefilling, awaiting a
  slot or decoding is read from the requests themselves (``in_state``), in admission
  order (``running``).

The engine asks ``passes()`` for the passes of one iteration, has each ``prepare``d
(blocks taken, described as runner ``Chunk``s), runs it, and hands the new tokens to
``postprocess``; then the generator resumes and sees the result. The kinds:

- ``SequentialScheduler``: one request at a time, start to finish.
- ``StaticScheduler``: up to B requests start together; nobody joins until all finish.
- ``ContinuousScheduler``: iteration-level scheduling in five phases (see ``batches``).
- ``StallFreeScheduler``: a token budget per step, decodes first, one fused pass.

*Write your own*: subclass one of them, give it a ``kind`` name and a one-line
``description``, and pass the class to ``make_engine(MyScheduler, lm, ...)`` -- or
``--engine my_module:MyScheduler`` to any ``batchlab`` command. A scheduler's options are
the keyword arguments of its constructor after ``(blocks, clock)``, with their defaults;
``options`` gives each its type and help text (the command line's flags come from it).
Every class defined here with a ``kind`` of its own joins ``KINDS``, the registry every
command, the bench and the README read.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

from .batch import Batch
from .costmodel import CostModel, token_budget_for_slo
from .kv import BlockManager
from .policies import PriorityPolicy
from .request import Request, State
from .runner import Chunk

KINDS: dict[str, type["Scheduler"]] = {}  # kind name -> class: the kinds batchlab ships


@dataclass(frozen=True)
class Option:
    """One option of a scheduler kind, as a command line offers it. ``examples``: values
    the tests run every kind with (edge cases first), so a new kind is tested by declaring
    it."""

    type: type
    help: str
    examples: tuple = ()


class Scheduler:
    """What every policy shares: a queue, B decode slots, the KV blocks, and the flow of
    a pass (``prepare`` before the runner, ``postprocess`` after it).

    Static and sequential batching reserve a request's whole KV memory up front
    (``reserve``). Continuous and stall-free take blocks on demand (``fits``, ``start``,
    ``make_room``) and preempt when the pool runs dry. ``running`` lists every admitted
    request (it holds KV blocks), in admission order.
    """

    kind = "base"
    description = ""  # one line: what this kind does (the CLI, ``batchlab demo``, the README)
    options: dict[str, Option] = {
        "max_batch_size": Option(
            int, "decode slots: at most this many requests decode together (B)", (1, 3, 8)
        ),
    }
    bench_variants: dict[str, dict] = {}  # engines of this kind in ``batchlab bench``: name -> options
    kv_on_demand = False  # blocks taken as requests grow (so prefix caching can share them)
    prefill_lane = False  # prefilling requests hold no decode slot (pictures draw a lane)
    rectangular = False  # a finished request keeps its row (slot, KV) until its whole batch ends

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__module__ == __name__ and "kind" in cls.__dict__:
            KINDS[cls.kind] = cls

    def __init__(
        self,
        blocks: BlockManager,
        clock: Callable[[], float],
        max_batch_size: int = 8,
        policy: PriorityPolicy | None = None,
    ):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        self.blocks, self.clock = blocks, clock
        self.policy = policy or PriorityPolicy()
        self.queue: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_batch_size
        self.running: list[Request] = []  # admitted, holding KV blocks, in admission order
        self.preempted: list[str] = []  # preempted during the current step
        self.num_preemptions = 0

    @classmethod
    def option_defaults(cls) -> dict:
        """The options this kind takes, with their defaults: its constructor's keyword
        arguments after ``(blocks, clock)``."""
        params = list(inspect.signature(cls.__init__).parameters.values())[3:]
        return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    @classmethod
    def option_specs(cls) -> dict[str, tuple[object, Option | None]]:
        """Each option with its default and its ``Option`` (None where no class in the
        kind's lineage describes it, e.g. ``policy``: an object, not a command-line value)."""
        described: dict[str, Option] = {}
        for klass in reversed(cls.__mro__):
            described.update(getattr(klass, "options", {}) or {})
        return {name: (default, described.get(name)) for name, default in cls.option_defaults().items()}

    # -- bookkeeping shared by all policies --------------------------------------------
    def add(self, req: Request) -> None:
        self.queue.append(req)

    def has_work(self) -> bool:
        return bool(self.queue) or bool(self.running)

    def in_state(self, *states: State) -> list[Request]:
        """The admitted requests in any of ``states``, in admission order."""
        return [r for r in self.running if r.state in states]

    def free_slot(self) -> int | None:
        return next((i for i, r in enumerate(self.slots) if r is None), None)

    def take_slot(self, req: Request) -> None:
        slot = self.free_slot()
        if slot is None:
            raise RuntimeError(
                f"take_slot({req.id}): every decode slot is taken; check "
                f"free_slot() is not None first (or free finished requests)"
            )
        req.slot = slot
        self.slots[slot] = req

    def reserve(self, req: Request) -> bool:
        """Reserve KV blocks for the whole request (prompt + every token it may generate);
        False if the pool cannot promise them now."""
        if not self.blocks.can_reserve(req.prompt_len + req.max_new_tokens):
            return False
        self.blocks.reserve(req.id, req.prompt_len + req.max_new_tokens)
        return True

    def begin(self, req: Request) -> None:
        """``req`` leaves the queue and starts prefilling: it joins ``running``."""
        if req in self.queue:
            self.queue.remove(req)
        self.running.append(req)
        req.set_state(State.PREFILLING, self.clock())

    def remove(self, req: Request) -> None:
        """A request leaves (finished, cancelled): free everything it held -- except, in a
        ``rectangular`` batch, a row that still runs: it stays as padding until its batch
        ends and the kind's planning releases it."""
        if self.rectangular and req in self.running:
            return
        self.release(req)

    def release(self, req: Request) -> None:
        """Forget ``req`` and free its slot and KV blocks."""
        if req in self.queue:
            self.queue.remove(req)
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        if req in self.running:
            self.running.remove(req)
        req.slot = None
        self.blocks.release(req.id)

    def check_pool_holds(self, num_tokens: int) -> None:
        """Refuse (ValueError) a request that could never fit the KV pool."""
        need = self.blocks.blocks_for(num_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"prompt + max_new_tokens = {num_tokens} tokens needs {need} KV blocks, but the "
                f"engine has {self.blocks.num_blocks} blocks of {self.blocks.block_size} tokens; "
                f"raise num_kv_blocks"
            )

    def passes(self) -> Iterator[Batch]:
        """This step's passes: what the engine iterates. Starts the step's bookkeeping,
        then runs the kind's own planning, ``batches()``."""
        self.preempted = []
        yield from self.batches()

    def batches(self) -> Iterator[Batch]:
        """Planning: yield this step's passes, one ``Batch`` each (the kind's own code)."""
        raise NotImplementedError

    # -- one pass: before and after the runner --------------------------------------------
    def prepare(self, batch: Batch) -> list[Chunk]:
        """Take the KV blocks ``batch`` writes and describe it to the runner: one chunk per
        request, in ``batch.requests`` order. (On-demand kinds took them while planning,
        with ``make_room``; for up-front kinds this is where reserved blocks are taken.)"""
        chunks = [self._chunk(r, r.next_input(), sample=True) for r in batch.decode]
        for req, n in batch.prefill:  # the prompt (+ generated tokens, recomputed after preemption)
            end = req.num_computed + n
            chunks.append(
                self._chunk(req, req.token_ids(req.num_computed, end), sample=end == req.prefill_len)
            )
        # static: a finished row's last position is recomputed and the result thrown away
        chunks += [self._chunk(r, r.next_input(), sample=False) for r in batch.padding]
        return chunks

    def _chunk(self, req: Request, tokens: list[int], sample: bool) -> Chunk:
        start, end = req.num_computed, req.num_computed + len(tokens)
        table = self.blocks.ensure(req.id, end)
        self.blocks.check_writable(req.id, start, end)
        return Chunk(req.id, tokens, start, list(table), req.sampler if sample else None)

    def postprocess(
        self, batch: Batch, tokens: list[int | None], now: float
    ) -> list[tuple[Request, int, str | None]]:
        """The one result hook, after every pass of every kind: advance each request by
        what it computed, name full blocks for the prefix cache, hand out the new tokens
        (one per ``batch.requests`` entry, None where none was sampled), free the
        requests that finished, and move a request whose prompt is done on to decoding
        (it holds a slot) or to await a slot. Returns ``(request, token, finish reason or
        None)`` for every token handed out."""
        for req in batch.decode:
            req.num_computed += 1
        for req, n in batch.prefill:
            req.num_computed += n
        for req in batch.requests[: len(batch.decode) + len(batch.prefill)]:
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
        for req, _ in batch.prefill:  # a finished prompt moves on: decode in its slot, or await one
            if req.prefill_left == 0 and req.state is State.PREFILLING:
                req.set_state(State.DECODING if req.slot is not None else State.AWAITING_SLOT, self.clock())
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
        return {
            "num_kv_blocks": b.num_blocks,
            "free_kv_blocks": b.num_free,
            "kv_blocks_used": b.num_blocks - b.num_free,
            "block_tables": {rid: list(t) for rid, t in b.tables.items()},
            "cached_blocks": list(b.evictable),
            "preemptions": self.num_preemptions,
            "prefix_cache_hits": b.hit_blocks,
            "prefix_cache_hit_tokens": b.hit_tokens,
        }

    # -- on-demand KV memory (continuous, stall-free) ------------------------------------
    def first_chunk(self, req: Request, max_tokens: float) -> tuple[list[int], int, int]:
        """(cached blocks it can share, their tokens, its first chunk's length)."""
        hits = self.blocks.lookup(req.token_ids(0, req.prefill_len))
        cached = len(hits) * self.blocks.block_size
        return hits, cached, min(max_tokens, req.prefill_len - cached)

    def fits(self, req: Request, max_tokens: float) -> bool:
        """Admission by free blocks: the pool must hold the first chunk (at most
        ``max_tokens``, after any cached prefix) and still keep one block of headroom for
        every decoding request, so that admitting does not at once force a preemption."""
        hits, cached, n = self.first_chunk(req, max_tokens)
        taken = (
            self.blocks.blocks_for(cached + n) - len(hits) + sum(self.blocks.ref_counts[b] == 0 for b in hits)
        )  # evictable hits leave the free pool
        headroom = sum(r.state is State.DECODING for r in self.running)
        return taken + headroom <= self.blocks.num_free

    def start(self, req: Request, max_tokens: float) -> int:
        """Admit ``req`` (checked with ``fits``) into prefilling: share its cached prefix,
        take blocks for its first chunk; return that chunk's length."""
        hits, cached, n = self.first_chunk(req, max_tokens)
        self.blocks.share(req.id, hits)
        req.num_computed = cached
        self.blocks.ensure(req.id, cached + n)
        self.begin(req)
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
        self.release(req)
        if req.finished:  # cancelled meanwhile: nothing to come back for
            return
        req.preempt(self.clock())
        self.queue.appendleft(req)
        self.preempted.append(req.id)
        self.num_preemptions += 1


class SequentialScheduler(Scheduler):
    """One request at a time: prefill its whole prompt, decode it to the end, next."""

    kind = "sequential"
    description = "one request at a time, start to finish: the baseline every batching engine beats"
    options: dict[str, Option] = {}

    def __init__(self, blocks: BlockManager, clock):
        super().__init__(blocks, clock, 1)

    def batches(self):
        if self.running:
            yield Batch(decode=self.running[:1])
        elif self.queue and self.reserve(self.queue[0]):
            req = self.queue[0]
            self.begin(req)
            self.take_slot(req)
            yield Batch(prefill=[(req, req.prompt_len)])


class StaticScheduler(Scheduler):
    """Static batching: take up to B queued requests, prefill them together, decode until
    the longest is done. Finished rows stay in the batch as padding (computed, thrown
    away, their KV memory held) because a rectangular batch cannot shrink: the batch is
    ``running``, and it ends when every row has finished."""

    kind = "static"
    description = "up to B requests start together; nobody joins until the longest finishes"
    bench_variants = {"static": {}}
    rectangular = True

    def batches(self):
        if not self.running:  # start a batch: up to B requests from the front of the queue
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
        if live:  # finished rows ride along as padding
            yield Batch(decode=live, padding=[r for r in self.running if r.finished])
        if all(r.finished for r in self.running):  # the batch is over: free its rows
            for r in list(self.running):
                self.release(r)


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
    description = (
        "iteration-level: one admission a step, its prefill as a pass of its own "
        "(whole, or prefill_step tokens at a time), then one decode pass over every slot"
    )
    options = {
        "prefill_step": Option(
            int,
            "prefill at most this many prompt tokens a step "
            "(chunked prefill; default: the whole prompt at once)",
            (1, 7, 128, None),
        )
    }
    bench_variants = {"continuous": {}, "chunked": {"prefill_step": 128}}
    kv_on_demand = True
    prefill_lane = True

    def __init__(
        self,
        blocks: BlockManager,
        clock,
        max_batch_size: int = 8,
        prefill_step: int | None = None,
        policy: PriorityPolicy | None = None,
    ):
        super().__init__(blocks, clock, max_batch_size, policy)
        if prefill_step is not None and (
            isinstance(prefill_step, bool) or not isinstance(prefill_step, int) or prefill_step < 1
        ):
            raise ValueError(f"prefill_step must be an integer >= 1, got {prefill_step!r}")
        self.prefill_step = prefill_step or math.inf

    def batches(self):
        self.admit()
        yield from self.prefill_chunk()
        self.place()
        yield from self.decode_rows()

    def admit(self) -> None:
        """2. Admit one request at a time, and none while another prefills or waits for a
        slot; only if the free blocks hold its first chunk."""
        if self.queue and not self.in_state(State.PREFILLING, State.AWAITING_SLOT):
            req = self.policy.next_queued(self.queue)
            if self.fits(req, self.prefill_step):
                self.start(req, self.prefill_step)

    def prefill_chunk(self) -> Iterator[Batch]:
        """3. One chunk of the prefilling request, a pass of its own; the chunk that ends
        the prompt samples its first token (then it awaits a slot)."""
        for req in self.in_state(State.PREFILLING)[:1]:
            n = min(self.prefill_step, req.prefill_left)
            if self.make_room(req, n):
                yield Batch(prefill=[(req, n)])

    def place(self) -> None:
        """4. Move prefilled requests into free slots, first come first placed."""
        for req in self.in_state(State.AWAITING_SLOT):
            if self.free_slot() is None:
                break
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


class StallFreeScheduler(ContinuousScheduler):
    """Sarathi-Serve's stall-free batching: continuous batching with a budget of
    ``token_budget`` tokens a step. Every running decode goes first (one token each), then
    the partial prefills continue with what is left, then new requests are admitted
    while budget and slots remain. Everything runs as ONE forward pass, so decodes never
    wait for a prompt. A prefilling request holds its slot from admission, so nobody
    waits for a slot.

    The budget, unless given, is the largest whose predicted step time (the packaged cost
    model, ``batchlab fit-cost``) meets ``tbt_slo`` seconds between tokens; without a
    target, ``costmodel.DEFAULT_SLO_DECODE_STEPS`` decode steps of a full batch."""

    kind = "stallfree"
    description = (
        "Sarathi-Serve's stall-free batching: a token budget a step, decodes first, "
        "then prefill chunks, all in ONE fused forward pass"
    )
    options = {
        "token_budget": Option(
            int,
            "tokens a step: decodes first, prefill chunks in the rest "
            "(default: chosen from --tbt-slo by the cost model)",
            (8, 15, 136),
        ),
        "tbt_slo": Option(
            float,
            "the time-between-tokens target in seconds the budget is chosen "
            "for (default: a multiple of the predicted decode step)",
        ),
    }
    bench_variants = {"stallfree": {}}
    prefill_lane = False

    def __init__(
        self,
        blocks: BlockManager,
        clock,
        max_batch_size: int = 8,
        token_budget: int | None = None,
        tbt_slo: float | None = None,
        policy: PriorityPolicy | None = None,
    ):
        super().__init__(blocks, clock, max_batch_size, policy=policy)
        if token_budget is None:
            token_budget = token_budget_for_slo(CostModel.load(), max_batch_size, tbt_slo)
        if (
            isinstance(token_budget, bool)
            or not isinstance(token_budget, int)
            or token_budget < max_batch_size
        ):
            raise ValueError(
                f"token_budget must be an integer >= max_batch_size ({max_batch_size}), got {token_budget!r}"
            )
        self.token_budget = token_budget
        self.tbt_slo = tbt_slo

    def batches(self):
        batch = self.plan()
        if batch.decode or batch.prefill:
            yield batch

    def plan(self) -> Batch:
        """The step's one pass: decodes, then partial prefills, then admissions."""
        decode = self.decodes()
        prefill = self.continue_prefills(self.token_budget - len(decode))
        prefill += self.admit_within(self.token_budget - len(decode) - sum(n for _, n in prefill))
        held = set(map(id, self.running))  # a later phase may have preempted an earlier pick
        return Batch(
            decode=[r for r in decode if id(r) in held], prefill=[(r, n) for r, n in prefill if id(r) in held]
        )

    def decodes(self) -> list[Request]:
        """Every decoding request, one token each (blocks to the most important first)."""
        decode = self.in_state(State.DECODING)
        for req in sorted(decode, key=self.policy.importance):
            if req.slot is not None:
                self.make_room(req, 1)
        return [r for r in decode if r.slot is not None]

    def continue_prefills(self, budget: int) -> list[tuple[Request, int]]:
        """Partial prefills continue, in admission order, while the budget lasts."""
        prefill = []
        for req in self.in_state(State.PREFILLING):
            n = min(budget, req.prefill_left)
            if n > 0 and req.state is State.PREFILLING and self.make_room(req, n):
                prefill.append((req, n))
                budget -= n
        return prefill

    def admit_within(self, budget: int) -> list[tuple[Request, int]]:
        """New requests while budget, a free slot and free blocks for a first chunk remain.
        A request preempted while planning this step waits for the next one."""
        prefill = []
        while budget > 0 and self.queue and self.free_slot() is not None:
            req = self.policy.next_queued(self.queue)
            if req.id in self.preempted or not self.fits(req, budget):
                break
            n = self.start(req, budget)
            self.take_slot(req)
            prefill.append((req, n))
            budget -= n
        return prefill
