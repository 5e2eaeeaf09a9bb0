"""The harness of the scheduler checkers: the learner's class in a fake-model engine, judged by its trace."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Callable

from ...measurement.driver import EngineStuck, run_workload
from ...core.engine import make_engine
from ...core.fake import FakeModel, FakeRunner, TickClock, greedy_output, reference_output
from ...core.request import Request, clamp_new_tokens
from ...core.scheduler import Batch, Scheduler
from ...core.trace import Trace
from ...measurement.workloads import Workload, WorkloadRequest
from ..guard import describe, kind_of, ours
from ._core import Case, Differs, WrongType, _where, show, table, whole_number_compare

VOCAB = 64
MAX_PASSES = 5000  # far more than any case needs: a scheduler that loops is stopped here
HELD = "KV block(s) were still held: a request leaving gives them back"


class _TooManyPasses(BaseException):
    """Not an ``Exception``, so the engine (which survives a failed pass) does not catch it."""


class _BoundedRunner(FakeRunner):
    """The fake runner, refusing to run more than ``MAX_PASSES`` passes."""

    def forward(self, chunks, head_rows=None):
        if len(self.passes) >= MAX_PASSES:
            raise _TooManyPasses(f"more than {MAX_PASSES} forward passes: the scheduler never stops")
        return super().forward(chunks, head_rows)


@functools.cache
def bounded(runner: type[FakeRunner] | None) -> type[FakeRunner]:
    """``runner`` (a ``FakeRunner`` of another model, e.g. ``fake.EchoRunner``; None: the fake's
    own), refusing to run more than ``MAX_PASSES`` passes."""
    if runner is None or issubclass(runner, _BoundedRunner):
        return _BoundedRunner
    return type(f"Bounded{runner.__name__}", (_BoundedRunner, runner), {})


def fake_workload(name: str, rows: list[tuple[int, int]], seed: int = 0) -> Workload:
    """Requests ``r0, r1, ...`` arriving at once, (prompt length, new tokens) ``rows``, no token 0 (EOS)."""
    rng = random.Random(seed)
    reqs = [
        WorkloadRequest(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(p)], n)
        for i, (p, n) in enumerate(rows)
    ]
    return Workload(name, name, reqs, seed)


def random_rows(seed: int, n: int, prompts: tuple[int, int], outputs: tuple[int, int]) -> list[tuple]:
    rng = random.Random(seed)
    return [(rng.randint(*prompts), rng.randint(*outputs)) for _ in range(n)]


@dataclass
class Run:
    """One run: its trace (up to where it broke off), why it broke off, the KV blocks still held."""

    trace: Trace | None
    problem: str | None = None
    blocks_held: int = 0
    preemptions: int = 0
    first_error: str | None = None  # the first failed forward pass's exception, in words


def run_piece(
    cls, workload: Workload, *, max_seq_len=None, hints=None, priorities=None, runner=None, **options
) -> Run:
    """``workload`` on a fake-model engine around ``cls``; ``hints`` for a "memory", "slot", "stuck" error;
    ``runner``: a test model of ``core.fake`` in place of the fake's own (``FakeRunner``)."""
    hints = hints or {}
    try:
        options.update(runner=bounded(runner), clock=TickClock(), max_seq_len=max_seq_len)
        engine = make_engine(cls, FakeModel(vocab_size=VOCAB, max_seq_len=4096), **options)
    except NotImplementedError:
        raise  # an unwritten __init__: "not written yet"
    except Exception as e:
        return Run(None, f"make_engine could not build an engine from your class: {type(e).__name__}: {e}")
    if type(engine.scheduler).passes is Scheduler.passes:  # what it yields is checked as it comes
        engine.scheduler.passes = partial(checked_passes, engine.scheduler)
    problem = None
    try:
        with _quiet_log():  # a raising scheduler is logged by the engine; the verdict says it here
            trace = run_workload(engine, workload, progress=False, priorities=priorities)
    except NotImplementedError:
        raise  # "not written yet": run_cases says so
    except EngineStuck as e:
        trace, problem = engine.trace, f"the engine got stuck: {e}" + _then(hints.get("stuck"))
    except _TooManyPasses as e:
        trace, problem = engine.trace, f"{e} (does batches() yield passes with nothing in them?)"
    except WrongType as e:
        trace, problem = engine.trace, str(e)
    except MemoryError as e:
        blocks = engine.stats()["num_kv_blocks"]
        why = f"the KV pool ran out ({blocks} blocks): MemoryError: {e}{_where(e)}"
        trace, problem = engine.trace, why + _then(hints.get("memory"))
    except Exception as e:
        why = _then(hints.get("slot") if "every decode slot is taken" in str(e) else None)  # take_slot's
        trace, problem = engine.trace, f"your scheduler raised {type(e).__name__}: {e}{_where(e)}{why}"
    stats = engine.stats()
    e = engine.first_error
    error = None if e is None else f"{type(e).__name__}: {e}"
    return Run(trace, problem, stats["num_kv_blocks"] - stats["free_kv_blocks"], stats["preemptions"], error)


