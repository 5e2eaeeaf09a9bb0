"""The stall-free kind (lesson 5a): a token budget per step, decodes first, one fused pass
(Sarathi-Serve's Algorithm 3)."""

from __future__ import annotations


from ..batch import Batch
from ..costmodel import CostModel, token_budget_for_slo
from ..kv import BlockManager
from ..numbers import is_int
from ..policies import Policy
from ..request import Request, State
from ..speculative import accept_greedy, accept_sampled, propose_ngram
from .base import Option
from .continuous import ContinuousScheduler


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
