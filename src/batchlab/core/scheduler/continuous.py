"""The iteration-level kinds. The continuous kind (lesson 2; chunked prefill, lesson 4):
iteration-level scheduling in five phases. Before it, ``OnDemandKV``: KV memory taken as
requests grow, with preemption, which it and the stall-free kind mix in. After it, the
stall-free kind (lesson 5a), which inherits it: a token budget per step, decodes first,
one fused pass (Sarathi-Serve's Algorithm 3)."""

from __future__ import annotations

import math
from typing import Iterator

from ..costmodel import CostModel, token_budget_for_slo
from ..kv import BlockManager
from ..policies import Policy
from ..request import Request, State, is_int
from ..speculative import accept_greedy, accept_sampled, propose_ngram
from .base import Batch, Option, Scheduler, StopRules


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


class StallFreeScheduler(ContinuousScheduler):
    """Sarathi-Serve's stall-free batching: continuous batching with a budget of
    ``token_budget`` tokens a step. Every running decode goes first (one token each), then
    the partial prefills continue with what is left, then new requests are admitted
    while budget and slots remain. Everything runs as ONE forward pass, so decodes never
    wait for a prompt. A prefilling request holds its slot from admission, so nobody
    waits for a slot.

    The budget, unless given, is the largest whose predicted step time (the packaged cost
    model, ``batchlab fit-cost``) meets ``tbt_slo`` seconds between tokens; without a
    target, ``costmodel.DEFAULT_SLO_DECODE_STEPS`` decode steps of a full batch.

    ``num_speculative_tokens`` > 0 turns on speculative decoding by prompt lookup (vLLM's
    option names): a decode row carries up to that many draft tokens (``drafts``) and
    becomes a verify row of 1 + k tokens in the same fused pass; ``postprocess`` keeps the
    drafts the model agrees with and rewinds the rest."""

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
        "num_speculative_tokens": Option(
            int,
            "speculative decoding by prompt lookup: up to this many draft tokens a decode row, "
            "verified in the same pass and paid from the token budget (0: off)",
            (0, 3),
        ),
        "prompt_lookup_min": Option(int, "prompt lookup: the shortest n-gram a draft is looked up by"),
        "prompt_lookup_max": Option(int, "prompt lookup: the longest n-gram a draft is looked up by"),
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
        num_speculative_tokens: int = 0,
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 4,
        policy: Policy | None = None,
    ):
        super().__init__(blocks, clock, max_batch_size, policy=policy)
        for name, value, lowest in (
            ("num_speculative_tokens", num_speculative_tokens, 0),
            ("prompt_lookup_min", prompt_lookup_min, 1),
            ("prompt_lookup_max", prompt_lookup_max, 1),
        ):
            if not is_int(value) or value < lowest:
                raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({prompt_lookup_min}) must be <= prompt_lookup_max ({prompt_lookup_max})"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max
        if token_budget is None:
            token_budget = token_budget_for_slo(CostModel.load(), max_batch_size, tbt_slo)
        if not is_int(token_budget) or token_budget < max_batch_size:
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
        """The step's one pass: every decode (with its drafts, when speculating), then partial
        prefills, then admissions. Admission (``start``) takes a newcomer's first chunk's KV
        blocks; the other rows get theirs after, in ``grow``."""
        decode = self.in_state(State.DECODING)
        budget = self.token_budget - len(decode)
        drafts = self.drafts(decode, budget)
        budget -= sum(len(d) for d in drafts.values())
        prefill = self.continue_prefills(budget)
        prefill += self.admit_within(budget - sum(n for _, n in prefill))
        return Batch(decode=decode, prefill=prefill, drafts=drafts)

    def drafts(self, decode: list[Request], budget: int) -> dict[str, list[int]]:
        """Speculative decoding by prompt lookup (vLLM's "ngram" method): each decode row, the
        most important first, gets up to ``num_speculative_tokens`` draft tokens
        (``propose_ngram`` over its prompt and output), verified in this same pass. Drafts are
        paid from the token budget before partial prefills and admissions (vLLM V1 pays its
        running requests, drafts included, in their order, before it admits new ones).
        A row gets at most one draft fewer than the tokens it has left (the verify pass adds
        one token of the model's own) and none while its stop tokens are banned
        (``min_new_tokens`` not reached); ``grow`` cuts drafts to what FREE KV blocks hold."""
        if not self.num_speculative_tokens:
            return {}
        drafts = {}
        for req in sorted(decode, key=self.policy.importance):
            tokens_left = req.max_new_tokens - len(req.output_ids)
            k = min(self.num_speculative_tokens, tokens_left - 1, budget)
            if k <= 0 or req.sampler.banned:
                continue
            length = req.prompt_len + len(req.output_ids)
            proposal = propose_ngram(
                req.token_ids(0, length), k, self.prompt_lookup_min, self.prompt_lookup_max
            )
            if proposal:
                drafts[req.id] = proposal
                budget -= len(proposal)
        return drafts

    def grow(self, batch: Batch) -> Batch:
        """Every row's blocks, the most important first, preempting while the pool is short
        (``ContinuousScheduler.grow``); then the drafts' (``fit_drafts``)."""
        return self.fit_drafts(super().grow(batch))

    def fit_drafts(self, batch: Batch) -> Batch:
        """Each draft list's blocks, the most important rows first, from FREE blocks only: a
        draft is a guess and preempts nobody, so a list is cut to what is free (the budget it
        was planned with goes unused this pass)."""
        for req in sorted(batch.decode, key=self.policy.importance):
            if req.id not in batch.drafts:
                continue
            end = req.num_computed + 1  # its row's input token; its block was taken above
            room = (len(self.blocks.tables[req.id]) + self.blocks.num_free) * self.blocks.block_size - end
            batch.drafts[req.id] = batch.drafts[req.id][: max(room, 0)]
            self.blocks.ensure(req.id, end + len(batch.drafts[req.id]))
        return batch

    def accept(self, req: Request, drafts: list[int], picks: list[int]) -> list[int]:
        """The tokens a verify row adds: the drafts its picks confirm, then the model's own
        (``accept_greedy`` for a greedy request, ``accept_sampled`` for a sampled one)."""
        rule = accept_greedy if req.sampler.params.greedy else accept_sampled
        return rule(drafts, picks)

    def continue_prefills(self, budget: int) -> list[tuple[Request, int]]:
        """Partial prefills continue, in admission order, while the budget lasts."""
        prefill = []
        for req in self.in_state(State.PREFILLING):
            n = min(budget, req.prefill_left)
            if n > 0:
                prefill.append((req, n))
                budget -= n
        return prefill

    def admit_within(self, budget: int) -> list[tuple[Request, int]]:
        """New requests while budget, a free slot and free blocks for a first chunk remain."""
        prefill = []
        while budget > 0 and self.queue and self.free_slot() is not None:
            req = self.policy.next_queued(self.queue)
            if not self.fits(req, budget):
                break
            n = self.start(req, budget)
            self.take_slot(req)
            prefill.append((req, n))
            budget -= n
        return prefill