def _then(hint: str | None) -> str:
    return f"; {hint}" if hint else ""


def checked_passes(scheduler: Scheduler):
    """``Scheduler.passes`` (each pass given its KV memory by ``grow``), refusing with words
    (``WrongType``) what is not a ``Batch`` of requests."""
    scheduler.preempted = []
    planned = scheduler.batches()
    if not isinstance(planned, Iterable):
        where = f"{type(scheduler).__name__}.batches"
        why = "write it as a generator: `yield Batch(...)` for each forward pass"
        raise WrongType(f"{where} returned {show(planned)} ({kind_of(planned)}), not passes: {why}")

    def checked():
        for batch in planned:
            problem = batch_problem(batch)
            if problem:
                raise WrongType(f"{_yielder(planned, scheduler)} yielded {problem}")
            yield batch

    try:
        yield from scheduler.runnable(checked())
    finally:
        getattr(planned, "close", lambda: None)()


def _yielder(planned, scheduler) -> str:
    """The learner's generator that yielded last: the innermost of ``planned``'s ``yield from`` chain."""
    found, gen = None, planned
    while gen is not None and hasattr(gen, "gi_code"):
        if gen.gi_frame is not None and not ours(gen.gi_code.co_filename):
            found = gen
        gen = gen.gi_yieldfrom
    return (
        describe(found.gi_code, found.gi_frame.f_lineno, found.gi_frame)
        if found
        else f"{type(scheduler).__name__}.batches"
    )


def batch_problem(batch) -> str | None:
    """What is not a ``Batch`` of requests about ``batch``, in words (None: it is one)."""
    if not isinstance(batch, Batch):
        return f"{_brief(batch)} ({kind_of(batch)}), not a Batch: yield Batch(decode=..., prefill=...)"
    for name in ("decode", "padding"):
        rows = getattr(batch, name)
        if not isinstance(rows, (list, tuple)):
            return f"a Batch whose {name} is {_brief(rows)} ({kind_of(rows)}), not a list of requests"
        odd = next((r for r in rows if not isinstance(r, Request)), None)
        if odd is not None:
            return f"a Batch whose {name} holds {_brief(odd)} ({kind_of(odd)}), not a request"
    if not isinstance(batch.prefill, (list, tuple)):
        return f"a Batch whose prefill is {_brief(batch.prefill)}, not a list of (request, tokens) pairs"
    for item in batch.prefill:
        pair = isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Request)
        if not (pair and isinstance(item[1], int) and not isinstance(item[1], bool)):
            return (
                f"a Batch whose prefill holds {_brief(item)}: each item is a pair (request, number of tokens)"
            )
    return None


