"""Checkers for lesson 5 (token budget and hybrid batches)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...core.request import State
from ...core.runner import Chunk
from ...core.scheduler import Batch, Scheduler, StallFreeScheduler
from ...core.trace import StepRecord, Trace
from ._core import Verdict, mistakes, number_compare, run_cases, show, table
from ._pieces import early_decode_problem, fake_workload, gap_problem, memory_case, output_problem, piece_case
from ._pieces import piece_judge, random_rows, run_piece, schedule_problem, slot_problem
from ._lineage import KINDS_OF_OURS, lineage_case

__all__ = ["stallfree_planner", "pack_chunks", "skipped_decodes", "fused_saving"]


def _skipped(trace: Trace) -> list[tuple[int, str]]:
    """(step index, request) for every step a decoding request had no decode row in (the answer)."""
    steps = list(trace.steps)
    emitted_at: dict[str, list[int]] = {}
    for k, s in enumerate(steps):
        for rid in s.emitted:
            emitted_at.setdefault(rid, []).append(k)
    decoding = ((rid, k) for rid, ks in emitted_at.items() for k in range(ks[0] + 1, ks[-1] + 1))
    return sorted((steps[k].index, rid) for rid, k in decoding if rid not in steps[k].decoded)


def _plan(step) -> tuple[list[str], list[tuple[str, int]]]:
    """A step's rows as sets: the order of rows within one pass is the learner's to choose."""
    return sorted(step.decoded), sorted((rid, n) for rid, _, n in step.prefill)


HINTS = {
    "memory": "admit (self.admit_next) only a request whose KV memory fits",
    "slot": "admit only while self.free_slot() is not None",
}


def _planner_rules(trace, budget):
    for step in trace.steps:
        if step.passes > 1:
            return f"step {step.index} ran {step.passes} forward passes: plan() returns ONE Batch"
        if step.num_tokens > budget:
            return f"step {step.index} ran {step.num_tokens} tokens, over the token budget of {budget}"
    preempted = {rid for s in trace.steps for rid in s.preempted}  # they wait their turn again
    skipped = [(k, rid) for k, rid in _skipped(trace) if rid not in preempted]
    if skipped:
        k, rid = skipped[0]
        return f"step {k}: {rid} was decoding but got no decode row: decodes come first, before any prefill"
    return None


RULE = "the stall-free rule gives: decodes, partial prefills, then admissions while budget and slots remain"


def _plan_words(step, _):
    return "decode {} and prefill chunks {}".format(*_plan(step))


def _planner_schedule(trace, ref):
    return schedule_problem(trace, ref, _plan, _plan_words, lambda got, expected: RULE)


def _planner_judge(rows, B, budget, seed=0, exact=True, **pool):
    """``exact``: the schedule must be Algorithm 3's step for step (where memory does not
    decide it); else any schedule that keeps the rules passes."""
    w = fake_workload("stall-free", rows, seed)

    def one_pass_within_budget_decodes_first(trace):
        return _planner_rules(trace, budget)

    def no_decode_before_the_whole_prompt(trace):
        return early_decode_problem(trace, w)

    def prompts_prefilled_in_order(trace):
        return gap_problem(trace, w)

    def one_request_a_slot_within_B(trace):
        return slot_problem(trace, B)

    def outputs_as_the_fake_model_makes_them(trace):
        return output_problem(trace, w)

    early = [no_decode_before_the_whole_prompt]  # also for a run that broke off
    checks = [one_pass_within_budget_decodes_first, *early, prompts_prefilled_in_order]
    checks += [one_request_a_slot_within_B, outputs_as_the_fake_model_makes_them]
    schedule = _planner_schedule if exact else None
    pool.update(broken=early, schedule=schedule, hints=HINTS, max_batch_size=B, token_budget=budget)
    return piece_judge(Scheduler, StallFreeScheduler, w, checks, **pool)


TIGHT = random_rows(5, 10, (20, 120), (20, 50))
HINT = "budget = self.token_budget - len(decode); partial prefills take min(budget, self.chunk(req))"
ADMIT = "admit from the queue while budget and a free slot remain"


def _case(label, rows, batch, budget, hint=HINT, **options):
    return piece_case(label, _planner_judge(rows, batch, budget, **options), hint)


def stallfree_planner(cls) -> Verdict:
    """Check ``MyStallFreeScheduler``: its lineage, and a ``plan()`` that returns the step's one
    ``Batch`` by Algorithm 3's rule (decodes, partial prefills, admissions within the budget)."""
    twelve, ten = random_rows(3, 12, (1, 90), (1, 12)), random_rows(4, 10, (1, 40), (1, 9))
    cases = [
        _case("the lesson's example: 3 slots, budget 16", [(20, 4), (6, 3), (30, 2), (5, 3)], 3, 16),
        _case("3 requests of 4 tokens, budget 16: all admitted at once", [(4, 5)] * 3, 3, 16, ADMIT),
        _case("the decodes fill the budget: 4 slots, budget 4", [(3, 6)] * 4 + [(10, 2)], 4, 4),
        _case("two partial prefills continue in admission order, budget 8", [(10, 3), (10, 3), (3, 3)], 3, 8),
        _case("5 requests, 2 slots: the queue waits", [(6, 4), (6, 2), (6, 3), (6, 1), (6, 2)], 2, 16, ADMIT),
        _case("a request that finishes with its first token", [(5, 6), (12, 1), (7, 3)], 2, 8, ""),
        _case("a whole workload, 4 slots, budget 24", twelve, 4, 24, "", seed=3),
        _case("a whole workload, 3 slots, budget 5", ten, 3, 5, "", seed=4),
    ]
    label = "memory: 10 requests on a KV pool of 16 blocks, budget 24 (most must wait to start)"
    tight = _planner_judge(TIGHT, 4, 24, seed=5, exact=False, num_kv_blocks=16)
    cases.append(memory_case(label, tight, False, HINT))
    return run_cases("stallfree_planner", cls, [lineage_case(Scheduler, KINDS_OF_OURS), *cases])


