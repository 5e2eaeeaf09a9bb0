"""Lesson 2's checkers reject known-wrong solutions and name the mistake (fake model, instant)."""

from __future__ import annotations

import contextlib
import io

import pytest

from batchlab import checks
from batchlab.request import State
from batchlab.scheduler import ContinuousScheduler


def checker_quiet(checker: str, solution):
    """The verdict of ``check.<checker>(solution)``, without its printout."""
    with contextlib.redirect_stdout(io.StringIO()):
        return getattr(checks, checker)(solution)


class AdmitsWhileOneAwaits(ContinuousScheduler):
    """Admits whenever nobody prefills, even while a prefilled request waits for a slot."""

    def admit(self):
        if self.prefilling is None and self.queue:
            req = self.policy.next_queued(self.queue)
            if self.fits(req, self.prefill_step):
                self.start(req, self.prefill_step)
                self.prefilling = req


class NeverAdmits(ContinuousScheduler):
    """Forgets phase 2: the queue never moves, and the engine steps without running anything."""

    def admit(self):
        pass


class PlacesOnlyIntoAnEmptyBatch(ContinuousScheduler):
    """Waits until every slot is free before placing: static batching in disguise."""

    def place(self):
        if all(slot is None for slot in self.slots):
            super().place()


class PlacesIntoTheHighestSlot(ContinuousScheduler):
    """Skips the order of the free slots: the waiting request takes the highest one."""

    def place(self):
        while self.awaiting and self.free_slot() is not None:
            req = self.awaiting.popleft()
            req.slot = max(i for i, r in enumerate(self.slots) if r is None)
            self.slots[req.slot] = req
            req.set_state(State.DECODING, self.clock())


class PlacesLastPrefilledFirst(ContinuousScheduler):
    """Lets two requests await a slot (admits while one awaits) and places the newest first."""

    admit = AdmitsWhileOneAwaits.admit

    def place(self):
        while self.awaiting and self.free_slot() is not None:
            req = self.awaiting.pop()
            self.take_slot(req)
            req.set_state(State.DECODING, self.clock())


@pytest.mark.parametrize("wrong, names", [
    (AdmitsWhileOneAwaits, "admit nobody while a prefilled request still waits for a slot"),
    (NeverAdmits, "the engine got stuck"),
    (PlacesOnlyIntoAnEmptyBatch, "place() must fill every free slot"),
    (PlacesIntoTheHighestSlot, "takes the LOWEST free slot"),
])
def test_continuous_scheduler_rejects(wrong, names):
    verdict = checker_quiet("continuous_scheduler", wrong)
    assert not verdict and not verdict.not_written
    assert names in verdict.message, verdict.message


def test_two_awaiting_requests_are_caught_on_the_trace():
    """Two requests can await a slot only if one was admitted while the other awaited: the
    invariants name that admission (the first rule broken), on a whole trace."""
    from batchlab.checks.lesson01 import fake_workload, run_whole
    from batchlab.checks.lesson02 import continuous_invariants
    from batchlab.fake import FakeModel
    wl = fake_workload("req", [9, 9, 4, 4, 4, 4], [5] * 6, 7)
    run = run_whole(PlacesLastPrefilledFirst, 2, wl, FakeModel())
    problem = continuous_invariants(run.trace, 2)
    assert problem and "was admitted while" in problem and "awaited a slot" in problem, problem
    assert continuous_invariants(run_whole(ContinuousScheduler, 2, wl, FakeModel()).trace, 2) is None


def test_continuous_scheduler_asks_for_a_class():
    verdict = checker_quiet("continuous_scheduler", object)
    assert not verdict and "subclass of ContinuousScheduler" in verdict.message


def test_continuous_steps_rejects_the_static_count():
    from batchlab.checks.lesson01 import static_step_count
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
