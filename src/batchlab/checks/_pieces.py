"""Running a learner's engine piece (a scheduler class) on the fake model, for the checkers
of lessons 4 and 5: build the engine through the public ``make_engine(Cls, ...)``, drive it
with the one workload driver, and read what happened from the trace only (outputs, chunks,
slots, passes), never from the scheduler's private state."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from ..engine import make_engine
from ..fake import FakeModel, FakeRunner, TickClock, reference_output
from ..prompts import clamp_new_tokens
from ..trace import Trace
from ..driver import EngineStuck, run_workload
from ..workloads import Workload, WorkloadRequest
from ._core import Case, _where

VOCAB = 64
MAX_PASSES = 5000  # far more than any case needs: a scheduler that loops is stopped here


class _BoundedRunner(FakeRunner):
    """The fake runner, refusing to run more than ``MAX_PASSES`` passes: a scheduler that
    keeps yielding passes forever ends its requests with an error instead of hanging."""

    def forward(self, chunks):
        if len(self.passes) >= MAX_PASSES:
            raise RuntimeError(f"more than {MAX_PASSES} forward passes: the scheduler never stops")
        return super().forward(chunks)


def fake_workload(name: str, rows: list[tuple[int, int]], seed: int = 0) -> Workload:
    """Requests ``r0, r1, ...`` arriving at once, with (prompt length, new tokens) ``rows``
    and random prompt tokens (never 0, the fake model's EOS)."""
    rng = random.Random(seed)
    return Workload(name, name, [WorkloadRequest(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(p)], n)
                                 for i, (p, n) in enumerate(rows)], seed)


def random_rows(seed: int, n: int, prompts: tuple[int, int], outputs: tuple[int, int]) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(*prompts), rng.randint(*outputs)) for _ in range(n)]


@dataclass
class Run:
    """One run of a scheduler class: its trace and, if the run broke off, why (the trace
    then holds the steps up to there)."""

    trace: Trace | None
    problem: str | None = None


def run_piece(cls, workload: Workload, max_seq_len: int | None = None, **options) -> Run:
    """``workload`` on a fake-model engine built around ``cls`` with ``options``."""
    try:
        engine = make_engine(cls, FakeModel(vocab_size=VOCAB, max_seq_len=4096), runner=_BoundedRunner,
                             clock=TickClock(), max_seq_len=max_seq_len, **options)
    except Exception as e:
        return Run(None, f"make_engine could not build an engine from your class: {type(e).__name__}: {e}")
    try:
        return Run(run_workload(engine, workload, progress=False))
    except NotImplementedError:
        raise  # "not written yet": run_cases says so
    except EngineStuck as e:
        return Run(engine.trace, f"the engine got stuck: {e}")
    except Exception as e:
        return Run(engine.trace, f"your scheduler raised {type(e).__name__}: {e}{_where(e)}")


def output_problem(trace: Trace, workload: Workload, max_seq_len: int = 4096) -> str | None:
    """Every request's output equals what the fake model must produce for it."""
    for r in workload:
        want = reference_output(r.prompt_ids, clamp_new_tokens(r.prompt_len, r.max_new_tokens, max_seq_len),
                                VOCAB, frozenset())
        rec = trace.requests[r.id]
        if rec.finish_reason == "error":
            return f"{r.id} ended with an error in a forward pass (see the log above)"
        got = list(rec.output_ids)
        if len(got) > len(want) and got[:len(want)] == want:
            return (f"{r.id} should have finished after {len(want)} tokens but produced {len(got)}: "
                    f"a finished request went on decoding")
        if got != want:
            return (f"{r.id} (prompt of {r.prompt_len} tokens) produced {len(rec.output_ids)} tokens "
                    f"{list(rec.output_ids)[:6]}..., the model's answer is {len(want)} tokens "
                    f"{want[:6]}...: a prompt token was skipped, repeated or never sampled")
    return None


def slot_problem(trace: Trace) -> str | None:
    """No decode slot holds two requests at once, nor a request that has finished."""
    finished: set[str] = set()
    for step in trace.steps:
        stale = sorted(finished & set(step.slots))
        if stale:
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
    """Nobody decodes before its whole prompt is prefilled."""
    prompt_len = {r.id: r.prompt_len for r in workload}
    done: dict[str, int] = {}
    for step in trace.steps:
        for rid, _, n in step.prefill:  # a step's chunks run before (or with) its decode rows
            done[rid] = done.get(rid, 0) + n
        for rid in step.decoded:
            if done.get(rid, 0) < prompt_len.get(rid, 0):
                return (f"step {step.index}: {rid} ran a decode row with only {done.get(rid, 0)} of "
                        f"its {prompt_len[rid]} prompt tokens prefilled (its last chunk never ran)")
    for rid, rec in trace.requests.items():  # also a move the engine had no step to record
        moved = [state for _, state in rec.state_times if state in ("awaiting_slot", "decoding")]
        if moved and done.get(rid, 0) < prompt_len.get(rid, 0):
            return (f"{rid} went on to {moved[0].replace('_', ' a ')} with only {done.get(rid, 0)} of "
                    f"its {prompt_len[rid]} prompt tokens prefilled (its last chunk never ran)")
    return None


def gap_problem(trace: Trace, workload: Workload) -> str | None:
    """Each prompt is prefilled once, in order: chunks start where the last one ended, and
    together cover the prompt exactly."""
    chunks = prefill_chunks(trace)
    for r in workload:
        at = 0
        for index, start, n in chunks.get(r.id, []):
            if n < 1:
                return f"step {index}: a chunk of {n} tokens for {r.id} (a chunk has at least one token)"
            if start != at:
                return (f"step {index}: {r.id}'s chunk starts at token {start}, but its prefill had "
                        f"reached token {at} (a {'gap' if start > at else 'repeat'})")
            at += n
        if at != r.prompt_len:
            return f"{r.id}'s chunks cover {at} of its {r.prompt_len} prompt tokens"
    return None


def piece_case(label: str, judge: Callable[[type], str | None], hint: str = "") -> Case:
    """A case whose answer is "ok" or the first problem ``judge(cls)`` finds."""
    return Case(label, lambda cls: judge(cls) or "ok", "ok",
                lambda got, expected: None if got == "ok" else got, hint,
                show=lambda got: "runs as it should" if got == "ok" else "a problem (below)")
