"""Checkers for lesson 9 (policies and overload)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ...core.policies import Admission, AdmissionBase, QueueFull
from ...core.request import State
from ..guard import kind_of
from ._core import Differs, Case, Verdict, WrongType, mistakes, number_compare, run_cases, show, table
from ._lineage import lineage_case
from ._pieces import piece_case

__all__ = ["mean_in_system", "to_shed", "admission_policy"]


def mean_in_system(fn: Any) -> Verdict:
    """Check ``fn(arrivals, departures)``: the time-average number of requests in the system."""
    leave = [1.0, 2.0, 3.0, 4.0, 5.0]
    rows = [
        ("one request, in the system from 0 s to 2 s (so L = 1)", [0.0], [2.0]),
        ("two requests, one after the other: 0-1 s and 1-2 s", [0.0, 1.0], [1.0, 2.0]),
        ("two requests overlapping: 0-3 s and 1-3 s", [0.0, 1.0], [3.0, 3.0]),
        ("an idle gap: 0-1 s, then nobody until 3 s, then 3-4 s", [0.0, 3.0], [1.0, 4.0]),
        ("five requests queueing (arrive together at 0, leave 1 s apart)", [0.0] * 5, leave),
    ]

    def stays(a, d):
        return sum(y - x for x, y in zip(a, d))

    def judge(a, d):
        w = (stays(a, d) / len(a), "that is W, the mean time one request spends in the system; L = λ W")
        return number_compare(mistakes(w, (len(a) / max(d), "that is λ, the arrival rate; L = λ W")))

    hint = "add up the time each request spends in the system and divide by the length of the window"
    return table("mean_in_system", fn, rows, lambda a, d: stays(a, d) / max(d), judge, hint)


LONG, HUGE = ("long", 10.0, 800), ("w", 3.0, 900)  # 8 s and 9 s of prefill


def to_shed(fn: Any) -> Verdict:
    """Check ``fn(queue, now, ttft_slo_s, prefill_tokens_per_s)``: the ids whose TTFT will miss the SLO."""

    def compare(got, expected):
        if not isinstance(got, (list, tuple)):
            return f"return a list of request ids, not {kind_of(got)}"
        if list(got) == expected:
            return None
        if sorted(got) == sorted(expected):
            return "the right ids, but keep them in queue order"
        missing = [r for r in expected if r not in got]
        if missing:
            return f"{missing} cannot make it but you keep them: count the time its prefill will take too"
        return f"{[r for r in got if r not in expected]} can still make it; shed only the late ones"

    rows = [
        ("an empty queue", []),
        ("nobody late: waits of 1 and 2 s, prefills of 0.5 s, SLO 5 s", [("a", 9.0, 50), ("b", 8.0, 50)]),
        ("one has waited 6 s already (SLO 5 s)", [("a", 4.0, 50), ("b", 9.5, 50)]),
        ("a long prompt that just arrived: 800 tokens take 8 s to prefill", [("short", 9.0, 40), LONG]),
        ("exactly on time: waited 4 s + 1 s of prefill = the 5 s SLO (keep it)", [("edge", 6.0, 100)]),
        ("several late ones, in queue order", [("x", 1.0, 10), ("y", 9.9, 10), ("z", 2.0, 10), HUGE]),
    ]

    def late(q, now, slo, speed):
        return [rid for rid, t, n in q if (now - t) + n / speed > slo]

    hint = "late if (now - arrival) + prompt_len / prefill_tokens_per_s > ttft_slo_s"
    rows = [(label, q, 10.0, 5.0, 100.0) for label, q in rows]
    return table("to_shed", fn, rows, late, lambda *a: compare, hint)


def _queued(rid, arrival_s, preempted=False, state=State.QUEUED):  # a preempted one has begun its answer
    output_ids = [5, 6] if preempted else []
    return SimpleNamespace(id=rid, arrival_s=arrival_s, state=state, prompt_len=64, output_ids=output_ids)


def _shed_run(admission, name):
    """A simulated overload ("tight": a small KV pool): the finish reasons, preemptions, the requests
    preempted after their first token, those started after waiting over 8 s."""
    from ...measurement.simulator import make_sim_engine, simulate
    from ...measurement.workloads import synthetic_workload

    tight = name == "tight"
    options = dict(max_batch_size=8, token_budget=64)
    if tight:
        options.update(num_kv_blocks=48, kv_block_size=16)
    ranges = dict(prompt_range=(16, 256), output_range=(4, 256))
    workload = synthetic_workload(160, rate=1.2, seed=11 if tight else 7, **ranges)
    trace = simulate(make_sim_engine("stallfree", admission=admission, **options), workload)
    reasons = {rid: r.finish_reason for rid, r in trace.requests.items()}
    preempted = {rid for rid, r in trace.requests.items() if r.preemptions and r.first_token_s is not None}
    return reasons, sum(len(s.preempted) for s in trace.steps), preempted, _served_late(trace, 8.0)


def _served_late(trace, max_wait_s: float) -> list[str]:
    """Requests that started after waiting longer than ``max_wait_s`` plus one step (the shedding
    policy is asked once a step): what a shedding rule must never let happen."""
    slack = max((s.end_s - s.start_s for s in trace.steps), default=0.0)
    late = []
    for rid, r in trace.requests.items():
        started = next((t for t, state in r.state_times if state != "queued"), None)
        if r.finish_reason != "shed" and started is not None and started - r.arrival_s > max_wait_s + slack:
            late.append(rid)
    return late


def _shed(admission, queue, now, ask=None):
    """``admission.to_shed(queue, now)`` (or ``ask``'s), refused with words (``WrongType``) unless a
    list of queued requests."""
    got = (ask or admission.to_shed)(queue, now)
    where = f"{type(admission).__name__}.to_shed"
    if not isinstance(got, (list, tuple)):
        raise WrongType(f"{where} returned {show(got)} ({kind_of(got)}), not a list of requests")
    odd = next((r for r in got if not any(r is q for q in queue)), None)
    if odd is not None:
        why = "return the requests themselves (items of the queue), e.g. [req for req in queue if ...]"
        raise WrongType(f"{where} returned a list holding {show(odd)}, which is not a queued request: {why}")
    return got


def _checked(admission):
    """``admission``, its ``to_shed`` answers checked as the engine asks (``_shed``)."""
    ask = admission.to_shed
    object.__setattr__(admission, "to_shed", lambda queue, now: _shed(admission, queue, now, ask))  # frozen
    return admission


SHED = "shed if it never started and now - arrival_s > max_wait_s"
DOOR = "raise QueueFull when queue_depth() >= max_queue; max_queue None: every request gets in"


def _door(cls, max_queue, depth) -> str:
    """What ``cls(max_queue=...).check_room`` does with ``depth`` requests waiting."""
    try:
        cls(max_queue=max_queue).check_room(lambda: depth)
    except QueueFull:
        return "full"
    return "room"


def _door_case(label, max_queue, depth) -> Case:
    def compare(got, want):
        if got == want:
            return None
        if max_queue is None:
            return "max_queue None means no bound: let every request in"
        if want == "full" and depth == max_queue:
            return f"{depth} already wait and the bound is {max_queue}: one more would exceed it"
        return f"{depth} wait, fewer than max_queue ({max_queue}): there is room" if want == "room" else ""

    return Case(
        label, lambda f: _door(f, max_queue, depth), _door(Admission, max_queue, depth), compare, DOOR
    )


LATE = [("x", 0.5), ("y", 9.0), ("z", 1.0), ("w", 1.5)]


def _shed_case(label, queue, now, max_wait_s) -> Case:
    """A case of ``to_shed`` on ``queue`` at ``now``: the ids the learner's policy sheds, against Admission's."""

    def call(f):  # the ids shed; Admission answers
        return [r.id for r in _shed(f(max_wait_s=max_wait_s), list(queue), now)]

    def compare(got, want):
        """Shedding a started or preempted request, shedding with no limit, or keeping one
        past the limit fails; shedding earlier, or listing in another order, differs."""
        if got == want:
            return None
        extra = [r for r in got if r not in want]
        kept = [r for r in queue if r.id in extra]  # the requests shed that the lesson's rule keeps
        if any(r.output_ids for r in kept):
            return f"{extra} was preempted (it has output_ids): a preempted request waits in the queue"
        if max_wait_s is None and got:
            return "max_wait_s None means: shed nothing"
        if missing := [r for r in want if r not in got]:
            return f"{missing} waited longer than max_wait_s ({max_wait_s} s): shed them"
        if not extra:
            return Differs("the right requests in another order; the lesson's rule keeps queue order")
        if any(now - r.arrival_s == max_wait_s for r in kept):
            return Differs(
                f"{extra} waited exactly max_wait_s: the lesson's rule sheds only those that waited MORE"
            )
        return Differs(
            f"{extra} waited no longer than max_wait_s ({max_wait_s} s): the lesson's rule keeps them"
        )

    return Case(label, call, call(Admission), compare, SHED)


def _whole_run_case(name, label) -> Case:
    """A whole simulated overload (``_shed_run``) on the learner's policy, judged by the contract."""
    want, preemptions, _, _ = _shed_run(Admission(max_wait_s=8.0), name)
    if name == "tight" and not preemptions:
        raise AssertionError("checker case 'tight': the reference run had no preemption")

    def judge(f):
        reasons, _, preempted, late = _shed_run(_checked(f(max_wait_s=8.0)), name)
        if dropped := sorted(r for r in preempted if reasons.get(r) == "shed"):
            return f"{dropped[0]} was preempted, then shed: a preempted request waits in the queue"
        if late:
            return f"{len(late)} requests, e.g. {late[0]}, started after waiting over max_wait_s (8 s): shed them"
        wrong = sorted(r for r in want if reasons.get(r) != want[r])
        if not wrong:
            return None
        first = wrong[0]
        return Differs(
            f"{len(wrong)} requests end otherwise than by the lesson's rule, e.g. {first}: "
            f"{reasons.get(first)!r}, not {want[first]!r}"
        )

    return piece_case(label, judge)


def admission_policy(cls: Any) -> Verdict:
    """Check ``MyAdmission(AdmissionBase)``'s ``to_shed(queue, now)`` and ``check_room(queue_depth)``
    against the library's ``Admission``."""

    two = [_queued("a", 1.0), _queued("b", 8.0)]
    back = [_queued("back", 0.0, preempted=True), _queued("new", 9.5)]
    cases = [
        lineage_case(AdmissionBase, (Admission,)),
        _shed_case("no limit (max_wait_s None): nobody is shed", [_queued("a", 0.0)], 100.0, None),
        _shed_case("waits of 9 s and 2 s, limit 8 s: the first goes", two, 10.0, 8.0),
        _shed_case("exactly 8 s waited, limit 8 s: it stays", [_queued("edge", 2.0)], 10.0, 8.0),
        _shed_case(
            "a preempted request (it has output_ids) that arrived long ago: it stays", back, 10.0, 8.0
        ),
        _shed_case(
            "several late ones among others, in queue order", [_queued(r, t) for r, t in LATE], 10.0, 8.0
        ),
        _door_case("the door, no bound (max_queue None), 10,000 waiting: room", None, 10_000),
        _door_case("the door, bound 3, 2 waiting: room", 3, 2),
        _door_case("the door, bound 3, 3 waiting: full (QueueFull)", 3, 3),
        _door_case("the door, bound 0: full even with nobody waiting", 0, 0),
        _whole_run_case(
            "overload", "a whole simulated overload: every request ends as with Admission(max_wait_s=8)"
        ),
        _whole_run_case(
            "tight", "the same on a KV pool of 48 blocks, where preempted requests wait in the queue"
        ),
    ]
    return run_cases("admission_policy", cls, cases)
