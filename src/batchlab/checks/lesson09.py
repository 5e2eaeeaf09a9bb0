"""Checkers for lesson 9 (policies and overload).

* ``mean_in_system(fn)``: ``fn(arrivals, departures) -> L``, the time-average number of
  requests in the system from time 0 to the last departure (Little's law: L = λ W);
* ``to_shed(fn)``: ``fn(queue, now, ttft_slo_s, prefill_tokens_per_s) -> [ids]``, the
  queued requests that can no longer meet their time-to-first-token objective;
* ``pick_next(fn)``: ``fn(queue) -> id``, which queued request a priority scheduler
  admits next, compared with the engine's own ``PriorityPolicy``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..policies import PriorityPolicy
from ._core import Case, Verdict, close, number_compare, run_cases

__all__ = ["mean_in_system", "to_shed", "pick_next"]


# ---------------------------------------------------------------------------------------
# Exercise 1: L from a trace, and Little's law.

def _littles_l(arrivals: list[float], departures: list[float]) -> float:
    """L = λ W over [0, last departure]: n / T requests per second times the mean stay."""
    horizon = max(departures)
    return sum(d - a for a, d in zip(arrivals, departures)) / horizon


def mean_in_system(fn: Any) -> Verdict:
    """Check ``fn(arrivals, departures)``: the average over time, from 0 to the last
    departure, of how many requests are in the system (arrived, not yet departed)."""

    def compare_for(arrivals, departures):
        horizon = max(departures)
        stays = [d - a for a, d in zip(arrivals, departures)]

        def diagnose(got, expected):
            if close(got, sum(stays) / len(stays)):
                return ("that is W, the mean time one request spends in the system; L is how "
                        "many are in it on average, L = λ W with λ = n / (last departure)")
            if close(got, len(stays) / horizon):
                return "that is λ, the arrival rate; L = λ W"
            return ""
        return number_compare(diagnose)

    rows = [
        ("one request, in the system from 0 s to 2 s (so L = 1)", [0.0], [2.0]),
        ("two requests, one after the other: 0-1 s and 1-2 s", [0.0, 1.0], [1.0, 2.0]),
        ("two requests overlapping: 0-3 s and 1-3 s", [0.0, 1.0], [3.0, 3.0]),
        ("an idle gap: 0-1 s, then nobody until 3 s, then 3-4 s", [0.0, 3.0], [1.0, 4.0]),
        ("five requests queueing behind each other (arrive together at 0, leave 1 s apart)",
         [0.0] * 5, [1.0, 2.0, 3.0, 4.0, 5.0]),
    ]
    cases = [Case(label, lambda f, a=a, d=d: f(list(a), list(d)), _littles_l(a, d),
                  compare_for(a, d),
                  hint="add up, over all requests, the time each spends in the system "
                       "(departure - arrival), and divide by the length of the window")
             for label, a, d in rows]
    return run_cases("mean_in_system", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 2: a shedding policy that sees the future a little.

def _to_shed(queue, now, slo, speed) -> list[str]:
    return [rid for rid, arrival, prompt_len in queue if (now - arrival) + prompt_len / speed > slo]


def to_shed(fn: Any) -> Verdict:
    """Check ``fn(queue, now, ttft_slo_s, prefill_tokens_per_s)``: queue is a list of
    ``(request id, arrival_s, prompt_len)`` in queue order; return, in that order, the
    ids whose first token cannot come within ``ttft_slo_s`` of arrival even if their
    prefill started right now."""

    def compare(got, expected):
        if not isinstance(got, (list, tuple)):
            return f"return a list of request ids, not a {type(got).__name__}"
        got = list(got)
        if got == expected:
            return None
        if sorted(got) == sorted(expected):
            return "the right ids, but keep them in queue order"
        missing = [r for r in expected if r not in got]
        extra = [r for r in got if r not in expected]
        if missing:
            return (f"{missing} cannot make it but you keep them: count the time its prefill "
                    "will take (prompt_len / prefill_tokens_per_s) on top of the wait so far")
        return f"{extra} can still make it; shed only those that would be late (> the SLO)"

    speed = 100.0  # prompt tokens per second
    rows = [
        ("an empty queue", [], 10.0),
        ("nobody late: waits of 1 and 2 s, prefills of 0.5 s, SLO 5 s",
         [("a", 9.0, 50), ("b", 8.0, 50)], 10.0),
        ("one has waited 6 s already (SLO 5 s)", [("a", 4.0, 50), ("b", 9.5, 50)], 10.0),
        ("a long prompt that just arrived: 800 tokens take 8 s to prefill (SLO 5 s)",
         [("short", 9.0, 40), ("long", 10.0, 800)], 10.0),
        ("exactly on time: waited 4 s + 1 s of prefill = the 5 s SLO (keep it)",
         [("edge", 6.0, 100)], 10.0),
        ("several late ones, in queue order", [("x", 1.0, 10), ("y", 9.9, 10), ("z", 2.0, 10),
                                               ("w", 3.0, 900)], 10.0),
    ]
    cases = [Case(label, lambda f, q=q, now=now: f(list(q), now, 5.0, speed),
                  _to_shed(q, now, 5.0, speed), compare,
                  hint="late if (now - arrival) + prompt_len / prefill_tokens_per_s > ttft_slo_s")
             for label, q, now in rows]
    return run_cases("to_shed", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 3: the priority-aware pick, against the engine's own policy.

def _engine_pick(queue) -> str:
    reqs = [SimpleNamespace(id=rid, priority=p) for rid, p in queue]
    return PriorityPolicy().next_queued(reqs).id


def pick_next(fn: Any) -> Verdict:
    """Check ``fn(queue)``: queue is a list of ``(request id, priority)`` in arrival
    order (lower priority number = more important); return the id to admit next."""

    def compare(got, expected):
        if got == expected:
            return None
        return ("lowest priority number first; among equals, the one that came first "
                "(earliest in the list)")

    rows = [
        ("a single request", [("a", 0)]),
        ("everyone the same priority: first come, first served", [("a", 1), ("b", 1), ("c", 1)]),
        ("an interactive request (0) behind batch work (1)", [("batch-1", 1), ("batch-2", 1),
                                                               ("chat", 0)]),
        ("two interactive ones behind batch work: the earlier of them",
         [("batch", 1), ("chat-1", 0), ("chat-2", 0)]),
        ("negative numbers are more important still", [("a", 0), ("b", -1), ("c", 2)]),
    ]
    cases = [Case(label, lambda f, q=q: f(list(q)), _engine_pick(q), compare,
                  hint="min over the queue by priority; min keeps the first of equal keys")
             for label, q in rows]
    return run_cases("pick_next", fn, cases)
