"""KV memory on demand, for the kinds that let requests grow (continuous, stall-free):
starting a request on its cached prefix (``start``), taking blocks as it grows and
preempting when the pool runs dry (``make_room``). The admission rule by free blocks
(``fits``), the per-pass growth with its preemptions (``grow``) and what a preempted
request becomes (``preempt``, by recompute) are the kind's own. A mixin: ``class Kind(OnDemandKV, Scheduler)``."""

from __future__ import annotations

from ..batch import Batch
from ..request import Request


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
