"""The one harness every scheduler checker runs on: build an engine around the learner's
class with the public ``make_engine(Cls, ...)`` on the fake model, drive it with the one
workload driver (``driver.run_workload``, whose ``EngineStuck`` is the one stuck
detector), and judge what happened from public behaviour only: the outputs, the trace,
and ``stats()`` (every KV block back at the end). The trace invariants shared by every
kind live here too; each lesson adds the rules of its own kind and compares its schedule
with the library's reference scheduler run on the same workload."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from ..driver import EngineStuck, run_workload
from ..engine import make_engine
from ..fake import FakeModel, FakeRunner, TickClock, reference_output
from ..prompts import clamp_new_tokens
from ..trace import Trace
from ..workloads import Workload, WorkloadRequest
from ._core import Case, _where, table, whole_number_compare

VOCAB = 64
MAX_PASSES = 5000  # far more than any case needs: a scheduler that loops is stopped here


class _TooManyPasses(BaseException):
    """Not an ``Exception``: the engine, which ends a failed pass's requests and goes on,
    does not catch it, so a scheduler that never stops ends the run at once."""


class _BoundedRunner(FakeRunner):
    """The fake runner, refusing to run more than ``MAX_PASSES`` passes: a scheduler that
    keeps yielding passes forever is stopped instead of hanging."""

    def forward(self, chunks):
        if len(self.passes) >= MAX_PASSES:
            raise _TooManyPasses(f"more than {MAX_PASSES} forward passes: the scheduler never stops")
        return super().forward(chunks)


def fake_workload(name: str, rows: list[tuple[int, int]], seed: int = 0) -> Workload:
    """Requests ``r0, r1, ...`` arriving at once, with (prompt length, new tokens) ``rows``
    and random prompt tokens (never 0, the fake model's EOS)."""
    rng = random.Random(seed)
    return Workload(
        name,
        name,
        [
            WorkloadRequest(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(p)], n)
            for i, (p, n) in enumerate(rows)
        ],
        seed,
    )


def random_rows(seed: int, n: int, prompts: tuple[int, int], outputs: tuple[int, int]) -> list[tuple]:
    rng = random.Random(seed)
    return [(rng.randint(*prompts), rng.randint(*outputs)) for _ in range(n)]


# What a learner's mistake looks like when the engine trips over it, and what to say.
SLOT_TAKEN = "every decode slot is taken"


@dataclass
class Run:
    """One run of a scheduler class: its trace (the steps up to where it broke off, if it
    did), why it broke off, and how many KV blocks were still held at the end."""

    trace: Trace | None
    problem: str | None = None
    blocks_held: int = 0
    preemptions: int = 0


def run_piece(
    cls,
    workload: Workload,
    *,
    max_seq_len: int | None = None,
    hints: dict | None = None,
    priorities: dict | None = None,
    **options,
) -> Run:
    """``workload`` on a fake-model engine built around ``cls`` with ``options`` (those of
    ``make_engine``: the scheduler's own, ``num_kv_blocks``, ``kv_block_size``...).
    ``hints`` say what to tell the learner when the run breaks off: ``"memory"`` (the KV
    pool ran dry: a ``MemoryError``), ``"slot"`` (``take_slot`` found no free slot),
    ``"stuck"`` (steps that run nothing)."""
    hints = hints or {}
    try:
        engine = make_engine(
            cls,
            FakeModel(vocab_size=VOCAB, max_seq_len=4096),
            runner=_BoundedRunner,
            clock=TickClock(),
            max_seq_len=max_seq_len,
            **options,
        )
    except Exception as e:
        return Run(None, f"make_engine could not build an engine from your class: {type(e).__name__}: {e}")
    problem = None
    try:
        trace = run_workload(engine, workload, progress=False, priorities=priorities)
    except NotImplementedError:
        raise  # "not written yet": run_cases says so
    except EngineStuck as e:
        trace, problem = engine.trace, f"the engine got stuck: {e}" + _then(hints.get("stuck"))
    except _TooManyPasses as e:
        trace, problem = engine.trace, f"{e} (does batches() yield passes with nothing in them?)"
    except MemoryError as e:
        trace, problem = (
            engine.trace,
            (
                f"the KV pool ran out ({num_blocks(engine)} blocks): "
                f"MemoryError: {e}{_where(e)}" + _then(hints.get("memory"))
            ),
        )
    except Exception as e:
        why = hints.get("slot") if SLOT_TAKEN in str(e) else None
        trace, problem = (
            engine.trace,
            (f"your scheduler raised {type(e).__name__}: {e}{_where(e)}" + _then(why)),
        )
    stats = engine.stats()
    return Run(trace, problem, stats["num_kv_blocks"] - stats["free_kv_blocks"], stats["preemptions"])


def num_blocks(engine) -> int:
    return engine.stats()["num_kv_blocks"]


