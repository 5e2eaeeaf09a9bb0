"""Checkers for lesson 2 (continuous batching).

The learner writes two phases of the continuous scheduler's step as plain functions,
and counts steps:

- ``place_awaiting(fn)``: phase 4, ``fn(awaiting, slots)`` moves prefilled requests from
  the front of ``awaiting`` into free slots (``None`` entries of ``slots``), lowest first;
- ``admit_next(fn)``: phase 2, ``fn(queue, prefilling, awaiting)`` takes the next request
  out of the queue to start its prefill, or returns None when the rule says wait;
- ``continuous_steps(fn)``: ``fn(output_lens, B)``, the steps continuous batching takes.

Each function is first tried on small hand-made states, then plugged into a continuous
scheduler that the real ``Engine`` drives on the fake model, and compared step by step
with the library's ``ContinuousScheduler``.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from ..fake import FakeModel
from ..request import State
from ..scheduler import ContinuousScheduler
from ._core import Case, Verdict, run_cases
from .lesson01 import (MIXED_OUTPUTS, Req, compare_runs, fake_engine, fake_prompt, output_lens_cases,
                       run_requests, static_step_count)

__all__ = ["place_awaiting", "admit_next", "continuous_steps"]


class _HookedContinuous(ContinuousScheduler):
    """The library's continuous scheduler with phases 2 (admit) and 4 (place) handed to
    functions, so a learner's version runs inside the real engine. Phases 3 and 5 are the
    library's own methods, inherited."""

    admit_fn: Callable | None = None  # admit(queue, prefilling, awaiting) -> request or None
    place_fn: Callable | None = None  # place(awaiting, slots) -> None (changes both)

    def admit(self) -> None:
        """The learner's rule, if given; the library takes KV memory for whoever it picks."""
        if self.admit_fn is None:
            return super().admit()
        if self.queue and not self.fits(self.queue[0], self.prefill_step):
            return
        before = self.prefilling
        req = type(self).admit_fn(self.queue, self.prefilling, self.awaiting)
        if req is not None:
            if req is before:
                raise RuntimeError("admit_next returned the request that is already "
                                   "prefilling: return a request taken from the queue")
            self.start(req, self.prefill_step)
            self.prefilling = req

    def place(self) -> None:
        """The learner's placement, if given."""
        if self.place_fn is None:
            return super().place()
        before = list(self.slots)
        type(self).place_fn(self.awaiting, self.slots)
        for i, (old, new) in enumerate(zip(before, self.slots)):
            if new is old:
                continue
            if old is not None:
                raise RuntimeError(f"slot {i} held {old.id}, which was still decoding, and "
                                   f"your placement put {getattr(new, 'id', new)} there")
            new.slot = i
            new.set_state(State.DECODING, self.clock())


def _hooked(admit=None, place=None):
    return type("LearnerContinuous", (_HookedContinuous,),
                {"admit_fn": staticmethod(admit) if admit else None,
                 "place_fn": staticmethod(place) if place else None})


_ENGINE_CASES = [  # (label, B, requests): all arrive at once
    ("in the engine: 5 requests, B=2, outputs [4, 6, 2, 5, 3]; the engine's tokens and every "
     "step must match the library's scheduler", 2,
     [Req(fake_prompt(5 + i, 200 + i), o) for i, o in enumerate([4, 6, 2, 5, 3])]),
    ("in the engine: 12 requests, B=4, outputs between 1 and 9 tokens", 4,
     [Req(fake_prompt(3 + i, 300 + i), o) for i, o in enumerate([7, 1, 3, 9, 2, 2, 8, 5, 1, 6, 4, 3])]),
]


