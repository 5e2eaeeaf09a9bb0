"""Lesson 9's checkers reject known-wrong solutions and name the mistake."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from batchlab.course import checks
from batchlab.core.policies import Admission, AdmissionBase, QueueFull
from batchlab.core.request import State


@dataclass(frozen=True)
class Door(AdmissionBase):
    """The lesson's door; the classes below differ in their shedding."""

    def check_room(self, queue_depth):
        if self.max_queue is not None and queue_depth() >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} waiting)")


@dataclass(frozen=True)
class RightAdmission(Door):
    def to_shed(self, queue, now):
        if self.max_wait_s is None:
            return []
        return [
            r
            for r in queue
            if r.state is State.QUEUED and not r.output_ids and now - r.arrival_s > self.max_wait_s
        ]


@dataclass(frozen=True)
class DropsPreempted(Door):
    def to_shed(self, queue, now):
        if self.max_wait_s is None:
            return []
        return [r for r in queue if now - r.arrival_s > self.max_wait_s]


@dataclass(frozen=True)
class ShedsOnTheDot(Door):
    def to_shed(self, queue, now):
        if self.max_wait_s is None:
            return []
        return [r for r in queue if not r.output_ids and now - r.arrival_s >= self.max_wait_s]


@dataclass(frozen=True)
class ReturnsIds(RightAdmission):
    def to_shed(self, queue, now):
        return [r.id for r in super().to_shed(queue, now)]


def test_the_lessons_policy_passes():
    assert checks.admission_policy(RightAdmission)


def test_ours_passes_every_case_but_the_lineage_and_super_alone_is_not_written():
    verdict = checks.admission_policy(Admission)
    assert verdict.passed == verdict.total - 1 and verdict.failed[0].startswith("derives from AdmissionBase")

    @dataclass(frozen=True)
    class OnlySuper(Door):
        def to_shed(self, queue, now):
            return super().to_shed(queue, now)

    verdict = checks.admission_policy(OnlySuper)
    assert not verdict and verdict.not_written and "must write to_shed" in verdict.message


def test_a_policy_that_sheds_preempted_requests_is_rejected():
    verdict = checks.admission_policy(DropsPreempted)
    assert not verdict and "a preempted request waits in the queue" in verdict.message
    assert any("preempted requests wait in the queue" in label for label in verdict.failed)


def test_a_policy_that_sheds_at_exactly_the_limit_keeps_the_contract_and_is_named():
    """Shedding at the limit instead of over it is another rule, not a broken one: nobody is
    served after waiting too long. It passes, and the verdict says where it parts from ours."""
    verdict = checks.admission_policy(ShedsOnTheDot)
    assert (
        verdict
        and verdict.differs
        and "the lesson's rule sheds only those that waited MORE" in verdict.message
    )


@dataclass(frozen=True)
class KeepsTheLate(Door):
    def to_shed(self, queue, now):  # sheds only those over twice the limit
        if self.max_wait_s is None:
            return []
        return [r for r in queue if not r.output_ids and now - r.arrival_s > 2 * self.max_wait_s]


def test_a_policy_that_serves_requests_past_the_limit_is_rejected():
    verdict = checks.admission_policy(KeepsTheLate)
    assert not verdict and "waited longer than max_wait_s (8.0 s): shed them" in verdict.message
    assert any("whole simulated overload" in label for label in verdict.failed)


def test_a_policy_that_returns_ids_breaks_the_engine_and_is_reported():
    verdict = checks.admission_policy(ReturnsIds)
    assert (
        not verdict
        and "ReturnsIds.to_shed returned a list holding 'a', which is not a queued" in verdict.message
    )


def test_mean_in_system_that_returns_w_is_rejected():
    def mean_stay(arrivals, departures):
        return sum(d - a for a, d in zip(arrivals, departures)) / len(arrivals)

    verdict = checks.mean_in_system(mean_stay)
    assert not verdict and "that is W" in verdict.message


def test_a_look_ahead_shed_that_ignores_the_prefill_is_rejected():
    def wait_only(queue, now, slo, speed):
        return [rid for rid, arrival, _ in queue if now - arrival > slo]

    verdict = checks.to_shed(wait_only)
    assert not verdict and "count the time its prefill" in verdict.message


@dataclass(frozen=True)
class DoorMistakes(RightAdmission):
    """The lesson's door with one mistake switched on."""

    mistake = ""  # a class attribute, not a field

    def check_room(self, queue_depth):
        bound = self.max_queue
        if self.mistake == "one too many":
            if bound is not None and queue_depth() > bound:
                raise QueueFull("full")
        elif self.mistake == "no None":
            if queue_depth() >= (bound or 0):
                raise QueueFull("full")
        elif self.mistake == "never refuses":
            return
        elif self.mistake == "another error":
            if bound is not None and queue_depth() >= bound:
                raise RuntimeError("full")
        else:
            super().check_room(queue_depth)


DOOR_MISTAKES = {  # mistake: what the verdict says
    "one too many": "one more would exceed it",
    "no None": "max_queue None means no bound",
    "never refuses": "one more would exceed it",
    "another error": "raised RuntimeError",
}


@pytest.mark.parametrize("mistake", DOOR_MISTAKES)
def test_a_wrong_door_is_rejected_and_named(mistake):
    wrong = type(f"Door_{mistake.replace(' ', '_')}", (DoorMistakes,), {"mistake": mistake})
    verdict = checks.admission_policy(wrong)
    assert not verdict and not verdict.not_written, verdict.message
    assert DOOR_MISTAKES[mistake] in verdict.message, verdict.message
    assert any(label.startswith("the door") for label in verdict.failed), verdict.message


def test_a_door_that_only_calls_super_is_not_written():
    @dataclass(frozen=True)
    class OnlySuper(RightAdmission):
        def check_room(self, queue_depth):
            return AdmissionBase.check_room(self, queue_depth)

    verdict = checks.admission_policy(OnlySuper)
    assert not verdict and verdict.not_written and "must write check_room" in verdict.message