def _then(hint: str | None) -> str:
    return f"; {hint}" if hint else ""


# ---------------------------------------------------------------------------------------
# Trace invariants every kind keeps. Each returns None, or what broke, in words.


def output_problem(trace: Trace, workload: Workload, max_seq_len: int = 4096) -> str | None:
    """Every request's output equals what the fake model must produce for it."""
    for r in workload:
        want = reference_output(
            r.prompt_ids, clamp_new_tokens(r.prompt_len, r.max_new_tokens, max_seq_len), VOCAB, frozenset()
        )
        rec = trace.requests[r.id]
        if rec.finish_reason == "error":
            return f"{r.id} ended with an error in a forward pass (see the log above)"
        got = list(rec.output_ids)
        if len(got) > len(want) and got[: len(want)] == want:
            return (
                f"{r.id} should have finished after {len(want)} tokens but produced {len(got)}: "
                f"a finished request went on decoding"
            )
        if got != want and got == want[: len(got)]:
            return (
                f"{r.id} got only {len(got)} of its {len(want)} tokens: it must keep "
                f"decoding until it finishes"
            )
        if got != want:
            return (
                f"{r.id} (prompt of {r.prompt_len} tokens) produced {len(rec.output_ids)} tokens "
                f"{list(rec.output_ids)[:6]}..., the model's answer is {len(want)} tokens "
                f"{want[:6]}...: a prompt token was skipped, repeated or never sampled"
            )
    return None


def slot_problem(trace: Trace, B: int | None = None, rectangular: bool = False) -> str | None:
    """No decode slot holds two requests at once, nor (unless ``rectangular``: a static
    batch keeps its finished rows) a request that has finished, nor more than B slots."""
    finished: set[str] = set()
    for step in trace.steps:
        if B is not None and len(step.slots) > B:
            return f"step {step.index} has {len(step.slots)} slots, more than B = {B}"
        stale = sorted(finished & set(step.slots))
        if stale and not rectangular:
            return f"step {step.index}: {stale[0]} finished earlier but still holds a slot"
        finished |= set(step.finished)
        held = [rid for rid in step.slots if rid is not None]
        if len(held) != len(set(held)):
            return f"step {step.index}: a request sits in two slots at once ({step.slots})"
        by_slot: dict[int, str] = {}
        for rid, slot in step.slot_of.items():
            if by_slot.setdefault(slot, rid) != rid:
                return f"step {step.index}: slot {slot} was given to both {by_slot[slot]} and {rid}"
    return None


def prefill_chunks(trace: Trace) -> dict[str, list[tuple[int, int, int]]]:
    """Each request's prefill chunks, in order, as (step index, start, length)."""
    chunks: dict[str, list[tuple[int, int, int]]] = {}
    for step in trace.steps:
        for rid, start, n in step.prefill:
            chunks.setdefault(rid, []).append((step.index, start, n))
    return chunks


def early_decode_problem(trace: Trace, workload: Workload) -> str | None:
    """Nobody decodes before its whole prompt is prefilled (a preempted request starts over)."""
    prompt_len = {r.id: r.prompt_len for r in workload}
    done: dict[str, int] = {}
    reached: dict[str, int] = {}  # the furthest any prefill got (a preempted request starts over)
    for step in trace.steps:
        for rid, start, n in step.prefill:  # a step's chunks run before (or with) its decode rows
            done[rid] = start + n
            reached[rid] = max(reached.get(rid, 0), start + n)
        for rid in step.decoded:
            if done.get(rid, 0) < prompt_len.get(rid, 0):
                return (
                    f"step {step.index}: {rid} ran a decode row with only {done.get(rid, 0)} of "
                    f"its {prompt_len[rid]} prompt tokens prefilled (its last chunk never ran)"
                )
    for rid, rec in trace.requests.items():  # also a move the engine had no step to record
        moved = [state for _, state in rec.state_times if state in ("awaiting_slot", "decoding")]
        if moved and reached.get(rid, 0) < prompt_len.get(rid, 0):
            return (
                f"{rid} went on to {moved[0].replace('_', ' a ')} with only {reached.get(rid, 0)} of "
                f"its {prompt_len[rid]} prompt tokens prefilled (its last chunk never ran)"
            )
    return None


def gap_problem(trace: Trace, workload: Workload) -> str | None:
    """Each prompt is prefilled in order: chunks start where the last one ended (or at 0,
    after a preemption), and the last covers the prompt exactly."""
    chunks = prefill_chunks(trace)
    for r in workload:
        at = 0
        preempted = {s.index for s in trace.steps if r.id in s.preempted}
        for index, start, n in chunks.get(r.id, []):
            if any(p < index for p in preempted):
                at, preempted = start, {p for p in preempted if p >= index}  # recomputed from here
            if n < 1:
                return f"step {index}: a chunk of {n} tokens for {r.id} (a chunk has at least one token)"
            if start != at:
                return (
                    f"step {index}: {r.id}'s chunk starts at token {start}, but its prefill had "
                    f"reached token {at} (a {'gap' if start > at else 'repeat'})"
                )
            at += n
        if at < r.prompt_len:
            return f"{r.id}'s chunks cover {at} of its {r.prompt_len} prompt tokens"
    return None


