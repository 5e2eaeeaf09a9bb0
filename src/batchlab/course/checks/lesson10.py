"""Checkers for lesson 10 (priorities and the finish line): the learner's aging policy."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from ...core.policies import AgingPolicy, Policy, PriorityPolicy
from ..guard import kind_of
from ._core import Case, Verdict, WrongType, mistakes, number_compare, run_cases, show, table
from ._lineage import ancestry_problem
from ._pieces import piece_case

__all__ = ["aging_policy", "overtaken_after", "starvation_mix"]

AGE = 10.0
RULE = "the smallest arrival_s + age_s * priority goes first; on a tie the lower priority, then queue order"


def _req(rid, priority, arrival_s):
    return SimpleNamespace(id=rid, priority=priority, arrival_s=arrival_s)


def _picked(policy, queue):
    """``policy.next_queued(queue)``'s id, refused with words unless one of the queued requests."""
    got = policy.next_queued(list(queue))
    if not any(got is r for r in queue):
        where = f"{type(policy).__name__}.next_queued"
        raise WrongType(f"{where} returned {show(got)} ({kind_of(got)}), not one of the queued requests")
    return got.id


def _made(cls, age_s):
    policy = cls(age_s=age_s)
    if getattr(policy, "age_s", None) != age_s:
        raise WrongType(f"{cls.__name__}(age_s={age_s}) should keep it as self.age_s")
    return policy


def _pick_case(label, *queue, age_s=AGE):
    queue = [_req(*row) for row in queue]
    by_id = {r.id: r for r in queue}

    def compare(got, want):
        if got == want:
            return None
        picked, right = by_id[got], by_id[want]
        key = {r.id: r.arrival_s + age_s * r.priority for r in queue}
        if key[got] == key[want] and picked.priority != right.priority:
            return (
                f"{got} and {want} tie on arrival_s + age_s * priority: the more important class goes first"
            )
        if picked.priority < right.priority:
            return (
                f"{got} is more important by class, but {want} waited long enough to pass it: "
                f"it gains one level every age_s = {age_s:g} s it waits"
            )
        if picked.priority > right.priority:
            return f"{got} has not waited long enough (age_s = {age_s:g} s a level) to pass {want}"
        if picked.arrival_s > right.arrival_s:
            return f"{got} and {want} have the same priority: the one that arrived first goes first"
        return "on a full tie keep the queue order (a preempted request waits at the front)"

    return Case(
        label,
        lambda cls: _picked(_made(cls, age_s), queue),
        _picked(AgingPolicy(age_s), queue),
        compare,
        RULE,
    )


def _order_case(label, *rows):
    """``sorted(running, key=policy.importance)``: the order ``grow`` serves rows in (and victims follow)."""
    running = [_req(*row) for row in rows]

    def order(policy):
        return [r.id for r in sorted(running, key=policy.importance)]

    def compare(got, want):
        return (
            None
            if got == want
            else f"importance(req) should order requests as next_queued picks them: {RULE}"
        )

    return Case(label, lambda cls: order(_made(cls, AGE)), order(AgingPolicy(AGE)), compare, RULE)


def _refuses(cls) -> str | None:
    try:
        policy = cls()
    except Exception as e:
        return f"{cls.__name__}() raised {type(e).__name__}: {e}: give age_s a default (30 s), a server makes it so"
    if getattr(policy, "age_s", None) != AgingPolicy().age_s:
        return f"{cls.__name__}() should age by 30 s a level, as ours (self.age_s = {getattr(policy, 'age_s', None)!r})"
    for bad in (0, -5.0, math.nan, math.inf, True, "10"):
        try:
            cls(age_s=bad)
        except ValueError:
            continue
        except Exception as e:
            return f"{cls.__name__}(age_s={bad!r}) raised {type(e).__name__}, not ValueError"
        return (
            f"{cls.__name__}(age_s={bad!r}) was accepted: age_s must be a number of seconds > 0 (ValueError)"
        )
    return None


def starvation_mix(seed: int = 0, chat: int = 120, batch: int = 12, rho: float = 1.1):
    """A chat rush above capacity (priority 0) with batch work sprinkled through it (priority 1), for
    ``make_sim_engine("stallfree", max_batch_size=16, token_budget=128)``: (workload, priorities).
    Under strict priorities the batch requests wait for the rush to end; with aging they do not."""
    from ...measurement.workloads import merge, synthetic_workload

    rate = 1.77 * rho  # the chat shape's service rate on this engine is about 1.77 requests/s
    talk = synthetic_workload(chat, rate=rate, seed=seed, prompt_median=64, output_median=32, prefix="chat")
    end = max(r.arrival_s for r in talk.requests)
    work = synthetic_workload(
        batch, rate=batch / end, seed=seed + 1, prompt_median=256, output_median=128, prefix="batch"
    )
    mix = merge(talk, work)
    return mix, {r.id: (0 if r.id.startswith("chat") else 1) for r in mix}


