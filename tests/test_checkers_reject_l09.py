"""Lesson 9's checkers reject known-wrong solutions and name the mistake."""

from __future__ import annotations

from dataclasses import dataclass

from batchlab.course import checks
from batchlab.core.policies import Admission, AdmissionBase
from batchlab.core.request import State


@dataclass(frozen=True)
class RightAdmission(AdmissionBase):
    def to_shed(self, queue, now):
        if self.max_wait_s is None:
            return []
        return [
            r
            for r in queue
            if r.state is State.QUEUED and not r.output_ids and now - r.arrival_s > self.max_wait_s
        ]


@dataclass(frozen=True)
class DropsPreempted(AdmissionBase):
    def to_shed(self, queue, now):
        if self.max_wait_s is None:
            return []
        return [r for r in queue if now - r.arrival_s > self.max_wait_s]


@dataclass(frozen=True)
class ShedsOnTheDot(AdmissionBase):
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
    class OnlySuper(AdmissionBase):
        def to_shed(self, queue, now):
            return super().to_shed(queue, now)

    verdict = checks.admission_policy(OnlySuper)
    assert not verdict and verdict.not_written and "must write to_shed" in verdict.message


def test_a_policy_that_sheds_preempted_requests_is_rejected():
    verdict = checks.admission_policy(DropsPreempted)
    assert not verdict and "a preempted request waits in the queue" in verdict.message
    assert any("preempted requests wait in the queue" in label for label in verdict.failed)


def test_a_policy_that_sheds_at_exactly_the_limit_is_rejected():
    verdict = checks.admission_policy(ShedsOnTheDot)
    assert not verdict and "shed only those that waited MORE" in verdict.message


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
