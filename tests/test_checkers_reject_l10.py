"""Lesson 10's checkers reject known-wrong aging policies, one per clause, and name the mistake."""

from __future__ import annotations

import math

import pytest

from batchlab.core.policies import AgingPolicy, Policy
from batchlab.course import checks
from learner_pieces import MyAgingPolicy


class NoAging(MyAgingPolicy):  # strict priorities: waiting buys nothing
    def importance(self, req):
        return req.priority, req.arrival_s


class WrongSign(MyAgingPolicy):  # waiting makes a request LESS important
    def importance(self, req):
        return -req.arrival_s + self.age_s * req.priority, req.priority


class FixedAge(MyAgingPolicy):  # reads 10 s whatever age_s it was given
    def importance(self, req):
        return req.arrival_s + 10.0 * req.priority, req.priority


class OneLevelOnly(MyAgingPolicy):  # any less important class counts as one level
    def importance(self, req):
        return req.arrival_s + self.age_s * min(req.priority, 1), req.priority


class TieToTheWrongClass(MyAgingPolicy):  # an exact tie goes to the less important class
    def importance(self, req):
        return req.arrival_s + self.age_s * req.priority, -req.priority


class NewestAmongEquals(MyAgingPolicy):  # queue order reversed among equals
    def next_queued(self, queue):
        return min(reversed(queue), key=self.importance)


class PicksByClassOnly(MyAgingPolicy):  # importance ages, next_queued does not use it
    def next_queued(self, queue):
        return min(queue, key=lambda r: r.priority)


class ReturnsTheId(MyAgingPolicy):
    def next_queued(self, queue):
        return min(queue, key=self.importance).id


class AcceptsZero(MyAgingPolicy):
    def __init__(self, age_s=30.0):
        self.age_s = age_s


class NoDefault(MyAgingPolicy):
    def __init__(self, age_s):
        super().__init__(age_s)


class KeepsNoAge(MyAgingPolicy):
    def __init__(self, age_s=30.0):
        super().__init__(age_s)
        self.wait = self.__dict__.pop("age_s")

    def importance(self, req):
        return req.arrival_s + self.wait * req.priority, req.priority


def test_the_lessons_policy_passes():
    assert checks.aging_policy(MyAgingPolicy)


def test_ours_fails_only_the_lineage():
    verdict = checks.aging_policy(AgingPolicy)
    assert verdict.passed == verdict.total - 1 and verdict.failed[0].startswith("derives from Policy")


@pytest.mark.parametrize(
    "wrong, says",
    [
        (NoAging, "waited long enough to pass it"),
        (WrongSign, "the one that arrived first goes first"),
        (FixedAge, "every age_s = 3 s it waits"),
        (OneLevelOnly, "has not waited long enough"),
        (TieToTheWrongClass, "tie on arrival_s + age_s * priority"),
        (NewestAmongEquals, "queue order"),
        (PicksByClassOnly, "the one that arrived first goes first"),
        (ReturnsTheId, "not one of the queued requests"),
        (AcceptsZero, "age_s=0) was accepted"),
        (NoDefault, "give age_s a default"),
        (KeepsNoAge, "should age by 30 s a level"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_a_wrong_policy_is_refused_with_its_mistake_named(wrong, says):
    verdict = checks.aging_policy(wrong)
    assert not verdict and says in verdict.message, verdict.message


def test_the_simulated_rush_alone_catches_an_order_the_small_queues_miss():
    """A policy that ages right on every small queue but orders rows for growth (importance) apart
    from next_queued fails the ordering case; one that ages strictly in the run fails the rush."""

    class GrowsByClass(MyAgingPolicy):
        def importance(self, req):
            return req.priority, req.arrival_s

        def next_queued(self, queue):
            return min(queue, key=lambda r: (r.arrival_s + self.age_s * r.priority, r.priority))

    verdict = checks.aging_policy(GrowsByClass)
    assert not verdict and "importance orders rows" in "\n".join(verdict.failed)


def test_not_deriving_from_policy_is_named():
    class Alone:
        def __init__(self, age_s=30.0):
            self.age_s = age_s

    verdict = checks.aging_policy(Alone)
    assert not verdict and "must derive from Policy" in verdict.message


def test_overtaken_after_rejects_the_wrong_sign_and_the_missing_gap():
    assert checks.overtaken_after(lambda a, p, age, o: a + age * (p - o))
    sign = checks.overtaken_after(lambda a, p, age, o: a - age * (p - o))
    assert not sign and "the sign" in sign.message
    gap = checks.overtaken_after(lambda a, p, age, o: a + age if p != o else a)
    assert not gap and "count a level per priority step" in gap.message
    seconds = checks.overtaken_after(lambda a, p, age, o: a + (p - o))
    assert not seconds and "not one second" in seconds.message


def test_policy_base_is_still_the_only_base():
    assert issubclass(MyAgingPolicy, Policy) and not math.isnan(MyAgingPolicy().age_s)
