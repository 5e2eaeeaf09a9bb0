"""Lesson 5's checkers reject known-wrong solutions and name the mistake. The wrong planners
are subclasses of the library's ``StallFreeScheduler`` overriding ``plan()``, as the
learner's ``MyStallFreeScheduler`` does."""

from __future__ import annotations

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
import pytest

from batchlab.course import checks as check
from batchlab import course
from batchlab.core.batch import Batch
from batchlab.core.request import State
from batchlab.core.scheduler import StallFreeScheduler
from learner_pieces import MyStallFreeScheduler


def assert_rejected(verdict, first_case: str, *says: str) -> None:
    """The verdict fails (not as "not written yet"), its first failing case starts with
    ``first_case``, and it says each of ``says``."""
    assert not verdict and not verdict.not_written, verdict.message
    assert f"The first that does not:\n  case {first_case}" in verdict.message, verdict.message
    for words in says:
        assert words in verdict.message, f"{words!r} not in:\n{verdict.message}"


class PrefillFirst(StallFreeScheduler):
    """Gives the budget to prefill first; the decodes get what is left."""

    def plan(self):
        prefill = self.continue_prefills(self.token_budget)
        prefill += self.admit_within(self.token_budget - sum(n for _, n in prefill))
        left = self.token_budget - sum(n for _, n in prefill)
        return Batch(decode=self.decodes()[: max(left, 0)], prefill=prefill)


class OverBudget(StallFreeScheduler):
    """Forgets that the decodes use budget too: prefill gets the whole budget."""

    def plan(self):
        decode = self.decodes()
        prefill = self.continue_prefills(self.token_budget)
        prefill += self.admit_within(self.token_budget - sum(n for _, n in prefill))
        return Batch(decode=decode, prefill=prefill)


class NeverAdmits(StallFreeScheduler):
    """Decodes and continues prefills, but never takes anyone from the queue."""

    def plan(self):
        decode = self.decodes()
        return Batch(decode=decode, prefill=self.continue_prefills(self.token_budget - len(decode)))


class OneAdmissionAStep(StallFreeScheduler):
    """Admits at most one request a step, leaving budget unused while others wait."""

    def plan(self):
        decode = self.decodes()
        prefill = self.continue_prefills(self.token_budget - len(decode))
        if not prefill:
            prefill = self.admit_within(self.token_budget - len(decode))[:1]
        return Batch(decode=decode, prefill=prefill)


class PlanWithoutMakeRoom(MyStallFreeScheduler):
    """The lesson's plan with every block left to luck: no make_room for decodes or chunks."""

    def plan(self):
        decode = self.in_state(State.DECODING)
        budget = self.token_budget - len(decode)
        prefill = []
        for req in self.in_state(State.PREFILLING):
            n = min(budget, req.prefill_left)
            if n > 0:
                prefill.append((req, n))
                budget -= n
        while budget > 0 and self.queue and self.free_slot() is not None:
            req = self.queue[0]
            if not self.fits(req, budget):
                break
            n = self.start(req, budget)
            self.take_slot(req)
            prefill.append((req, n))
            budget -= n
        return Batch(decode=decode, prefill=prefill)


class NotWritten(StallFreeScheduler):
    def plan(self):
        raise NotImplementedError("write plan")


@pytest.mark.parametrize("solution", [StallFreeScheduler, MyStallFreeScheduler])
def test_the_reference_and_the_lessons_piece_pass(solution):
    verdict = check.stallfree_planner(solution)
    assert verdict, verdict.message


def test_a_plan_without_make_room_is_rejected_in_the_small_pool():
    verdict = check.stallfree_planner(PlanWithoutMakeRoom)
    assert_rejected(
        verdict,
        "9 of 9",
        "the KV pool ran out (16 blocks): MemoryError",
        "self.make_room(req, 1) for each decode",
    )
    assert verdict.passed == 8


def test_prefill_before_the_decodes_is_rejected():
    assert_rejected(
        check.stallfree_planner(PrefillFirst),
        "1 of 9",
        "was decoding but got no decode row",
        "before any prefill",
    )


def test_a_plan_over_the_budget_is_rejected():
    assert_rejected(check.stallfree_planner(OverBudget), "1 of 9", "over the token budget of 16")


def test_a_planner_that_never_admits_is_reported_stuck_not_a_hang():
    assert_rejected(check.stallfree_planner(NeverAdmits), "1 of 9", "the engine got stuck")


def test_unused_budget_while_requests_wait_is_rejected():
    assert_rejected(
        check.stallfree_planner(OneAdmissionAStep),
        "1 of 9",
        "the stall-free rule gives",
        "admissions while budget and slots remain",
    )


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
