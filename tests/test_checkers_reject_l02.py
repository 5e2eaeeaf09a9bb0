"""Lesson 2's checkers reject known-wrong solutions and name the mistake (fake model, instant)."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

from batchlab.course import checks
from batchlab.core.request import State
from batchlab.core.scheduler import Batch, ContinuousScheduler, Scheduler
from learner_pieces import MyContinuousScheduler


def checker_quiet(checker: str, solution):
    """The verdict of ``check.<checker>(solution)``, without its printout."""
    with contextlib.redirect_stdout(io.StringIO()):
        return getattr(checks, checker)(solution)


class AdmitsWhileOneAwaits(MyContinuousScheduler):
    """Admits whenever nobody prefills, even while a prefilled request waits for a slot."""

    def admit(self):
        if self.queue and not self.in_state(State.PREFILLING):
            self.admit_next(math.inf)


class NeverAdmits(MyContinuousScheduler):
    """Forgets phase 2: the queue never moves, and the engine steps without running anything."""

    def admit(self):
        pass


class PlacesOnlyIntoAnEmptyBatch(MyContinuousScheduler):
    """Waits until every slot is free before placing: static batching in disguise."""

    def place(self):
        if all(slot is None for slot in self.slots):
            super().place()


class PlacesLastPrefilledFirst(MyContinuousScheduler):
    """Lets two requests await a slot (admits while one awaits) and places the newest first."""

    admit = AdmitsWhileOneAwaits.admit

    def place(self):
        for req in reversed(self.in_state(State.AWAITING_SLOT)):
            if self.free_slot() is None:
                break
            self.take_slot(req)
            req.set_state(State.DECODING, self.clock())


class AdmitsWithoutFits(MyContinuousScheduler):
    """Starts the next request whether or not the pool holds its KV memory."""

    def admit_next(self, max_tokens):
        req = self.policy.next_queued(self.queue)
        return req, self.start(req, min(max_tokens, self.chunk(req)))


class PlaceForgetsDecoding(MyContinuousScheduler):
    """Puts awaiting requests into slots but never sets them DECODING."""

    def place(self):
        for req in self.in_state(State.AWAITING_SLOT):
            if self.free_slot() is None:
                break
            self.take_slot(req)


class DecodesTheFirstSlotsOnly(MyContinuousScheduler):
    """Unfair to requests already decoding: only the first two slots get a row each step."""

    def decode(self):
        rows = [r for r in self.slots if r is not None][:2]
        if rows:
            yield Batch(decode=rows)


@pytest.mark.parametrize(
    "wrong, first_case, names",
    [
        (NeverAdmits, 2, "the engine got stuck"),
        (PlacesOnlyIntoAnEmptyBatch, 2, "place() must fill every free slot"),
        (AdmitsWithoutFits, 8, "the KV pool ran out (16 blocks): MemoryError: start(r"),
        (AdmitsWithoutFits, 8, "start a request (self.start) only if self.fits(req, n)"),
        (PlaceForgetsDecoding, 2, "its state was never set to DECODING"),
        (PlaceForgetsDecoding, 2, "req.set_state(State.DECODING, self.clock())"),
        (DecodesTheFirstSlotsOnly, 5, "holds a slot but made no token"),
    ],
)
def test_continuous_scheduler_rejects(wrong, first_case, names):
    verdict = checker_quiet("continuous_scheduler", wrong)
    assert not verdict and not verdict.not_written
    assert f"The first that does not:\n  case {first_case} of 13" in verdict.message, verdict.message
    assert names in verdict.message, verdict.message


@pytest.mark.parametrize(
    "design, says",
    [
        (AdmitsWhileOneAwaits, "the lesson's rule admits nobody while a prefilled request still waits"),
        (PlacesLastPrefilledFirst, "was admitted while"),
    ],
)
def test_another_admission_or_placement_rule_keeps_the_contract_and_is_named(design, says):
    """Admitting while a request awaits a slot, or placing the newest first, are rules of one's
    own: every request still gets its tokens, no slot idles. They pass, with where they differ."""
    verdict = checker_quiet("continuous_scheduler", design)
    assert verdict and verdict.differs and says in verdict.message, verdict.message


def test_continuous_scheduler_passes_the_lessons_piece():
    verdict = checker_quiet("continuous_scheduler", MyContinuousScheduler)
    assert verdict, verdict.message


def test_ours_passes_every_case_but_the_lineage():
    """Ours keeps every rule (the checker grades rules, not our exact schedule), but a piece
    that derives from it could pass by calling it."""
    verdict = checker_quiet("continuous_scheduler", ContinuousScheduler)
    assert verdict.passed == verdict.total - 1 and verdict.failed[0].startswith("derives from Scheduler")


def test_a_piece_on_the_base_that_only_calls_super_is_not_written():
    """Built on the learner's lesson-1 class (its finishing rules) and the base: super() plans nothing."""
    from learner_pieces import MyStaticScheduler

    class OnlySuper(MyStaticScheduler):
        rectangular = False

        def batches(self):
            yield from Scheduler.batches(self)

    verdict = checker_quiet("continuous_scheduler", OnlySuper)
    assert not verdict and verdict.not_written and "must write batches()" in verdict.message


def test_admitting_without_fits_is_caught_only_by_the_small_pools():
    verdict = checker_quiet("continuous_scheduler", AdmitsWithoutFits)
    assert verdict.failed and all(label.startswith("memory") for label in verdict.failed)


def test_two_awaiting_requests_are_named_on_the_trace():
    """Two requests can await a slot only if one was admitted while the other awaited: the
    invariants name that admission (where the rule first parts from the lesson's), on a whole trace."""
    from batchlab.course.checks._pieces import fake_workload, run_piece
    from batchlab.course.checks._core import Differs
    from batchlab.course.checks.lesson02 import continuous_invariants

    wl = fake_workload("req", [(5, o) for o in [9, 9, 4, 4, 4, 4]], 7)
    trace = run_piece(PlacesLastPrefilledFirst, wl, max_batch_size=2).trace
    problem = continuous_invariants(trace, 2)
    assert isinstance(problem, Differs) and "was admitted while" in problem and "awaited a slot" in problem, (
        problem
    )
    assert continuous_invariants(run_piece(ContinuousScheduler, wl, max_batch_size=2).trace, 2) is None


def test_continuous_scheduler_asks_for_a_class():
    verdict = checker_quiet("continuous_scheduler", object)
    assert not verdict and "must derive from Scheduler" in verdict.message


def test_continuous_steps_rejects_the_static_count():
    from batchlab.course.checks.lesson01 import static_step_count

    verdict = checker_quiet("continuous_steps", static_step_count)
    assert not verdict and "count for static batching" in verdict.message


def test_an_unwritten_piece_is_not_written_yet_not_a_failure():
    """The learner copy's placeholders raise NotImplementedError inside the engine: the
    verdict says "not written yet" (the whole-workload driver must not swallow it)."""

    class Unwritten(MyContinuousScheduler):
        def admit(self):
            raise NotImplementedError("admit is not written yet")

    verdict = checker_quiet("continuous_scheduler", Unwritten)
    assert not verdict and verdict.not_written
