"""Lesson 2's checkers reject known-wrong solutions and name the mistake (fake model, instant)."""

from __future__ import annotations

import contextlib
import io

import pytest

from batchlab.course import checks
from batchlab.core.request import State
from batchlab.core.scheduler import ContinuousScheduler
from learner_pieces import MyContinuousScheduler


def checker_quiet(checker: str, solution):
    """The verdict of ``check.<checker>(solution)``, without its printout."""
    with contextlib.redirect_stdout(io.StringIO()):
        return getattr(checks, checker)(solution)


class AdmitsWhileOneAwaits(MyContinuousScheduler):
    """Admits whenever nobody prefills, even while a prefilled request waits for a slot."""

    def admit(self):
        if self.queue and not self.in_state(State.PREFILLING):
            req = self.policy.next_queued(self.queue)
            if self.fits(req, self.prefill_step):
                self.start(req, self.prefill_step)


class NeverAdmits(MyContinuousScheduler):
    """Forgets phase 2: the queue never moves, and the engine steps without running anything."""

    def admit(self):
        pass


class PlacesOnlyIntoAnEmptyBatch(MyContinuousScheduler):
    """Waits until every slot is free before placing: static batching in disguise."""

    def place(self):
        if all(slot is None for slot in self.slots):
            super().place()


class PlacesIntoTheHighestSlot(MyContinuousScheduler):
    """Skips the order of the free slots: the waiting request takes the highest one."""

    def place(self):
        for req in self.in_state(State.AWAITING_SLOT):
            if self.free_slot() is None:
                break
            req.slot = max(i for i, r in enumerate(self.slots) if r is None)
            self.slots[req.slot] = req
            req.set_state(State.DECODING, self.clock())


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
    """Starts the next request whether or not the free blocks hold its prompt."""

    def admit(self):
        if self.queue and not self.in_state(State.PREFILLING, State.AWAITING_SLOT):
            self.start(self.policy.next_queued(self.queue), self.prefill_step)


class PlaceForgetsDecoding(MyContinuousScheduler):
    """Puts awaiting requests into slots but never sets them DECODING."""

    def place(self):
        for req in self.in_state(State.AWAITING_SLOT):
            if self.free_slot() is None:
                break
            self.take_slot(req)


@pytest.mark.parametrize(
    "wrong, first_case, names",
    [
        (AdmitsWhileOneAwaits, 1, "admit nobody while a prefilled request still waits for a slot"),
        (NeverAdmits, 1, "the engine got stuck"),
        (PlacesOnlyIntoAnEmptyBatch, 1, "place() must fill every free slot"),
        (PlacesIntoTheHighestSlot, 1, "takes the LOWEST free slot"),
        (PlacesLastPrefilledFirst, 1, "was admitted while"),
        (AdmitsWithoutFits, 7, "the KV pool ran out (16 blocks): MemoryError"),
        (AdmitsWithoutFits, 7, "admit only a request that self.fits(req, self.prefill_step)"),
        (PlaceForgetsDecoding, 1, "its state was never set to DECODING"),
        (PlaceForgetsDecoding, 1, "req.set_state(State.DECODING, self.clock())"),
    ],
)
def test_continuous_scheduler_rejects(wrong, first_case, names):
    verdict = checker_quiet("continuous_scheduler", wrong)
    assert not verdict and not verdict.not_written
    assert f"The first that does not:\n  case {first_case} of 8" in verdict.message, verdict.message
    assert names in verdict.message, verdict.message


@pytest.mark.parametrize("solution", [ContinuousScheduler, MyContinuousScheduler])
def test_continuous_scheduler_passes_the_reference_and_the_lessons_piece(solution):
    verdict = checker_quiet("continuous_scheduler", solution)
    assert verdict, verdict.message


def test_admitting_without_fits_is_caught_only_by_the_small_pools():
    verdict = checker_quiet("continuous_scheduler", AdmitsWithoutFits)
    assert verdict.failed and all(label.startswith("memory") for label in verdict.failed)


def test_two_awaiting_requests_are_caught_on_the_trace():
    """Two requests can await a slot only if one was admitted while the other awaited: the
    invariants name that admission (the first rule broken), on a whole trace."""
    from batchlab.course.checks._pieces import fake_workload, run_piece
    from batchlab.course.checks.lesson02 import continuous_invariants

    wl = fake_workload("req", [(5, o) for o in [9, 9, 4, 4, 4, 4]], 7)
    trace = run_piece(PlacesLastPrefilledFirst, wl, max_batch_size=2).trace
    problem = continuous_invariants(trace, 2)
    assert problem and "was admitted while" in problem and "awaited a slot" in problem, problem
    assert continuous_invariants(run_piece(ContinuousScheduler, wl, max_batch_size=2).trace, 2) is None


def test_continuous_scheduler_asks_for_a_class():
    verdict = checker_quiet("continuous_scheduler", object)
    assert not verdict and "subclass of ContinuousScheduler" in verdict.message


def test_continuous_steps_rejects_the_static_count():
    from batchlab.course.checks.lesson01 import static_step_count

    verdict = checker_quiet("continuous_steps", static_step_count)
    assert not verdict and "count for static batching" in verdict.message


def test_an_unwritten_piece_is_not_written_yet_not_a_failure():
    """The learner copy's placeholders raise NotImplementedError inside the engine: the
    verdict says "not written yet" (the whole-workload driver must not swallow it)."""

    class Unwritten(ContinuousScheduler):
        def admit(self):
            raise NotImplementedError("admit is not written yet")

    verdict = checker_quiet("continuous_scheduler", Unwritten)
    assert not verdict and verdict.not_written
