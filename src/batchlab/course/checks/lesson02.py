"""Checkers for lesson 2 (continuous batching)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np

from ...core.scheduler import ContinuousScheduler, Scheduler
from ._core import Differs, Verdict, run_cases
from ._lineage import KINDS_OF_OURS, lineage_case
from ._pieces import MIXED_OUTPUTS, count_exercise, early_decode_problem, fake_workload, finishing_cases
from ._pieces import gap_problem, memory_case, output_problem, piece_case, piece_judge, run_piece
from ._pieces import slot_problem, state_problem
from .lesson01 import static_step_count

__all__ = ["continuous_scheduler", "continuous_steps"]

HINTS = {
    "memory": "start a request (self.start) only if self.fits(req, n) says its KV memory is there",
    "stuck": "nothing stood in the way of the next queued request: admit it (self.start) when it fits",
}
PLACED = "place() must set each request it places DECODING (req.set_state(State.DECODING, self.clock()))"


def continuous_invariants(trace, B: int) -> str | None:
    """Continuous batching's contract (a slot's request decodes every step and keeps its slot, a
    decode row only after the whole prompt, no free slot left beside a waiting request) fails a
    run; the lesson's own rules (one prefill at a time, nobody admitted while a request awaits a
    slot, free slots filled oldest first) only say where another design differs (``Differs``)."""
    prompt_len = {rid: r.prompt_len for rid, r in trace.requests.items()}
    awaiting, prefilling, slot_of = [], [], {}  # awaiting: prefilled, not yet in a slot, oldest first
    other = None  # the first place the run's rule is not the lesson's

    def differs(text):
        nonlocal other
        other = other or Differs(text)

    for step in trace.steps:
        k = step.index
        for rid, start, n in step.prefill:
            if rid not in prefilling:
                if prefilling:
                    differs(f"step {k}: {rid} was admitted while {prefilling[0]} was still prefilling")
                elif awaiting:
                    why = "the lesson's rule admits nobody while a prefilled request still waits for a slot"
                    differs(f"step {k}: {rid} was admitted while {awaiting[0]} awaited a slot: {why}")
                prefilling.append(rid)
            if start + n >= prompt_len[rid]:
                prefilling.remove(rid)
                if rid not in step.finished or rid in step.decoded:  # else done in its prefill
                    awaiting.append(rid)
        if len({rid for rid, _, _ in step.prefill}) > 1:
            differs(f"step {k}: several requests prefilled; the lesson's rule prefills one at a time")
        placed = [rid for rid in step.decoded if rid not in slot_of]
        if any(rid not in awaiting for rid in placed):
            stray = next(rid for rid in placed if rid not in awaiting)
            return f"step {k}: {stray} got a decode row without having been prefilled"
        if placed != awaiting[: len(placed)]:
            differs(f"step {k}: {placed[0]} was placed before {awaiting[0]}, which had waited longer")
        awaiting = [r for r in awaiting if r not in placed]
        for rid in step.slots:
            if rid is not None and rid not in step.decoded and rid not in step.finished:
                return f"after step {k}: {rid} holds a slot but made no token"
        if awaiting and len(step.decoded) < B and not step.preempted:
            return f"step {k}: {awaiting[0]} awaited beside a free slot: place() must fill every free slot"
        for rid in step.decoded:
            slot = step.slot_of.get(rid)
            if rid in slot_of and slot is not None and slot != slot_of[rid]:
                return f"step {k}: {rid} moved from slot {slot_of[rid]} to slot {slot}: it keeps its slot"
            if slot is not None:
                slot_of[rid] = slot
        for rid in step.preempted:  # it gave everything back and starts over from the queue
            slot_of.pop(rid, None)
            awaiting = [r for r in awaiting if r != rid]
            prefilling = [r for r in prefilling if r != rid]
    return other


def slots_refilled(trace, B: int) -> str | None:
    """Continuous batching's promise: a slot to spare and a request still queued start someone (a
    prefill) within a step (the lesson's rule may wait one, to place a request that awaits a
    slot), unless the KV pool holds the queue back (not judged here). Static batching breaks
    it: finished requests keep their slots until the whole batch ends."""
    first_prefill = {}
    for step in trace.steps:
        for rid, _, _ in step.prefill:
            first_prefill.setdefault(rid, step.index)
    idle = 0  # steps in a row with a slot to spare, someone queued and nobody started
    for step in trace.steps:
        queued = sorted(
            rid
            for rid, r in trace.requests.items()
            if r.arrival_s <= step.start_s and first_prefill.get(rid, len(trace.steps)) > step.index
        )
        spare = queued and not step.prefill and not step.preempted and len(step.decoded) < B
        idle = idle + 1 if spare else 0
        if idle == 2:
            why = "continuous batching starts the next request as soon as a slot is free"
            return f"steps {step.index - 1} and {step.index}: a slot to spare while {queued[0]} waited: {why}"
    return None


def continuous_judge(rules, hints, placed, rows, B, seed=0, max_seq_len=None, **options):
    """A judge for ``piece_case`` shared by lessons 2 and 4; ``rules(trace, B)`` are the kind's."""
    w = fake_workload("req", rows, seed)

    def decoding_set_by_place(trace):
        return state_problem(trace, placed)

    def no_decode_before_the_whole_prompt(trace):
        return early_decode_problem(trace, w)

    def prompts_prefilled_in_order(trace):
        return gap_problem(trace, w)

    def the_kinds_own_rules(trace):
        return rules(trace, B)

    def one_request_a_slot_within_B(trace):
        return slot_problem(trace, B)

    def free_slots_refilled(trace):
        return None if "num_kv_blocks" in options else slots_refilled(trace, B)

    def outputs_as_the_fake_model_makes_them(trace):
        return output_problem(trace, w, max_seq_len or 4096)

    early = [decoding_set_by_place, no_decode_before_the_whole_prompt]  # also for a run that broke off
    checks = early + [prompts_prefilled_in_order, the_kinds_own_rules, one_request_a_slot_within_B]
    checks.append(free_slots_refilled)
    checks.append(outputs_as_the_fake_model_makes_them)
    options.update(broken=early, hints=hints, max_seq_len=max_seq_len, max_batch_size=B)
    return piece_judge(Scheduler, ContinuousScheduler, w, checks, **options)


