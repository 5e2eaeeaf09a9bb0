"""The continuous kind (lesson 2; chunked prefill, lesson 4): iteration-level scheduling
in five phases. Before it, ``OnDemandKV``: KV memory taken as requests grow, with
preemption, which it and the stall-free kind mix in."""

from __future__ import annotations

import math
from typing import Iterator

from ..batch import Batch
from ..kv import BlockManager
from ..numbers import is_int
from ..policies import Policy
from ..request import Request, State
from .base import Option, Scheduler, StopRules


# KV memory on demand, for the kinds that let requests grow (continuous, stall-free):
# starting a request on its cached prefix (``start``), taking blocks as it grows and
# preempting when the pool runs dry (``make_room``). The admission rule by free blocks
# (``fits``), the per-pass growth with its preemptions (``grow``) and what a preempted
# request becomes (``preempt``, by recompute) are the kind's own. A mixin:
# ``class Kind(OnDemandKV, Scheduler)``.
class OnDemandKV:
    """Blocks taken as requests grow, so prefix caching can share them (mixed into a
    ``Scheduler``: it uses its queue, ``running``, ``blocks``, ``policy`` and ``release``)."""

    kv_on_demand = True

    def first_chunk(self, req: Request, max_tokens: float) -> tuple[list[int], int, int]:
        """(cached blocks it can share, their tokens, its first chunk's length)."""
        hits = self.blocks.lookup(req.token_ids(0, req.prefill_len))
        cached = len(hits) * self.blocks.block_size
        return hits, cached, min(max_tokens, req.prefill_len - cached)

    def fits(self, req: Request, max_tokens: float) -> bool:
        """Admission by free blocks: the kind's own rule (the base's reserves whole requests)."""
        raise NotImplementedError(
            f"{type(self).__name__} must write fits(req, max_tokens): True if the free KV blocks "
            f"hold req's first chunk of at most max_tokens tokens (after its cached prefix), "
            f"keeping headroom for the requests already decoding"
        )

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

    def grow(self, batch: Batch) -> Batch:
        """Preemption by recompute, the kind's own rule: take the blocks every row of ``batch``
        writes, giving way to the pool's limits; return the batch that can run."""
        raise NotImplementedError(
            f"{type(self).__name__} must write grow(batch): take the KV blocks of every row (one for a "
            f"decode row, n for a chunk), the most important first, preempting the policy's victim "
            f"while the pool is short; return the Batch of the rows still running"
        )

    def preempt(self, req: Request) -> None:
        """Preemption by recompute, the kind's own rule: ``req`` gives back every block it
        holds (``release`` frees them and counts the preemption) and, unless it finished
        meanwhile, waits to prefill again, keeping the tokens it generated."""
        raise NotImplementedError(
            f"{type(self).__name__} must write preempt(req): release all of req's blocks; unless "
            f"it finished, put it back QUEUED at the front of the queue, its KV cache empty, its "
            f"next prefill covering its prompt and the tokens it generated"
        )


class ContinuousScheduler(StopRules, OnDemandKV, Scheduler):
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
    prefill_lane = True

    def __init__(
        self,
        blocks: BlockManager,
        clock,
        max_batch_size: int = 8,
        prefill_step: int | None = None,
        policy: Policy | None = None,
    ):
        super().__init__(blocks, clock, max_batch_size, policy)
        if prefill_step is not None and (not is_int(prefill_step) or prefill_step < 1):
            raise ValueError(f"prefill_step must be an integer >= 1, got {prefill_step!r}")
        self.prefill_step = prefill_step or math.inf

    def batches(self):
        self.admit()
        yield from self.prefill_chunk()
        self.place()
        yield from self.decode_rows()

    def fits(self, req, max_tokens: float) -> bool:
        """Admission by free blocks: the pool must hold the first chunk (at most
        ``max_tokens``, after any cached prefix) and still keep one block of headroom for
        every decoding request, room for its next token (a prefill still under way is not
        counted: its next chunk may preempt)."""
        hits, cached, n = self.first_chunk(req, max_tokens)
        taken = (
            self.blocks.blocks_for(cached + n) - len(hits) + sum(self.blocks.ref_counts[b] == 0 for b in hits)
        )  # evictable hits leave the free pool
        headroom = sum(r.state is State.DECODING for r in self.running)
        return taken + headroom <= self.blocks.num_free

    def grow(self, batch: Batch) -> Batch:
        """Take the blocks every row of ``batch`` writes, the most important rows first, so
        that when the pool is short the least important give way (``make_room``). Returns the
        batch without the rows that were preempted. The one place a pass's rows get their
        blocks: planners only choose rows (admission, ``start``, takes a first chunk's)."""
        rows = [(r, 1) for r in batch.decode] + list(batch.prefill)
        for req, n in sorted(rows, key=lambda row: self.policy.importance(row[0])):
            if req in self.running:
                self.make_room(req, n)
        held = set(map(id, self.running))
        if all(id(r) in held for r, _ in rows):
            return batch
        decode = [r for r in batch.decode if id(r) in held]
        prefill = [(r, n) for r, n in batch.prefill if id(r) in held]
        drafts = {r.id: batch.drafts[r.id] for r in decode if r.id in batch.drafts}
        return Batch(
            decode=decode,
            prefill=prefill,
            padding=batch.padding,
            padding_tokens=batch.padding_tokens,
            drafts=drafts,
        )

    def preempt(self, req: Request) -> None:
        """Preemption by recompute: ``req`` gives back all its blocks and waits at the front of
        the queue (it was admitted before everything queued); re-admitted, it prefills its
        prompt and the tokens it generated, then samples its next token."""
        self.release(req)
        if req.finished:  # cancelled meanwhile: nothing to come back for
            return
        req.num_computed = 0  # its KV cache is gone
        req.prefill_len = req.prompt_len + len(req.output_ids)
        req.set_state(State.QUEUED, self.clock())
        self.queue.appendleft(req)

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
            yield Batch(prefill=[(req, min(self.prefill_step, req.prefill_left))])

    def place(self) -> None:
        """4. Move prefilled requests into free slots, first come first placed."""
        for req in self.in_state(State.AWAITING_SLOT):
            if self.free_slot() is None:
                break
            self.take_slot(req)
            req.set_state(State.DECODING, self.clock())

    def decode_rows(self) -> Iterator[Batch]:
        """5. One decode step for every occupied slot."""
        rows = [r for r in self.slots if r is not None]
        if rows:
            yield Batch(decode=rows)