def _pack_reference(chunks):
    ends = np.cumsum([len(c.tokens) for c in chunks]) - 1
    positions = [p for c in chunks for p in range(c.start, c.end)]
    return [t for c in chunks for t in c.tokens], positions, [int(e) for e in ends]


def pack_chunks(fn: Callable) -> Verdict:
    """Check ``fn(chunks) -> (tokens, positions, last)``: flat tokens, their positions, each chunk's end."""

    def compare(got, expected):
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return "return three lists: (tokens, positions, last)"
        tokens, positions, last = got = tuple([int(x) for x in part] for part in got)
        if got == expected:
            return None
        if tokens != expected[0]:
            return "the tokens are wrong: every chunk's tokens, one chunk after the other, in the order given"
        if len(positions) != len(tokens):
            return f"{len(positions)} positions for {len(tokens)} tokens: one position per token"
        if positions != expected[1]:
            if positions == list(range(len(tokens))):
                return "those are positions in the packed row; each token's is in its OWN sequence"
            return "the positions are wrong: chunk c's tokens sit at c.start, c.start + 1, ..."
        if len(last) != len(expected[2]):
            return f"{len(last)} last indices for {len(expected[2])} chunks: one per chunk"
        if last == [e + 1 for e in expected[2]]:
            return "off by one: the index of a chunk's last token is (tokens so far) - 1"
        return "the last indices are wrong: where each chunk's last token sits in the flat list"

    one_step = [Chunk(f"d{i}", [100 + i], s) for i, s in enumerate([52, 7, 130, 88, 41, 64, 19, 23])]
    hybrid = [Chunk("a", [1], 40), Chunk("b", [2], 7), Chunk("c", [3], 100)]
    hybrid.append(Chunk("p", [20, 21, 22, 23, 24], 16))
    start, more = [Chunk("p", [5, 6, 7], 0)], [Chunk("p", [11, 12, 13, 14], 16)]
    rows = [
        ("one decode row: token 42 at position 9", [Chunk("a", [42], 9)]),
        ("one prefill chunk starting a prompt: tokens 5, 6, 7 at positions 0, 1, 2", start),
        ("a prefill chunk that continues a prompt: 4 tokens from position 16", more),
        ("a hybrid batch: 3 decode rows (positions 40, 7, 100), then a 5-token chunk from 16", hybrid),
        ("two prefill chunks of different requests", [Chunk("p", [9, 8, 7], 0), Chunk("q", [6, 5], 30)]),
        ("8 decode rows + a 64-token chunk (T = 72)", one_step + [Chunk("p", list(range(500, 564)), 128)]),
    ]
    hint = "chunk c's tokens sit at c.start, c.start + 1, ...; a decode row is a chunk of one token"
    return table("pack_chunks", fn, rows, _pack_reference, lambda chunks: compare, hint)