def _brief(value, depth: int = 0) -> str:
    """``show``, with a request as ``<request r0>`` (its whole record is pages long)."""
    if isinstance(value, Request):
        return f"<request {value.id}>"
    if depth < 2 and isinstance(value, (list, tuple)) and len(value) <= 8:
        inner = ", ".join(_brief(v, depth + 1) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if depth < 2 and isinstance(value, dict) and len(value) <= 8:
        return "{" + ", ".join(f"{k!r}: {_brief(v, depth + 1)}" for k, v in value.items()) + "}"
    return show(value)


# ---------------------------------------------------------------------------------------
# Trace invariants every kind keeps. Each returns None, or what broke, in words.


def output_problem(trace: Trace, workload: Workload, max_seq_len: int = 4096) -> str | None:
    """Every request's output equals what the fake model must produce for it."""
    for r in workload:
        new = clamp_new_tokens(r.prompt_len, r.max_new_tokens, max_seq_len)
        want, rec = reference_output(r.prompt_ids, new, VOCAB, frozenset()), trace.requests[r.id]
        if rec.finish_reason == "error":
            return f"{r.id} ended with an error in a forward pass (see the log above)"
        got = list(rec.output_ids)
        if len(got) > len(want) and got[: len(want)] == want:
            return f"{r.id} should have finished after {len(want)} tokens but produced {len(got)}"
        if got != want and got == want[: len(got)]:
            return f"{r.id} got only {len(got)} of its {len(want)} tokens: it must decode until it finishes"
        if got != want:
            why = "a prompt token was skipped, repeated or never sampled"
            return f"{r.id} produced {got[:6]}..., the model's answer is {want[:6]}...: {why}"
    return None


def slot_problem(trace: Trace, B: int | None = None, rectangular: bool = False) -> str | None:
    """No slot holds two requests, nor (unless ``rectangular``, static) a finished one; at most B slots."""
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
    done, reached = {}, {}  # reached: the furthest any prefill got (a preempted request starts over)
    for step in trace.steps:
        for rid, start, n in step.prefill:  # a step's chunks run before (or with) its decode rows
            done[rid] = start + n
            reached[rid] = max(reached.get(rid, 0), start + n)
        for rid in step.decoded:
            if done.get(rid, 0) < prompt_len.get(rid, 0):
                have = f"{done.get(rid, 0)} of its {prompt_len[rid]} prompt tokens"
                return f"step {step.index}: {rid} decoded with only {have} (its last chunk never ran)"
    for rid, rec in trace.requests.items():  # also a move the engine had no step to record
        moved = [state for _, state in rec.state_times if state in ("awaiting_slot", "decoding")]
        if moved and reached.get(rid, 0) < prompt_len.get(rid, 0):
            have = f"{reached.get(rid, 0)} of its {prompt_len[rid]} prompt tokens"
            state = moved[0].replace("_", " a ")
            return f"{rid} went on to {state} with only {have} (its last chunk never ran)"
    return None


def gap_problem(trace: Trace, workload: Workload) -> str | None:
    """Each prompt is prefilled in order, chunk after chunk (from 0 again after a preemption)."""
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
                what = "gap" if start > at else "repeat"
                return f"step {index}: {r.id}'s chunk starts at token {start}, its prefill at {at} (a {what})"
            at += n
        if at < r.prompt_len:
            return f"{r.id}'s chunks cover {at} of its {r.prompt_len} prompt tokens"
    return None


def state_problem(trace: Trace, set_decoding: str) -> str | None:
    """Every request that ran a decode row was DECODING first; ``set_decoding`` says where that happens."""
    for step in trace.steps:
        for rid in step.decoded:
            entered = [s for t, s in trace.requests[rid].state_times if t <= step.end_s]
            if "decoding" not in entered:
                still = f"DECODING (it is still {entered[-1] if entered else 'queued'}): {set_decoding}"
                return f"step {step.index}: {rid} ran a decode row but its state was never set to {still}"
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


def piece_judge(base, reference, workload, checks, *, broken=(), schedule=None, hints=None, **options):
    """A judge: ``workload`` on the learner's ``base`` subclass; the first problem of ``checks`` (``broken``
    if the run broke off), ``schedule(trace, reference trace)``, a block still held."""
    ref = run_piece(reference, workload, **options).trace if schedule else None

    def judge(cls):
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"pass your scheduler class (a subclass of {base.__name__}), not {cls!r}")
        run = run_piece(cls, workload, hints=hints, **options)
        found = [check(run.trace) for check in (broken if run.problem else checks) if run.trace]
        first = next((p for p in found if p and not isinstance(p, Differs)), None)  # a broken rule
        held = run.blocks_held and f"at the end {run.blocks_held} {HELD}"
        if first or run.problem or held:
            return first or run.problem or held  # else a broken-off run's problem
        # the contract holds: where the rule is another than the lesson's, that is no mistake
        other = next((p for p in found if p), None) or (schedule and schedule(run.trace, ref))
        return Differs(other) if other else None

    judge.scenario = (reference, workload, options)  # for memory_case
    return judge


def memory_case(label: str, judge: Callable, must_preempt: bool, hint: str = "") -> Case:
    """A ``piece_judge`` case on a small KV pool: its reference must show the scenario (preempt if told)."""
    reference, workload, options = judge.scenario
    ref = run_piece(reference, workload, **options)
    if ref.problem or (must_preempt and not ref.preemptions):
        why = ref.problem or "no preemption"
        raise AssertionError(f"checker case {label!r}: the reference run did not show the scenario ({why})")
    return piece_case(label, judge, hint)


