"""Checkers for lesson 1 (static batching)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np

from ...core.scheduler import Scheduler, StaticScheduler
from ...core.trace import Trace
from ._core import Verdict, run_cases
from ._lineage import KINDS_OF_OURS, lineage_case
from ._pieces import (
    MIXED_OUTPUTS,
    count_exercise,
    fake_workload,
    finishing_cases,
    memory_case,
    output_problem,
)
from ._pieces import piece_case
from ._pieces import piece_judge, run_piece, schedule_problem, slot_problem, state_problem

__all__ = ["static_scheduler", "wasted_slot_steps", "static_steps"]


HINTS = {
    "stuck": "when every request of the batch is done, free them all (self.release(req))",
    "slot": "a slot is still held: free each with self.release(req) before the next batch starts",
    "memory": "a request joins the batch only if self.reserve(req) promises its whole KV memory",
}
BEGIN = "start each request of the batch with self.begin(req)"


def _key(s):
    prefill = [(rid, n) for rid, _, n in s.prefill]
    return prefill, list(s.decoded), list(s.padding), s.padding_tokens, list(s.slots)


def _words(s, other) -> str:
    parts = []
    if s.prefill:
        parts.append("prefill " + ", ".join(f"{rid} ({n} tokens)" for rid, _, n in s.prefill))
    parts.append(f"decode rows {', '.join(s.decoded) or 'none'}")
    if s.padding or other.padding:
        parts.append(f"padding rows {', '.join(s.padding) or 'none'}")
    if s.padding_tokens or other.padding_tokens:
        parts.append(f"{s.padding_tokens} padding tokens")
    if s.slots != other.slots:
        parts.append("slots after the step [" + ", ".join(r or "free" for r in s.slots) + "]")
    return "; ".join(parts)


def _static_hint(g, e) -> str | None:
    if e.prefill and g.prefill and len(g.prefill) != len(e.prefill):
        return "a new batch takes up to max_batch_size requests from the front of the queue, all at once"
    if any(ge is None and ee is not None for ge, ee in zip(g.slots, e.slots)):
        return "a request left its slot while its batch was running: a finished request keeps it as padding"
    if e.padding and not g.padding:
        return "a finished request stays in the batch as a padding row: Batch(decode=live, padding=finished)"
    if g.padding_tokens != e.padding_tokens:
        return "padding_tokens: for every request of the batch, the longest prompt minus its own"
    if set(g.decoded) - set(e.decoded):
        return "only requests that are not finished get a decode row"
    return None


def static_invariants(trace: Trace, B: int) -> str | None:
    """Static batching's rules: nobody joins a running batch; a finished request keeps a padding row."""
    batch, previous_slots, finished = set(), [], set()
    for step in trace.steps:
        started = {rid for rid, _, _ in step.prefill}
        running = sorted(r for r in previous_slots if r and r not in finished)  # a batch still at work
        if started and running:
            who = ", ".join(sorted(started))
            return (
                f"step {step.index}: {who} started while {', '.join(running)} of the batch were still "
                "decoding: in static batching nobody joins a running batch"
            )
        batch = started or batch
        rows = set(step.decoded) | set(step.padding)
        if step.decoded and rows != batch:
            missing = sorted(batch - rows)
            if missing and set(missing) <= finished:
                why = "a finished request stays in its batch as a padding row until the batch ends"
                return f"step {step.index}: finished {', '.join(missing)} had no row: {why}"
            return f"step {step.index}: the decode step ran rows {sorted(rows)}, the batch is {sorted(batch)}"
        if both := sorted(set(step.decoded) & set(step.padding)):
            return f"step {step.index}: {both} got a decode row and a padding row"
        finished |= set(step.finished)
        previous_slots = list(step.slots)
    return None


def _static_judge(rows, B, seed=0, **pool):
    w = fake_workload("static", rows, seed)

    def outputs_as_the_fake_model_makes_them(trace):
        return output_problem(trace, w)

    def one_request_a_slot_within_B_finished_ones_may_stay(trace):
        return slot_problem(trace, B, rectangular=True)

    def decoding_set_by_begin(trace):
        return state_problem(trace, BEGIN)

    def nobody_joins_a_running_batch(trace):
        return static_invariants(trace, B)

    checks = [outputs_as_the_fake_model_makes_them, one_request_a_slot_within_B_finished_ones_may_stay]
    checks += [decoding_set_by_begin, nobody_joins_a_running_batch]
    schedule = partial(schedule_problem, key=_key, words=_words, hint=_static_hint)
    pool.update(schedule=schedule, hints=HINTS, max_batch_size=B)
    return piece_judge(Scheduler, StaticScheduler, w, checks, **pool)