def continuous_scheduler(cls) -> Verdict:
    """Check ``MyContinuousScheduler``: its lineage, the rules of continuous batching on every step
    (any schedule that keeps them passes), the tokens, the finishing rules, every block back."""
    rng = np.random.default_rng(2)
    short = [int(o) for o in np.clip(np.ceil(rng.exponential(24, 24)), 1, 100)]
    p24, p16 = [int(p) for p in rng.integers(20, 60, 24)], [int(p) for p in rng.integers(40, 120, 16)]
    outs12 = [7, 1, 3, 9, 2, 2, 8, 5, 1, 6, 4, 3]
    rows = [  # (label, B, output lengths, prompt lengths)
        ("5 requests, B=2, outputs [4, 6, 2, 5, 3]", 2, [4, 6, 2, 5, 3], [5, 6, 7, 8, 9]),
        ("outputs [5, 2, 3], B=1: the second waits for the only slot", 1, [5, 2, 3], [5, 5, 5]),
        ("single-token requests [1, 1, 1], B=2: no slot needed", 2, [1, 1, 1], [6, 6, 6]),
        ("12 requests, B=4: slots freed mid-way must be refilled", 4, outs12, list(range(3, 15))),
        ("whole workload: 24 requests, outputs 1 to 100 tokens (most short), B=8", 8, short, p24),
        ("whole workload: 16 requests with the mixed workload's output lengths, B=8", 8, MIXED_OUTPUTS, p16),
    ]
    admit = "admit(): start the next queued request if it fits, while nobody prefills or awaits a slot; "
    hint = admit + "place(): move the first awaiting request into a free slot and set it DECODING"
    judge = partial(continuous_judge, continuous_invariants, HINTS, PLACED)
    cases = [
        piece_case(label, judge(list(zip(prompts, outputs)), B, 100 * i), hint)
        for i, (label, B, outputs, prompts) in enumerate(rows)
    ]
    ten = [(20 + 9 * i % 40, 40 + 7 * i % 30) for i in range(10)]
    twelve = [(30 + 23 * i % 90, 30 + 11 * i % 40) for i in range(12)]
    pressure = [  # (label, rows, B, KV blocks of 16 tokens): a pool for two or three whole requests
        ("memory: 10 requests on a KV pool of 16 blocks, B=4: most must wait to start", ten, 4, 16),
        ("memory: 12 requests on 24 blocks, B=6", twelve, 6, 24),
        ("memory: a pool of 8 blocks holds one request at a time, B=4", ten[:5], 4, 8),
    ]
    cases += [memory_case(label, judge(w, B, 9, num_kv_blocks=n), False, hint) for label, w, B, n in pressure]
    lineage = lineage_case(Scheduler, KINDS_OF_OURS)
    return run_cases("continuous_scheduler", cls, [lineage, *cases, *finishing_cases(3, seed=2)])


def continuous_steps(fn: Callable) -> Verdict:
    """Check ``fn(output_lens, B) -> int``: the steps continuous batching (whole-prompt prefill) takes."""

    def truth(lens, B):
        workload = fake_workload("req", [(5, o) for o in lens], 400)
        return len(run_piece(ContinuousScheduler, workload, max_batch_size=B).trace.steps)

    def diagnose(lens, B, got, expected):
        if got == static_step_count(lens, B) and got != expected:
            return "that is the count for static batching (lesson 1), not continuous batching"
        if got in (expected + 1, expected - 1):
            return "off by one: the prefill makes the first token; a request decodes the step it is placed"
        return ""

    rows = [
        ("one request with 3 output tokens, B=1", [3], 1),
        ("outputs [5, 2, 3], B=3: admitted one per step", [5, 2, 3], 3),
        ("outputs [5, 2, 3], B=1: the second waits for the only slot", [5, 2, 3], 1),
        ("outputs [1, 1, 1], B=2: single-token requests never need a slot", [1, 1, 1], 2),
        ("outputs [6, 2, 2, 2, 2], B=2: short requests pass through the second slot", [6, 2, 2, 2, 2], 2),
        ("the mixed workload's outputs, B=8", MIXED_OUTPUTS, 8),
        ("the mixed workload's outputs, B=16", MIXED_OUTPUTS, 16),
    ]
    hint = (
        "simulate: admit one request if none waits (its prefill makes a token), place, then each slot decodes"
    )
    return count_exercise("continuous_steps", fn, rows, truth, diagnose, hint)