class _PrefillFirst(StallFreeScheduler):
    """A wrong policy for the checker: prefill takes the budget first, decodes get what is left."""

    def plan(self) -> Batch:
        prefill = self.continue_prefills(self.token_budget)
        prefill += self.admit_within(self.token_budget - sum(n for _, n in prefill))
        budget = self.token_budget - sum(n for _, n in prefill)
        return Batch(decode=self.in_state(State.DECODING)[: max(budget, 0)], prefill=prefill)


def _fake_trace(scheduler_cls, batch: int, budget: int, seed: int) -> Trace:
    workload = fake_workload("skips", random_rows(seed, 8, (3, 40), (1, 9)), seed)
    return run_piece(scheduler_cls, workload, max_batch_size=batch, token_budget=budget).trace


def _hand_trace(*steps) -> Trace:
    """A trace of steps given as (decode rows, tokens emitted)."""
    records = [StepRecord(i, float(i), float(i) + 1, decoded=d, emitted=e) for i, (d, e) in enumerate(steps)]
    return Trace("hand-made", 2, records, {})


def _show_pairs(value):
    return show(sorted(value) if isinstance(value, (list, set)) else value)


def skipped_decodes(fn: Callable) -> Verdict:
    """Check ``fn(trace) -> [(step index, request id), ...]``: the steps a decoding request had no row in."""

    def compare(got, expected):
        if not isinstance(got, (list, tuple, set)):
            return f"return a list of (step index, request id) pairs, not a {type(got).__name__}"
        try:
            pairs = [(int(k), str(r)) for k, r in got]
        except (TypeError, ValueError):
            return "each item should be a pair (step index, request id)"
        if len(set(pairs)) != len(pairs):
            return "a pair appears twice: list each skipped (step, request) once"
        if sorted(pairs) == expected:
            return None
        if extra := sorted(set(pairs) - set(expected)):
            return f"{extra[:3]} are not skips: a request decodes after its first token's step"
        missing = sorted(set(expected) - set(pairs))
        return f"missed {missing[:3]}{' ...' if len(missing) > 3 else ''}"

    wrong = _fake_trace(_PrefillFirst, 4, 12, 3)
    hand = [([], {"a": [5]}), (["a"], {"a": [6], "b": [9]}), (["a"], {"a": [7]})]
    hand += [(["a", "b"], {"a": [8], "b": [3]}), (["b"], {"b": [4]})]
    once = _hand_trace(([], {"a": [1], "b": [2]}), (["a"], {"a": [3]}), (["a"], {"a": [4]}))
    right = _fake_trace(StallFreeScheduler, 4, 12, 3)
    rows = [
        ("a stall-free run on the fake model (B=4, budget 12): nobody is skipped", right),
        ("a hand-made trace: b gets its first token in step 1, no decode row in step 2", _hand_trace(*hand)),
        ("a request that got only one token is never skipped", once),
        (f"a wrong policy, prefill first (B=4, budget 12): {len(_skipped(wrong))} skipped decodes", wrong),
    ]
    hint = "a request is decoding from the step after its first token to the step of its last"
    return table("skipped_decodes", fn, rows, _skipped, lambda trace: compare, hint, show=_show_pairs)


def fused_saving(fn: Callable) -> Verdict:
    """Check ``fn(chunk_alone_s, decode_alone_s, fused_s) -> fraction``."""
    rows = [
        ("a small chunk: chunk 0.10 s, decodes 0.10 s, fused 0.12 s", 0.10, 0.10, 0.12),
        ("a big chunk: chunk 0.46 s, decodes 0.11 s, fused 0.54 s", 0.46, 0.11, 0.54),
        ("fusing slower than the two passes: 0.2 s + 0.1 s against 0.33 s", 0.2, 0.1, 0.33),
        ("the decode rows free: chunk 0.3 s, decodes 0.1 s, fused 0.3 s", 0.3, 0.1, 0.3),
    ]

    def judge(c, d, f):
        alone = "that compares with the chunk pass alone; the saving is against BOTH separate passes"
        share = "that is the fused time as a share of the separate time: 1 minus that"
        percent = "that looks like a percentage: return a fraction (0.25, not 25)"
        return number_compare(
            mistakes((1 - f / c, alone), (f / (c + d), share), (100 * (1 - f / (c + d)), percent))
        )

    hint = "separate = chunk_alone_s + decode_alone_s; saving = 1 - fused_s / separate"
    return table("fused_saving", fn, rows, lambda c, d, f: 1 - f / (c + d), judge, hint)
