"""Lesson 5's checkers reject known-wrong solutions and name the mistake. The wrong planners
are the lesson's ``MyStallFreeScheduler`` with one mistake each."""

from __future__ import annotations

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
import pytest

from batchlab.course import checks as check
from batchlab import course
from batchlab.core.request import State
from batchlab.core.scheduler import Batch, StallFreeScheduler
from learner_pieces import MyStallFreeScheduler


def assert_rejected(verdict, first_case: str, *says: str) -> None:
    """The verdict fails (not as "not written yet"), its first failing case starts with
    ``first_case``, and it says each of ``says``."""
    assert not verdict and not verdict.not_written, verdict.message
    assert f"The first that does not:\n  case {first_case}" in verdict.message, verdict.message
    for words in says:
        assert words in verdict.message, f"{words!r} not in:\n{verdict.message}"


def prefills(self, budget):
    """The lesson's partial prefills within ``budget`` (shared by the wrong planners below)."""
    chosen = []
    for req in self.in_state(State.PREFILLING):
        n = min(budget, self.chunk(req))
        if n > 0:
            chosen.append((req, n))
            budget -= n
    return chosen


def admissions(self, budget, at_most=None):
    """The lesson's admissions within ``budget`` (at most ``at_most`` of them)."""
    chosen = []
    while budget > 0 and self.queue and self.free_slot() is not None and len(chosen) != at_most:
        started = self.admit_next(budget)
        if started is None:
            break
        self.take_slot(started[0])
        chosen.append(started)
        budget -= started[1]
    return chosen


def spent(chosen) -> int:
    return sum(n for _, n in chosen)


class PrefillFirst(MyStallFreeScheduler):
    """Gives the budget to prefill first; the decodes get what is left."""

    def plan(self):
        prefill = prefills(self, self.token_budget)
        prefill += admissions(self, self.token_budget - spent(prefill))
        left = self.token_budget - spent(prefill)
        return Batch(decode=self.in_state(State.DECODING)[: max(left, 0)], prefill=prefill)


class OverBudget(MyStallFreeScheduler):
    """Forgets that the decodes use budget too: prefill gets the whole budget."""

    def plan(self):
        prefill = prefills(self, self.token_budget)
        prefill += admissions(self, self.token_budget - spent(prefill))
        return Batch(decode=self.in_state(State.DECODING), prefill=prefill)


class NeverAdmits(MyStallFreeScheduler):
    """Decodes and continues prefills, but never takes anyone from the queue."""

    def plan(self):
        decode = self.in_state(State.DECODING)
        return Batch(decode=decode, prefill=prefills(self, self.token_budget - len(decode)))


class OneAdmissionAStep(MyStallFreeScheduler):
    """Admits at most one request a step, leaving budget unused while others wait."""

    def plan(self):
        decode = self.in_state(State.DECODING)
        prefill = prefills(self, self.token_budget - len(decode))
        if not prefill:
            prefill = admissions(self, self.token_budget - len(decode), at_most=1)
        return Batch(decode=decode, prefill=prefill)


class AdmitsBlind(MyStallFreeScheduler):
    """The lesson's plan, but admitting without asking whether the request's memory fits:
    fine in a big pool, a MemoryError in a small one."""

    def admit_next(self, max_tokens):
        req = self.policy.next_queued(self.queue)
        return req, self.start(req, min(max_tokens, self.chunk(req)))


class AdmitsWithoutASlot(MyStallFreeScheduler):
    """Admits while budget lasts, whether or not a decode slot is free."""

    def plan(self):
        decode = self.in_state(State.DECODING)
        prefill = prefills(self, self.token_budget - len(decode))
        budget = self.token_budget - len(decode) - spent(prefill)
        while budget > 0 and self.queue:
            started = self.admit_next(budget)
            if started is None:
                break
            self.take_slot(started[0])
            prefill.append(started)
            budget -= started[1]
        return Batch(decode=decode, prefill=prefill)


class NotWritten(MyStallFreeScheduler):
    def plan(self):
        raise NotImplementedError("write plan")


def test_the_lessons_piece_passes_and_ours_fails_only_the_lineage():
    assert check.stallfree_planner(MyStallFreeScheduler)
    ours = check.stallfree_planner(StallFreeScheduler)
    assert ours.passed == ours.total - 1 and ours.failed[0].startswith("derives from Scheduler"), ours.message


class DecodesListedLast(MyStallFreeScheduler):
    """The lesson's rule, its rows listed in another order within the pass (prefills, then the
    decodes newest first): row order within a pass is left open."""

    def plan(self):
        batch = super().plan()
        return Batch(decode=list(reversed(batch.decode)), prefill=list(reversed(batch.prefill)))