def _engine_case(label, B, reqs, admit=None, place=None):
    fake = FakeModel()
    expected = run_requests(fake_engine(ContinuousScheduler, B, fake), reqs)

    def call(f):
        scheduler = _hooked(admit=f if admit else None, place=f if place else None)
        return run_requests(fake_engine(scheduler, B, fake), reqs)

    def show(run):
        return f"{len(run.steps)} steps" + (" (then stopped)" if run.stuck else "")

    return Case(label, call, expected, lambda got, exp: compare_runs(got, exp, reqs, fake), show=show)


# ---------------------------------------------------------------------------------------
# Exercise: phase 4, placement.

def _show_state(v) -> str:
    if isinstance(v, tuple) and len(v) == 2:
        return f"awaiting {v[0]}, slots {v[1]}"
    return repr(v)


def place_awaiting(fn: Callable) -> Verdict:
    """Check ``fn(awaiting, slots)``: move requests from the front of the deque ``awaiting``
    into the free (``None``) entries of the list ``slots``, lowest slot first, until nobody
    waits or no slot is free. It changes both in place (what it returns is ignored)."""

    def right(awaiting, slots):
        awaiting, slots = deque(awaiting), list(slots)
        while awaiting and None in slots:
            slots[slots.index(None)] = awaiting.popleft()
        return list(awaiting), slots

    def compare_for(awaiting, slots):
        def compare(got, expected):
            if got == expected:
                return None
            aw, sl = got
            if len(sl) != len(slots):
                return f"slots must keep its length ({len(slots)}): put requests into the None entries"
            if got == (list(awaiting), list(slots)):
                return "nothing moved: take requests from awaiting (popleft) into the free slots"
            for i, (old, new) in enumerate(zip(slots, sl)):
                if old is not None and new != old:
                    return (f"slot {i} held {old!r}, still decoding, and you replaced it: only the "
                            f"None entries are free")
            placed = [r for r in sl if r is not None and r not in slots]
            if len(placed) != len(set(placed)):
                return "a request ended up in two slots"
            if any(r in aw for r in placed):
                return "a request you put into a slot is still in awaiting: take it out (popleft)"
            if sorted(placed) == sorted(expected[1][i] for i in range(len(sl))
                                        if expected[1][i] is not None and slots[i] is None):
                return ("the right requests moved, into the wrong slots: the first waiting request "
                        "takes the lowest free slot, the next one the next free slot")
            return ""
        return compare

    rows = [
        ("two requests wait, three slots free: ['a', 'b'] into [None, 'x', None, None]",
         ["a", "b"], [None, "x", None, None],
         "the first waiting request takes the lowest free slot"),
        ("three wait, one slot free: only the first moves, the others keep waiting in order",
         ["a", "b", "c"], ["x", None, "y"], "stop when no slot is free; the rest stay in awaiting"),
        ("all slots busy: nothing moves", ["a"], ["x", "y"], ""),
        ("nobody waits: nothing changes", [], [None, "x", None], ""),
        ("a hole in the middle (a request finished in slot 1): it is filled first",
         ["a", "b"], ["x", None, "y", None], "free slots are filled from the lowest index up"),
        ("more free slots than waiting requests: placement stops when awaiting is empty",
         ["a"], [None, None, None], "stop when nobody is left in awaiting"),
    ]

    def case(label, awaiting, slots, hint):
        def call(f):
            a, s = deque(awaiting), list(slots)
            f(a, s)
            return list(a), list(s)
        return Case(label, call, right(awaiting, slots), compare_for(awaiting, slots), hint,
                    show=_show_state)

    cases = [case(*row) for row in rows]
    cases += [_engine_case(label, B, reqs, place=True) for label, B, reqs in _ENGINE_CASES]
    return run_cases("place_awaiting", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise: phase 2, the admission rule.

def admit_next(fn: Callable) -> Verdict:
    """Check ``fn(queue, prefilling, awaiting) -> request or None``: start the next prefill
    only when no request is prefilling and none waits for a slot; then take the request
    at the front of the queue out of it and return it. Otherwise return None and change
    nothing."""

    rows = [
        ("queue ['a', 'b'], nothing prefilling, nobody awaiting: admit 'a'",
         ["a", "b"], None, [], "a", "take the FIRST request of the queue (queue.popleft())"),
        ("queue ['a', 'b'] but 'p' is still prefilling (a long prompt in chunks): wait",
         ["a", "b"], "p", [], None,
         "one request prefills at a time: while one is prefilling, admit nobody"),
        ("queue ['a'], nothing prefilling, but 'w' waits for a slot: wait",
         ["a"], None, ["w"], None,
         "a prefilled request still waits for a free slot: admitting another would only prefill "
         "a second request that cannot decode either, holding KV memory and stalling the "
         "decoders for nothing"),
        ("empty queue: nothing to admit", [], None, [], None, "with an empty queue, return None"),
        ("queue ['c'] after earlier admissions, all clear: admit 'c'",
         ["c"], None, [], "c", ""),
    ]

    def case(label, queue, prefilling, awaiting, expected_req, hint):
        def call(f):
            q, a = deque(queue), deque(awaiting)
            got = f(q, prefilling, a)
            return (got, list(q), list(a))

        expected = (expected_req, [r for r in queue if r != expected_req], list(awaiting))

        def compare(got, exp):
            if got == exp:
                return None
            req, q, a = got
            if req == exp[0] and q == list(queue) and req is not None:
                return "you returned the right request but left it in the queue: take it out with popleft()"
            if req is None and exp[0] is not None:
                return "nothing stands in the way here: admit the front of the queue"
            if exp[0] is None and req is not None:
                return "the rule says wait here, so return None and leave the queue as it is"
            if a != list(awaiting):
                return "admission never touches awaiting"
            return ""

        def show(v):
            req, q, a = v
            return f"returned {req!r}; queue afterwards {q}"

        return Case(label, call, expected, compare, hint, show)

    cases = [case(*row) for row in rows]
    cases += [_engine_case(label, B, reqs, admit=True) for label, B, reqs in _ENGINE_CASES]
    return run_cases("admit_next", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise: counting steps.

def continuous_steps(fn: Callable) -> Verdict:
    """Check ``fn(output_lens, B) -> int``: the steps a continuous engine with ``B`` slots
    (whole-prompt prefill) takes for requests that all arrive at once and generate
    ``output_lens`` tokens each."""
    fake = FakeModel()

    def truth(lens, B):
        run = run_requests(fake_engine(ContinuousScheduler, B, fake),
                           [Req(fake_prompt(5, 400 + i), o) for i, o in enumerate(lens)])
        return len(run.steps)

    def diagnose_for(lens, B):
        def diagnose(got, expected):
            if got == static_step_count(lens, B) and got != expected:
                return "that is the count for static batching (lesson 1), not continuous batching"
            if got == expected + 1 or got == expected - 1:
                return ("off by one: a request's first token comes from its prefill, and it "
                        "decodes in the very step it is placed")
            return ""
        return diagnose

    rows = [
        ("one request with 3 output tokens, B=1", [3], 1),
        ("outputs [5, 2, 3], B=3: admitted one per step", [5, 2, 3], 3),
        ("outputs [5, 2, 3], B=1: the second waits for the only slot", [5, 2, 3], 1),
        ("outputs [1, 1, 1], B=2: single-token requests never need a slot", [1, 1, 1], 2),
        ("outputs [6, 2, 2, 2, 2], B=2: short requests pass through the second slot", [6, 2, 2, 2, 2], 2),
        ("the mixed workload's outputs, B=8", MIXED_OUTPUTS, 8),
        ("the mixed workload's outputs, B=16", MIXED_OUTPUTS, 16),
    ]
    cases = output_lens_cases(
        rows, truth, diagnose_for,
        "simulate the step: admit one request if none waits for a slot (its prefill "
        "makes its first token), place waiting requests into free slots, then every "
        "occupied slot makes one token; a request leaves its slot when done")
    return run_cases("continuous_steps", fn, cases)