def _run_mix(policy):
    from ...measurement.simulator import make_sim_engine, simulate

    mix, priorities = starvation_mix()
    trace = simulate(
        make_sim_engine("stallfree", policy=policy, max_batch_size=16, token_budget=128), mix, priorities
    )
    return {rid: r.first_token_s for rid, r in trace.requests.items()}


def _whole_run(cls) -> str | None:
    want, got = _run_mix(AgingPolicy(AGE)), _run_mix(_made(cls, AGE))
    strict = _run_mix(PriorityPolicy())
    if strict == want:
        raise AssertionError("checker case 'rush': aging made no difference to strict priorities")
    wrong = [rid for rid in want if got.get(rid) != want[rid]]
    if not wrong:
        return None
    if got == strict:
        return "every request started as under strict priorities: nothing aged (use arrival_s + age_s * priority)"
    first = min(wrong, key=lambda rid: want[rid])
    return (
        f"{len(wrong)} requests got their first token at another time than with ours, first {first}: "
        f"{got.get(first)} s, not {want[first]:.2f} s"
    )


def aging_policy(cls: Any) -> Verdict:
    """Check ``MyAgingPolicy(age_s)``: ``next_queued(queue)`` and ``importance(req)`` with aging."""
    cases = [
        piece_case(
            "derives from Policy, through your own classes (not from our PriorityPolicy)",
            lambda c: ancestry_problem(Policy, (PriorityPolicy,), c),
        ),
        piece_case("age_s: 30 s by default, a number > 0 or ValueError", _refuses),
        _pick_case("all priority 0: the first to arrive", ("b", 0, 3.0), ("a", 0, 1.0), ("c", 0, 2.0)),
        _pick_case(
            "a batch request (1) that waited over age_s beats a chat newcomer (0)",
            ("chat", 0, 20.0),
            ("batch", 1, 5.0),
        ),
        _pick_case(
            "a batch request that waited less than age_s still waits", ("chat", 0, 20.0), ("batch", 1, 12.0)
        ),
        _pick_case("priority 2 needs two levels of waiting", ("p2", 2, 0.0), ("p0", 0, 15.0), ("p1", 1, 8.0)),
        _pick_case(
            "an exact tie (5 + 10 x 1 = 15 + 0): the more important class", ("b", 1, 5.0), ("c", 0, 15.0)
        ),
        _pick_case("equal in everything: queue order", ("front", 1, 4.0), ("next", 1, 4.0), ("x", 2, 4.0)),
        _pick_case("age_s is yours to read: 3 s a level", ("chat", 0, 10.0), ("batch", 1, 6.0), age_s=3.0),
        _pick_case("a negative priority (more important than 0)", ("vip", -1, 30.0), ("old", 0, 19.0)),
        _order_case(
            "importance orders rows as next_queued picks",
            ("a", 0, 9.0),
            ("b", 1, 1.0),
            ("c", 0, 20.0),
            ("d", 2, 0.5),
            ("e", 1, 1.0),
        ),
        piece_case(
            "a chat rush over capacity with batch work in it, simulated: every first token as with ours",
            _whole_run,
        ),
    ]
    return run_cases("aging_policy", cls, cases)


def overtaken_after(fn: Any) -> Verdict:
    """Check ``fn(arrival_s, priority, age_s, other_priority)``: the arrival time from which requests of
    ``other_priority`` queue behind one of ``priority`` that arrived at ``arrival_s``."""
    rows = [
        ("the same class: everyone who arrives after it", 40.0, 0, 30.0, 0),
        ("batch (1) against chat (0), age_s 30 s", 40.0, 1, 30.0, 0),
        ("two levels apart, age_s 10 s", 5.0, 2, 10.0, 0),
        ("a chat request (0) against batch (1): even older batch requests queue behind it", 40.0, 0, 30.0, 1),
    ]

    def right(arrival, priority, age, other):
        return arrival + age * (priority - other)

    def judge(arrival, priority, age, other):
        return number_compare(
            mistakes(
                (arrival + age, "count a level per priority step: age_s * (priority - other_priority)")
                if priority - other not in (0, 1)
                else (None, ""),
                (
                    arrival - age * (priority - other),
                    "the sign: a less important request must WAIT to be passed over",
                ),
                (arrival + priority - other, "aging is age_s seconds a level, not one second"),
            )
        )

    hint = "arrival_s + age_s * priority is the order: solve arrival_s + age_s * priority = t + age_s * other_priority"
    return table("overtaken_after", fn, rows, right, judge, hint)
