"""Lesson 5's checkers reject known-wrong solutions and name the mistake. The wrong planners
are subclasses of the library's ``StallFreeScheduler`` overriding ``plan()``, as the
learner's ``MyStallFreeScheduler`` does."""

from __future__ import annotations

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
import pytest

from batchlab import checks as check
from batchlab import course
from batchlab.batch import Batch
from batchlab.scheduler import StallFreeScheduler


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
        prefill += self.admit(self.token_budget - sum(n for _, n in prefill))
        left = self.token_budget - sum(n for _, n in prefill)
        return Batch(decode=self.decodes()[:max(left, 0)], prefill=prefill)


class OverBudget(StallFreeScheduler):
    """Forgets that the decodes use budget too: prefill gets the whole budget."""

    def plan(self):
        decode = self.decodes()
        prefill = self.continue_prefills(self.token_budget)
        prefill += self.admit(self.token_budget - sum(n for _, n in prefill))
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
            prefill = self.admit(self.token_budget - len(decode))[:1]
        return Batch(decode=decode, prefill=prefill)


class NotWritten(StallFreeScheduler):
    def plan(self):
        raise NotImplementedError("write plan")


def test_the_reference_passes():
    assert check.stallfree_planner(StallFreeScheduler)


def test_prefill_before_the_decodes_is_rejected():
    assert_rejected(check.stallfree_planner(PrefillFirst), "1 of 8",
                    "was decoding but got no decode row", "before any prefill")


def test_a_plan_over_the_budget_is_rejected():
    assert_rejected(check.stallfree_planner(OverBudget), "1 of 8", "over the token budget of 16")


def test_a_planner_that_never_admits_is_reported_stuck_not_a_hang():
    assert_rejected(check.stallfree_planner(NeverAdmits), "1 of 8", "the engine got stuck")


def test_unused_budget_while_requests_wait_is_rejected():
    assert_rejected(check.stallfree_planner(OneAdmissionAStep), "1 of 8",
                    "the stall-free rule gives", "admissions while budget and slots remain")


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
    assert_rejected(check.skipped_decodes(skips_counted_from_the_first_token), "1 of 4",
                    "are not skips")




def saving_against_the_chunk_alone(chunk_s, decode_s, fused_s):
    return 1 - fused_s / chunk_s


def test_a_saving_against_the_chunk_alone_is_rejected():
    assert_rejected(check.fused_saving(saving_against_the_chunk_alone), "1 of 4", "BOTH separate passes")