def static_scheduler(cls) -> Verdict:
    """Check ``MyStaticScheduler`` (a ``Scheduler`` subclass with the learner's ``batches()`` and
    ``finish_reason()``)."""
    rng = np.random.default_rng(0)  # lengths drawn like the mixed workload's
    mixed = list(zip(rng.integers(40, 301, 16).tolist(), rng.integers(4, 65, 16).tolist()))
    thirty = list(zip(rng.integers(3, 30, 30).tolist(), rng.integers(1, 41, 30).tolist()))
    hint = "start up to B requests only when no batch runs; when all of the batch are done, free them all"
    five = [(4, 3), (5, 7), (6, 2), (7, 5), (8, 4)]
    rows = [
        ("two batches: 5 requests, B=3; the 4th and 5th wait for the first three", five, 3),
        ("one batch of 3 requests with B=4 (fewer requests than slots)", [(5, 4), (9, 2), (3, 6)], 4),
        ("every request wants a single token (3 requests, B=2): no decode rows", [(6, 1)] * 3, 2),
        ("a request stops early and stays in its batch as a padding row", [(7, 9), (6, 4), (5, 8)], 3),
        ("B=1: one request at a time", [(4, 3), (5, 1), (6, 4)], 1),
        ("whole workload: 16 requests drawn like the mixed workload's, B=8", mixed, 8),
        ("whole workload: 30 requests, outputs 1 to 40 tokens, B=4 (eight batches)", thirty, 4),
    ]
    cases = [
        piece_case(label, _static_judge(w, B, seed=10 * i), hint) for i, (label, w, B) in enumerate(rows)
    ]
    tight = _static_judge([(20 + 7 * i % 25, 8 + 5 * i % 30) for i in range(12)], 8, seed=7, num_kv_blocks=16)
    label = "memory: 12 requests on a KV pool of 16 blocks of 16 tokens, B=8"
    lineage = lineage_case(Scheduler, KINDS_OF_OURS)
    cases += [memory_case(label, tight, False, hint), *finishing_cases(3, seed=1)]
    return run_cases("static_scheduler", cls, [lineage, *cases])


def _static_trace(output_lens: list[int], B: int) -> Trace:
    """The library's static engine on short prompts with these output lengths, all at once."""
    workload = fake_workload("static", [(5, o) for o in output_lens], 60)
    return run_piece(StaticScheduler, workload, max_batch_size=B).trace


def static_step_count(output_lens: list[int], B: int) -> int:
    return len(_static_trace(output_lens, B).steps)


def _wasted(output_lens: list[int], B: int) -> int:
    return sum(B - len(s.decoded) for s in _static_trace(output_lens, B).steps if s.decoded)


def wasted_slot_steps(fn: Callable) -> Verdict:
    """Check ``fn(output_lens, B) -> int``: the slot-steps one static batch wastes (padding, empty slots)."""

    def diagnose(lens, B, got, expected):
        m = max(lens)
        if got == sum(m - o for o in lens) and len(lens) < B:
            return f"that counts the padding rows, but {B - len(lens)} of the {B} slots waste every step too"
        if got == B * m - sum(lens) or got == sum(m - o for o in lens) + (B - len(lens)) * m:
            return f"the batch runs max - 1 = {m - 1} decode steps, not {m}: the prefill makes a token"
        return ""

    rows = [
        ("outputs [5, 2, 3] filling B=3 slots", [5, 2, 3], 3),
        ("outputs [5, 2, 3] in B=4 slots (one slot stays empty)", [5, 2, 3], 4),
        ("four equal outputs [6, 6, 6, 6], B=4: nothing wasted", [6, 6, 6, 6], 4),
        ("outputs [1, 10], B=2: one short request beside a long one", [1, 10], 2),
        ("outputs [1, 1], B=2: the prefill makes every token, there is no decode step", [1, 1], 2),
        ("the first batch of the mixed workload: [42, 37, 38, 61, 20, 53, 44, 4], B=8", MIXED_OUTPUTS[:8], 8),
    ]
    hint = "count, over the max(output_lens) - 1 decode steps, the slots that made no token"
    return count_exercise("wasted_slot_steps", fn, rows, _wasted, diagnose, hint)


def static_steps(fn: Callable) -> Verdict:
    """Check ``fn(output_lens, B) -> int``: the engine steps static batching takes, all arriving at once."""

    def diagnose(lens, B, got, expected):
        groups = [lens[i : i + B] for i in range(0, len(lens), B)]
        if got == sum(max(g) for g in groups):
            return "each batch takes max - 1 steps, not max: the prefill makes every first token"
        if got == sum(max(g) - 1 for g in groups):
            return "a batch whose requests all want a single token still takes one step (its prefill)"
        if len(groups) > 1 and got in (max(lens) - 1, max(lens)):
            return f"with B={B}, the {len(lens)} requests run as {len(groups)} batches, one after the other"
        return ""

    rows = [
        ("one request with 3 output tokens, B=1", [3], 1),
        ("outputs [5, 2, 3] as one batch, B=3", [5, 2, 3], 3),
        ("outputs [5, 2, 3] with B=2: batches [5, 2] then [3]", [5, 2, 3], 2),
        ("outputs [1, 1, 1] with B=2: two batches of single-token requests", [1, 1, 1], 2),
        ("outputs [4, 9, 2, 2, 7] with B=1: one request at a time", [4, 9, 2, 2, 7], 1),
        ("the mixed workload's outputs, B=8", MIXED_OUTPUTS, 8),
        ("the mixed workload's outputs, B=16 (a single batch)", MIXED_OUTPUTS, 16),
    ]
    hint = "split the requests into batches of B in arrival order; a batch lasts until its longest is done"
    return count_exercise("static_steps", fn, rows, static_step_count, diagnose, hint)
