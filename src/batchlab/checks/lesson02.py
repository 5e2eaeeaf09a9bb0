"""Checkers for lesson 2 (continuous batching).

- ``continuous_scheduler(MyContinuousScheduler)``: a ``ContinuousScheduler`` subclass whose
  phases ``admit()`` and ``place()`` the learner wrote (``my_engine/continuous.py``); the
  library's ``batches()`` runs admit -> prefill_chunk -> place -> decode_rows around them;
- ``continuous_steps(fn)``: ``fn(output_lens, B)``, the steps continuous batching takes.

The scheduler runs in the real ``Engine`` on the fake model, on small workloads and whole
ones, through ``run_workload``; the trace must keep the rules of continuous batching, every
request must get its reference tokens, and the schedule must be the library's.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..fake import FakeModel
from ..scheduler import ContinuousScheduler
from ._core import Verdict, run_cases
from .lesson01 import (MIXED_OUTPUTS, Req, fake_engine, fake_prompt, fake_workload, output_lens_cases,
                       run_requests, static_step_count, whole_case)

__all__ = ["continuous_scheduler", "continuous_steps"]


def continuous_invariants(trace, B: int) -> str | None:
    """The rules of continuous batching, read off a trace, step by step:

    - one request prefills at a time, and nobody is admitted while a prefilled request
      still awaits a slot;
    - placement fills every free slot while somebody awaits one, first prefilled first
      placed, and a request keeps its slot until it finishes."""
    prompt_len = {rid: r.prompt_len for rid, r in trace.requests.items()}
    awaiting: list[str] = []  # prefilled, not yet in a slot, oldest first
    prefilling: str | None = None
    slot_of: dict[str, int] = {}
    for step in trace.steps:
        k = step.index
        for rid, start, n in step.prefill:
            if rid != prefilling:
                if prefilling is not None:
                    return (f"step {k}: {rid} was admitted while {prefilling} was still "
                            f"prefilling: one request prefills at a time")
                if awaiting:
                    return (f"step {k}: {rid} was admitted while {awaiting[0]} awaited a slot: "
                            f"admit nobody while a prefilled request still waits for a slot")
                prefilling = rid
            if start + n >= prompt_len[rid]:
                prefilling = None
                if rid not in step.finished or rid in step.decoded:  # else done in its prefill
                    awaiting.append(rid)
        if len({rid for rid, _, _ in step.prefill}) > 1:
            return f"step {k}: several requests prefilled: one request prefills at a time"
        placed = [rid for rid in step.decoded if rid not in slot_of]
        if any(rid not in awaiting for rid in placed):
            stray = next(rid for rid in placed if rid not in awaiting)
            return f"step {k}: {stray} got a decode row without having been prefilled"
        if placed != awaiting[:len(placed)]:
            return (f"step {k}: {placed[0]} was placed before {awaiting[0]}, which had waited "
                    f"longer: the first prefilled request takes the first free slot")
        awaiting = awaiting[len(placed):]
        if awaiting and len(step.decoded) < B:
            return (f"step {k}: {awaiting[0]} awaited a slot while only {len(step.decoded)} of "
                    f"the {B} slots decoded: place() must fill every free slot")
        for rid in step.decoded:
            slot = step.slot_of.get(rid)
            if rid in slot_of and slot is not None and slot != slot_of[rid]:
                return (f"step {k}: {rid} moved from slot {slot_of[rid]} to slot {slot}: a "
                        f"request keeps its slot until it finishes")
            if slot is not None:
                slot_of[rid] = slot
        for rid in step.slots:
            if rid is not None and rid not in step.decoded and rid not in step.finished:
                return f"after step {k}: {rid} holds a slot but made no token"
    return None


def _schedule_problem(got, expected) -> str | None:
    """The first step where two continuous traces differ, in words."""
    def words(s):
        pre = ", ".join(f"{rid} ({n} tokens)" for rid, _, n in s.prefill) or "none"
        slots = ", ".join(r or "free" for r in s.slots)
        return f"prefill {pre}; decode rows {', '.join(s.decoded) or 'none'}; slots after [{slots}]"
    for g, e in zip(got.steps, expected.steps):
        if (g.prefill, g.decoded, g.slots) != (e.prefill, e.decoded, e.slots):
            hint = ""
            if g.slots != e.slots and set(filter(None, g.slots)) == set(filter(None, e.slots)):
                hint = "\n    the first waiting request takes the LOWEST free slot (self.take_slot)"
            elif e.prefill and not g.prefill:
                hint = ("\n    nothing stood in the way here: admit the next queued request "
                        "(self.policy.next_queued) when it fits")
            return (f"step {g.index} differs.\n      expected: {words(e)}\n      got:      "
                    f"{words(g)}{hint}")
    return None


def continuous_scheduler(cls) -> Verdict:
    """Check ``MyContinuousScheduler`` (a ``ContinuousScheduler`` subclass whose ``admit()``
    and ``place()`` the learner wrote): small and whole workloads on the fake model, through
    ``run_workload``; the rules of continuous batching are checked on every trace, then the
    tokens, then the schedule step by step against the library's scheduler."""
    fake = FakeModel()
    rng = np.random.default_rng(2)
    rows = [
        ("5 requests, B=2, outputs [4, 6, 2, 5, 3]", 2, [4, 6, 2, 5, 3], [5, 6, 7, 8, 9]),
        ("outputs [5, 2, 3], B=1: the second waits for the only slot", 1, [5, 2, 3], [5, 5, 5]),
        ("single-token requests [1, 1, 1], B=2: they finish in their prefill, no slot needed",
         2, [1, 1, 1], [6, 6, 6]),
        ("12 requests, B=4, outputs between 1 and 9 tokens; slots are freed in the middle "
         "and must be refilled", 4, [7, 1, 3, 9, 2, 2, 8, 5, 1, 6, 4, 3], list(range(3, 15))),
        ("whole workload: 24 requests, outputs 1 to 100 tokens (most short), B=8", 8,
         [int(o) for o in np.clip(np.ceil(rng.exponential(24, 24)), 1, 100)],
         [int(p) for p in rng.integers(20, 60, 24)]),
        ("whole workload: 16 requests with the mixed workload's output lengths, B=8", 8,
         MIXED_OUTPUTS, [int(p) for p in rng.integers(40, 120, 16)]),
    ]
    hint = ("admit(): only when nobody is prefilling and nobody awaits a slot, start the next "
            "queued request (self.start) if it fits; place(): while somebody awaits and a slot "
            "is free, move the first of self.awaiting into it (self.take_slot) and set it DECODING")

    def case(label, B, outputs, prompts, seed):
        return whole_case(label, B, fake_workload("req", outputs, prompts, seed), fake,
                          ContinuousScheduler, ContinuousScheduler, continuous_invariants, hint,
                          _schedule_problem)

    cases = [case(*row, seed=100 * i) for i, row in enumerate(rows)]
    return run_cases("continuous_scheduler", cls, cases)


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
