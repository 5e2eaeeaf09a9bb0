"""The stall-free kind (lesson 5a): a token budget per step, decodes first, one fused pass
(Sarathi-Serve's Algorithm 3)."""

from __future__ import annotations


from ..batch import Batch
from ..costmodel import CostModel, token_budget_for_slo
from ..kv import BlockManager
from ..numbers import is_int
from ..policies import Policy
from ..request import Request, State
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
        policy: Policy | None = None,
    ):
        super().__init__(blocks, clock, max_batch_size, policy=policy)
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