class MinimumFirstChunk(MyStallFreeScheduler):
    """Going further (lesson 5a): start a request only if at least 4 tokens of budget are left
    for its first chunk; budget may stay unused. A different rule, inside the contract."""

    def plan(self):
        decode = self.in_state(State.DECODING)
        prefill = prefills(self, self.token_budget - len(decode))
        left = self.token_budget - len(decode) - spent(prefill)
        if left >= 4:
            prefill += admissions(self, left)
        return Batch(decode=decode, prefill=prefill)


def test_row_order_within_a_pass_is_left_open():
    verdict = check.stallfree_planner(DecodesListedLast)
    assert verdict and not verdict.differs, verdict.message


@pytest.mark.parametrize(
    "design, says",
    [
        (OneAdmissionAStep, ["the stall-free rule gives", "admissions while budget and slots remain"]),
        (MinimumFirstChunk, ["is not the lesson's", "the lesson's rule:", "yours:"]),
    ],
)
def test_a_different_rule_inside_the_contract_passes_and_is_named(design, says):
    """A design of the learner's own passes (it keeps every rule the engine needs), and the
    verdict's second level says where it parts from Algorithm 3."""
    verdict = check.stallfree_planner(design)
    assert verdict and verdict.differs, verdict.message
    assert "cases keep the contract" in verdict.message and "differs from the lesson's" in verdict.message
    for words in says:
        assert words in verdict.message, f"{words!r} not in:\n{verdict.message}"


@pytest.mark.parametrize(
    "wrong, first_case, says",
    [
        (PrefillFirst, "2 of 10", ["was decoding but got no decode row", "before any prefill"]),
        (OverBudget, "2 of 10", ["over the token budget of 16"]),
        (NeverAdmits, "2 of 10", ["the engine got stuck"]),
        (
            AdmitsBlind,
            "10 of 10",
            ["the KV pool ran out (16 blocks): MemoryError: start(r", "self.admit_next"],
        ),
        (AdmitsWithoutASlot, "2 of 10", ["every decode slot is taken", "admit only while self.free_slot()"]),
    ],
)
def test_stallfree_planner_rejects(wrong, first_case, says):
    assert_rejected(check.stallfree_planner(wrong), first_case, *says)


def test_a_plan_that_admits_blind_passes_every_case_but_the_small_pool():
    assert check.stallfree_planner(AdmitsBlind).passed == 9


def test_a_plan_that_only_calls_super_is_not_written():
    """Its parent is the learner's lesson-4 class, which has no plan(): super() reaches nothing."""

    class OnlySuper(MyStallFreeScheduler):
        def batches(self):
            yield from super(MyStallFreeScheduler, self).batches()

    verdict = check.stallfree_planner(OnlySuper)
    assert not verdict, verdict.message


@pytest.mark.parametrize("piece", [NotWritten, course.Missing("MyStallFreeScheduler", "no file")])
def test_an_unwritten_piece_is_reported_as_not_written(piece):
    verdict = check.stallfree_planner(piece)
    assert not verdict and verdict.not_written, verdict.message


# --------------------------------------------------------------------------------------
# The smaller exercises.


def pack_at_zero(chunks):
    """Numbers every token by its place in the packed row, not in its own sequence."""
    tokens = [t for c in chunks for t in c.tokens]
    return tokens, list(range(len(tokens))), [len(tokens) - 1]


def test_packing_with_row_positions_is_rejected():
    assert_rejected(check.pack_chunks(pack_at_zero), "1 of 6", "positions")


def skips_counted_from_the_first_token(trace):
    """Counts the step of a request's first token as a decoding step too."""
    steps = list(trace.steps)
    found = []
    for rid in {r for s in steps for r in s.emitted}:
        ks = [k for k, s in enumerate(steps) if rid in s.emitted]
        found += [(steps[k].index, rid) for k in range(ks[0], ks[-1] + 1) if rid not in steps[k].decoded]
    return found


def test_skips_from_the_first_token_are_rejected():
    assert_rejected(check.skipped_decodes(skips_counted_from_the_first_token), "1 of 4", "are not skips")


def saving_against_the_chunk_alone(chunk_s, decode_s, fused_s):
    return 1 - fused_s / chunk_s


def test_a_saving_against_the_chunk_alone_is_rejected():
    assert_rejected(check.fused_saving(saving_against_the_chunk_alone), "1 of 4", "BOTH separate passes")