def schedule_problem(got: Trace, expected: Trace, key: Callable, words: Callable, hint=None) -> str | None:
    """The first step whose ``key`` differs from the reference's, told by ``words``, explained by
    ``hint``. Used for the verdict's second level (``Differs``): where a learner's rule parts from
    the lesson's, once the contract holds."""
    for g, e in zip(got.steps, expected.steps):
        if key(g) != key(e):
            why = hint(g, e) if hint else None
            return (
                f"step {g.index} is not the lesson's.\n      the lesson's rule: {words(e, g)}\n"
                f"      yours:            {words(g, e)}" + (f"\n    {why}" if why else "")
            )
    if len(got.steps) != len(expected.steps):
        return f"your run took {len(got.steps)} steps, the lesson's rule {len(expected.steps)}"
    return None


MIXED_OUTPUTS = [42, 37, 38, 61, 20, 53, 44, 4, 28, 56, 37, 6, 50, 48, 55, 14]  # the mixed workload's


def count_exercise(name: str, fn, rows, truth: Callable, diagnose: Callable, hint: str):
    """A count ``fn(output_lens, B) -> int`` on rows (label, lens, B); the answer ``truth(lens, B)``."""

    def judge(lens, B):
        return whole_number_compare(lambda got, want: diagnose(lens, B, got, want))

    return table(name, fn, rows, truth, judge, hint)


# ---------------------------------------------------------------------------------------
# The finishing rules and a fault: requests submitted one by one (EOS on), judged by outcome.


def _prompt_ending_at(index: int, seed: int, stop: int = 0) -> list[int]:
    """A prompt whose fake answer has ``stop`` first at position ``index`` (0: the prefill's token)."""
    rng = random.Random(seed)
    while True:
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 12))]
        out = reference_output(prompt, index + 1, VOCAB, frozenset())
        if out[-1] == stop and stop not in out[:-1]:
            return prompt


@dataclass(frozen=True)
class Ask:
    """One request of a finishing case: what ``submit`` gets, and the rule it tests, in words."""

    why: str
    prompt: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    stop_token_ids: tuple = ()

    def options(self) -> dict:
        """``submit``'s arguments after the prompt."""
        return dict(
            max_new_tokens=self.max_new_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids
        )

    def expected(self, max_seq_len: int, runner: type[FakeRunner] | None = None) -> tuple[list[int], str]:
        """Its tokens and finish reason on the fake model, or on ``runner``'s."""
        stops = frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else {0})
        new = clamp_new_tokens(len(self.prompt), self.max_new_tokens, max_seq_len)
        if runner is None:
            out = reference_output(self.prompt, new, VOCAB, stops)
        else:
            out = greedy_output(runner, self.prompt, new, stops, FakeModel(vocab_size=VOCAB))
        return out, "stop" if out[-1] in stops else "length"


def finishing_asks(seed: int = 0) -> list[Ask]:
    """The finishing rules at their edges (EOS is token 0 of the fake model)."""
    eos_first, eos_fourth = _prompt_ending_at(0, seed), _prompt_ending_at(3, seed + 1)
    plain = [(7 * i + seed) % (VOCAB - 1) + 1 for i in range(9)]
    stop_at = reference_output(plain, 6, VOCAB, frozenset())
    stop = next(t for i, t in enumerate(stop_at) if i >= 2 and t not in stop_at[:i] and t != 0)
    return [
        Ask("its first token, made by its prefill, is EOS: it ends at once with 'stop'", eos_first, 8),
        Ask("its 4th token is EOS: 'stop' after 4 tokens", eos_fourth, 10),
        Ask("ignore_eos: the same prompt runs past EOS to max_new_tokens=6", eos_fourth, 6, ignore_eos=True),
        Ask(f"stop_token_ids=[{stop}] ends it on that token with 'stop'", plain, 9, True, (stop,)),
        Ask("max_new_tokens=1: the prefill's token is its last ('length')", plain[:5], 1, True),
        Ask("exactly max_new_tokens=7 tokens, then 'length'", plain[2:], 7, True),
    ]