def state_problem(trace: Trace, set_decoding: str) -> str | None:
    """Every request that ran a decode row had entered the decoding state first (the
    trace records each request's states); ``set_decoding`` says where that happens."""
    for step in trace.steps:
        for rid in step.decoded:
            entered = [s for t, s in trace.requests[rid].state_times if t <= step.end_s]
            if "decoding" not in entered:
                return (
                    f"step {step.index}: {rid} ran a decode row but its state was never set to "
                    f"DECODING (it is still {entered[-1] if entered else 'queued'}): {set_decoding}"
                )
    return None


def blocks_problem(run: Run) -> str | None:
    if run.blocks_held:
        return (
            f"at the end {run.blocks_held} KV block(s) were still held: every request that "
            f"leaves must give its blocks back"
        )
    return None


def piece_case(label: str, judge: Callable[[type], str | None], hint: str = "") -> Case:
    """A case whose answer is "ok" or the first problem ``judge(cls)`` finds."""
    return Case(
        label,
        lambda cls: judge(cls) or "ok",
        "ok",
        lambda got, expected: None if got == "ok" else got,
        hint,
        show=lambda got: "runs as it should" if got == "ok" else "a problem (below)",
    )


def piece_judge(
    base: type,
    reference: type,
    workload: Workload,
    checks,
    *,
    broken=(),
    schedule=None,
    hints: dict | None = None,
    **options,
) -> Callable[[type], str | None]:
    """A judge for ``piece_case``: ``workload`` on the learner's class (refused unless a subclass of
    ``base``) with ``options``; the first problem of ``checks`` (each ``check(trace)``), then of
    ``schedule(trace, reference's trace)``, then a block still held. A run that broke off says why,
    after any of ``broken``'s checks that name the cause better."""
    ref = run_piece(reference, workload, **options).trace if schedule else None

    def judge(cls):
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"pass your scheduler class (a subclass of {base.__name__}), not {cls!r}")
        run = run_piece(cls, workload, hints=hints, **options)
        first = next(
            filter(None, (check(run.trace) for check in (broken if run.problem else checks) if run.trace)),
            None,
        )
        if run.problem:
            return first or run.problem
        return first or (schedule and schedule(run.trace, ref)) or blocks_problem(run)

    return judge


def pressure_case(
    label: str,
    judge: Callable[[type], str | None],
    reference: type,
    workload: Workload,
    must_preempt: bool,
    hint: str = "",
    **options,
) -> Case:
    """A case run in a KV pool small enough to matter (``options`` give ``num_kv_blocks``).
    The scenario is checked on the reference first: if it does not preempt where it
    must, the case itself is wrong (so a pass never counts a scenario it did not see)."""
    ref = run_piece(reference, workload, **options)
    if ref.problem or (must_preempt and not ref.preemptions):
        raise AssertionError(
            f"checker case {label!r}: the reference run did not show the scenario "
            f"({ref.problem or 'no preemption'})"
        )
    return piece_case(label, judge, hint)


def schedule_problem(
    got: Trace, expected: Trace, key: Callable, words: Callable, hint: Callable | None = None
) -> str | None:
    """The first step where the learner's trace differs from the reference's (``key(step)``
    is what must match), told as ``words(step, other)``; ``hint(got_step, expected_step)``
    may explain it."""
    for g, e in zip(got.steps, expected.steps):
        if key(g) != key(e):
            why = hint(g, e) if hint else None
            return (
                f"step {g.index} differs.\n      expected: {words(e, g)}\n"
                f"      got:      {words(g, e)}" + (f"\n    {why}" if why else "")
            )
    if len(got.steps) != len(expected.steps):
        return f"your run took {len(got.steps)} steps, the reference's {len(expected.steps)}"
    return None


MIXED_OUTPUTS = [42, 37, 38, 61, 20, 53, 44, 4, 28, 56, 37, 6, 50, 48, 55, 14]  # the mixed workload's


def count_exercise(name: str, fn, rows, truth: Callable, diagnose: Callable, hint: str):
    """A count ``fn(output_lens, B) -> int`` (lessons 1 and 2) on rows of (label, output_lens, B):
    the right count is ``truth(lens, B)``, read off a library run; ``diagnose(lens, B, got, expected)``."""
    return table(
        name,
        fn,
        rows,
        truth,
        lambda lens, B: whole_number_compare(lambda got, want: diagnose(lens, B, got, want)),
        hint,
    )