def finishing_problem(
    cls, asks: list[Ask], max_seq_len=4096, fail_pass=None, model_runner=None, then=None, **options
):
    """``asks`` submitted together to a fake-model engine around ``cls``; the first request whose
    tokens or finish reason differ, in words (None: all right). ``fail_pass``: that forward pass
    raises, and the requests it carried must end with "error" while the rest run on. ``model_runner``:
    a test runner of ``core.fake`` in place of the fake's own; ``then(engine)``: a last check of the
    finished run (what is wrong, or None)."""
    runner = bounded(model_runner) if fail_pass is None else partial(_FaultyRunner, fail_pass)
    try:
        model = FakeModel(vocab_size=VOCAB, max_seq_len=max_seq_len)
        engine = make_engine(cls, model, runner=runner, clock=TickClock(), max_seq_len=max_seq_len, **options)
    except NotImplementedError:
        raise
    except Exception as e:
        return f"make_engine could not build an engine from your class: {type(e).__name__}: {e}"
    if type(engine.scheduler).passes is Scheduler.passes:
        engine.scheduler.passes = partial(checked_passes, engine.scheduler)
    quiet = contextlib.nullcontext() if fail_pass is None else _quiet_log()
    ids = [engine.submit(a.prompt, **a.options()) for a in asks]
    try:
        with quiet:
            idle = 0  # steps in a row that ran no pass while requests waited
            while engine.step():
                idle = 0 if engine.trace.steps[-1].passes else idle + 1
                if idle > 3:
                    return "the engine got stuck: batches() yields nothing while requests wait"
    except (NotImplementedError, _TooManyPasses):
        raise
    except WrongType as e:
        return str(e)
    except Exception as e:
        return f"your scheduler raised {type(e).__name__}: {e}{_where(e)}"
    failed = {rid for s in engine.trace.steps for rid, why in s.finished.items() if why == "error"}
    for rid, ask in zip(ids, asks):
        rec = engine.trace.requests[rid]
        want, reason = ask.expected(max_seq_len, model_runner)
        if rid in failed:
            continue  # its pass was the faulty one
        if rec.finish_reason is None:
            return f"{rid} ({ask.why}) never finished: it has {len(rec.output_ids)} tokens"
        got = list(rec.output_ids)
        if got != want or rec.finish_reason != reason:
            said = f"{rid} ({ask.why}) produced {got[:10]} and ended {rec.finish_reason!r}"
            return f"{said}; expected {want[:10]} ending {reason!r}"
    if fail_pass is not None and not failed:
        return (
            f"the faulty pass (pass {fail_pass}) carried no request, or its requests did not end with 'error'"
        )
    stats = engine.stats()
    held = stats["num_kv_blocks"] - stats["free_kv_blocks"]
    busy = [r for r in engine.scheduler.slots if r is not None]
    if held:
        return f"at the end {held} {HELD}"
    if busy or engine.scheduler.running or engine.scheduler.queue:
        return f"at the end requests were still in the scheduler: slots {[r.id for r in busy]}"
    return then(engine) if then is not None else None


@contextlib.contextmanager
def _quiet_log():
    """The engine logs a failed pass with its traceback; the checker's own fault needs no page of it."""
    log = logging.getLogger("batchlab")
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


class _FaultyRunner(_BoundedRunner):
    """The fake runner whose ``fail_pass``-th forward pass (from 1) raises, as a real device fault would."""

    def __init__(self, fail_pass: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_pass = fail_pass

    def forward(self, chunks, head_rows=None):
        if len(self.passes) + 1 == self.fail_pass:
            self.passes.append(chunks)
            raise RuntimeError("an injected fault in this forward pass (the checker's)")
        return super().forward(chunks, head_rows)


def finishing_cases(max_batch_size: int, seed: int = 0, hint: str = "") -> list[Case]:
    """The finishing rules' cases and a fault's, for any scheduler kind."""
    asks = finishing_asks(seed)
    long_prompt = [(3 * i + seed) % (VOCAB - 1) + 1 for i in range(60)]
    edge = [
        Ask("a 60-token prompt with max_seq_len=64: 4 tokens, then 'length'", long_prompt, 10, True),
        Ask(
            "a 63-token prompt with max_seq_len=64: 1 token, then 'length'", long_prompt + [5, 6, 7], 10, True
        ),
    ]
    B = max_batch_size
    rules = (
        "finish_reason: 'stop' on a token in req.stop_ids, 'length' at req.max_new_tokens tokens, else None"
    )
    return [
        piece_case(
            "finishing rules: EOS first, EOS 4th, ignore_eos, a stop token, 1 and 7 tokens",
            lambda cls: finishing_problem(cls, asks, max_batch_size=B),
            hint or rules,
        ),
        piece_case(
            "finishing rules: max_seq_len=64 cuts a 60- and a 63-token prompt's outputs",
            lambda cls: finishing_problem(cls, edge, 64, max_batch_size=B),
            hint or rules,
        ),
        piece_case(
            "a fault: the 2nd forward pass raises; its requests end 'error', the rest run on",
            lambda cls: finishing_problem(cls, asks, fail_pass=2, max_batch_size=B),
            "a pass that fails ends its requests (the base's fail); keep no request of your own",
        ),
    ]
