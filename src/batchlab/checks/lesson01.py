"""Checkers for lesson 1 (static batching).

Every checker here runs on the fake model (``batchlab.fake``), so it answers at once.
The right answers are not written down by hand: each case runs the library's own
``StaticScheduler`` on the same requests and compares.

- ``static_scheduler(MyStaticScheduler)``: a ``StaticScheduler`` subclass whose
  ``batches()`` the learner wrote (``my_engine/static.py``), driven by the real ``Engine``
  with the fake model, on small cases and on whole workloads;
- ``wasted_slot_steps(fn)``: ``fn(output_lens, B)``, the slot-steps one static batch wastes;
- ``static_steps(fn)``: ``fn(output_lens, B)``, the engine steps a whole workload takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engine import Engine, make_engine
from ..fake import FakeModel, FakeRunner, reference_output
from ..scheduler import StaticScheduler
from ._core import Case, Verdict, run_cases, whole_number_compare

__all__ = ["static_scheduler", "wasted_slot_steps", "static_steps"]

MAX_STEPS = 2000  # a learner's scheduler that never finishes is stopped here


# ---------------------------------------------------------------------------------------
# Running a scheduler on the fake model and describing what happened.

def fake_engine(scheduler: type, max_batch_size: int, fake: FakeModel | None = None) -> Engine:
    """An engine on the fake model around the scheduler class ``scheduler``."""
    return make_engine(scheduler, fake or FakeModel(), runner=FakeRunner, max_batch_size=max_batch_size)


@dataclass(frozen=True)
class Req:
    """One request of a hand-made case."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    ignore_eos: bool = True


@dataclass
class Run:
    """What an engine did with a list of requests: per step, and per request."""

    steps: list[dict] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, str | None] = field(default_factory=dict)
    stuck: str | None = None  # why the run was stopped before it finished
    free_blocks_left: bool = True  # every KV block free again at the end

    @property
    def padding_rows(self) -> int:
        return sum(len(s["padding"]) for s in self.steps)

    @property
    def padding_tokens(self) -> int:
        return sum(s["padding_tokens"] for s in self.steps)


def run_requests(engine: Engine, reqs: list[Req]) -> Run:
    """Submit ``reqs`` at once and step the engine until it is idle (or stuck)."""
    ids = [engine.submit(list(r.prompt), max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos)
           for r in reqs]
    run = Run()
    while engine.step():
        step = engine.trace.steps[-1]
        run.steps.append({"prefill": [(rid, n) for rid, _, n in step.prefill],
                          "decoded": list(step.decoded), "padding": list(step.padding),
                          "padding_tokens": step.padding_tokens,
                          "slots": [s for s in step.slots],
                          "finished": dict(step.finished)})
        if len(run.steps) >= MAX_STEPS:
            run.stuck = f"the engine was still busy after {MAX_STEPS} steps"
            break
        recent = run.steps[-5:]
        if len(recent) == 5 and not any(s["prefill"] or s["decoded"] or s["padding"] for s in recent):
            run.stuck = ("the engine kept stepping without running anything (5 empty steps in a "
                         "row): the scheduler says it has work, but batches() yields nothing. "
                         "When a batch is over, free its requests and empty self.batch, so "
                         "the next call starts a new batch")
            break
    for rid in ids:
        record = engine.trace.requests[rid]
        run.outputs[rid] = list(record.output_ids)
        run.reasons[rid] = record.finish_reason
    run.free_blocks_left = engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
    return run


def _eos_prompt(fake: FakeModel) -> tuple[tuple[int, ...], int]:
    """A prompt whose fake continuation hits EOS after a few tokens, and that length."""
    for seed in range(10_000):
        prompt = fake_prompt(6, 1000 + seed)
        out = reference_output(list(prompt), 12, fake.vocab_size, frozenset({fake.eos_id}))
        if 3 <= len(out) <= 6 and out[-1] == fake.eos_id:
            return prompt, len(out)
    raise RuntimeError("no EOS prompt found")  # never happens with the default fake model


def fake_prompt(n: int, seed: int) -> tuple[int, ...]:
    """``n`` fake prompt tokens (never the EOS id 0)."""
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(1, FakeModel().vocab_size, n))


def _names(ids) -> str:
    ids = list(ids)
    return ", ".join(ids) if ids else "none"


def _describe_step(s: dict, other: dict) -> str:
    """One step in words (``other``: the step it is compared with, to show what differs)."""
    parts = []
    if s["prefill"]:
        parts.append("prefill " + ", ".join(f"{rid} ({n} tokens)" for rid, n in s["prefill"]))
    parts.append(f"decode rows {_names(s['decoded'])}")
    if s["padding"] or other["padding"]:
        parts.append(f"padding rows {_names(s['padding'])}")
    if s["padding_tokens"] or other["padding_tokens"]:
        parts.append(f"{s['padding_tokens']} padding tokens")
    if s["slots"] != other["slots"]:
        parts.append("slots after the step [" + ", ".join(r or "free" for r in s["slots"]) + "]")
    return "; ".join(parts)


def _show_run(run) -> str:
    if not isinstance(run, Run):
        return repr(run)
    return (f"{len(run.steps)} steps{' (then stopped)' if run.stuck else ''}, "
            f"{run.padding_rows} padding rows, {run.padding_tokens} padding tokens")


def compare_runs(got: Run, expected: Run, reqs: list[Req], fake: FakeModel,
                 hints: Callable[[dict, dict, int], str | None] | None = None) -> str | None:
    """None if ``got`` did what ``expected`` did; else the first difference, in words.
    ``hints(got_step, expected_step, k)`` may explain a differing step better."""
    for rid, req in zip(got.outputs, reqs):
        want = reference_output(list(req.prompt), req.max_new_tokens, fake.vocab_size,
                                frozenset() if req.ignore_eos else frozenset({fake.eos_id}))
        if got.outputs[rid] != want:
            have = got.outputs[rid]
            if have == want[:len(have)]:
                return (f"{rid} got only {len(have)} of its {len(want)} tokens: it must keep "
                        f"decoding until it finishes" + (f" ({got.stuck})" if got.stuck else ""))
            return f"{rid}'s tokens are wrong: expected {want}, got {have}"
    if got.stuck:
        return got.stuck
    for k, (g, e) in enumerate(zip(got.steps, expected.steps)):
        if g == e:
            continue
        why = hints(g, e, k) if hints else None
        return (f"step {k} differs.\n      expected: {_describe_step(e, g)}\n"
                f"      got:      {_describe_step(g, e)}" + (f"\n    {why}" if why else ""))
    if len(got.steps) != len(expected.steps):
        return f"expected {len(expected.steps)} steps, got {len(got.steps)}"
    if not got.free_blocks_left:
        return ("at the end some KV blocks were still held: when a batch is over, free each of "
                "its requests with Scheduler.remove(self, req)")
    return None


# ---------------------------------------------------------------------------------------
# Whole workloads: the piece runs through ``run_workload`` (the one driver), and the trace
# it leaves must keep the rules of its kind.

@dataclass
class WholeRun:
    """A whole workload run on the fake model: its trace, or why it stopped."""

    trace: object | None = None
    stuck: str | None = None
    free_blocks_left: bool = True
    steps_expected: int = 0


def fake_workload(name: str, output_lens: list[int], prompt_lens: list[int], seed: int):
    """A workload of fake prompts (all arriving at once) with these lengths."""
    from ..workloads import Workload, WorkloadRequest
    reqs = [WorkloadRequest(f"{name}-{i:03d}", list(fake_prompt(int(p), seed + i)), int(o))
            for i, (p, o) in enumerate(zip(prompt_lens, output_lens))]
    return Workload(name, f"{len(reqs)} fake requests at once", reqs, seed)


def run_whole(cls: type, B: int, workload, fake: FakeModel) -> WholeRun:
    """Run ``workload`` through ``run_workload`` on an engine around ``cls``; a scheduler
    that steps without running anything is reported (``EngineStuck``), never a hang."""
    from ..driver import EngineStuck, run_workload
    engine = fake_engine(cls, B, fake)
    try:
        trace = run_workload(engine, workload, progress=False)
    except EngineStuck as e:
        return WholeRun(stuck=f"the engine got stuck: {e}")
    except NotImplementedError:
        raise  # not written yet: the checker says so
    except RuntimeError as e:  # idle with requests unfinished
        return WholeRun(stuck=str(e))
    blocks = engine.scheduler.blocks
    return WholeRun(trace, free_blocks_left=blocks.num_free == blocks.num_blocks)


def whole_outputs_problem(run: WholeRun, workload, fake: FakeModel) -> str | None:
    """Every request got exactly the fake model's reference tokens."""
    for r in workload:
        want = reference_output(list(r.prompt_ids), r.max_new_tokens, fake.vocab_size, frozenset())
        have = list(run.trace.requests[r.id].output_ids)
        if have != want:
            return f"{r.id} got {len(have)} tokens, not its {len(want)}, or the wrong ones"
    return None


def slots_problem(step, B: int) -> str | None:
    """No slot double-booked, and never more than B of them."""
    held = [rid for rid in step.slots if rid is not None]
    if len(step.slots) > B:
        return f"step {step.index} has {len(step.slots)} slots, more than B = {B}"
    if len(held) != len(set(held)):
        return f"after step {step.index} one request holds two slots: {step.slots}"
    return None


def whole_case(label: str, B: int, workload, fake: FakeModel, reference: type, kind: type,
               invariants, hint: str, schedule=None) -> Case:
    """A case that runs the learner's class on a whole workload: the run must finish, keep
    ``invariants(trace, B)`` (None or what broke), give every request its reference
    tokens, run the reference's schedule (``schedule(got, expected)`` names the first
    difference, if given) and hand every KV block back."""
    expected = run_whole(reference, B, workload, fake)

    def call(c):
        if not (isinstance(c, type) and issubclass(c, kind)):
            raise TypeError(f"pass your scheduler class (a subclass of {kind.__name__})")
        return run_whole(c, B, workload, fake)

    def compare(got: WholeRun, exp: WholeRun) -> str | None:
        if got.stuck:
            return got.stuck
        for step in got.trace.steps:
            problem = slots_problem(step, B)
            if problem:
                return problem
        problem = invariants(got.trace, B) or whole_outputs_problem(got, workload, fake)
        if problem:
            return problem
        problem = schedule(got.trace, exp.trace) if schedule else None
        if problem:
            return problem
        if len(got.trace.steps) != len(exp.trace.steps):
            return (f"the rules held, but the run took {len(got.trace.steps)} steps where the "
                    f"reference takes {len(exp.trace.steps)}")
        if not got.free_blocks_left:
            return ("at the end some KV blocks were still held: every finished request must be "
                    "freed (Scheduler.remove)")
        return None

    def show(run):
        if not isinstance(run, WholeRun):
            return repr(run)
        if run.stuck:
            return "stopped: " + run.stuck.split(":")[0]
        return f"{len(run.trace.steps)} steps, every request done"

    return Case(label, call, expected, compare, hint, show)


# ---------------------------------------------------------------------------------------
# Exercise: the static scheduler (my_engine/static.py).

def _static_hint(g: dict, e: dict, k: int) -> str | None:
    if g["prefill"] and not e["prefill"]:
        return ("a new request started while the batch was still running: in static batching "
                "nobody joins until every request of the batch is done")
    if e["prefill"] and g["prefill"] and len(g["prefill"]) != len(e["prefill"]):
        return ("a new batch takes up to max_batch_size requests from the front of the queue "
                "(in arrival order), all at once")
    if any(ge is None and ee is not None for ge, ee in zip(g["slots"], e["slots"])):
        return ("a request left its slot while its batch was still running: a finished request "
                "keeps its slot as a padding row, and nobody joins until every request of the "
                "batch is done")
    if e["padding"] and not g["padding"]:
        return ("a finished request stays in the batch as a padding row until the whole batch "
                "ends: yield Batch(decode=<live rows>, padding=<finished rows>)")
    if g["padding_tokens"] != e["padding_tokens"]:
        return ("padding_tokens counts what a padded prefill would add: for every request of the "
                f"batch, the longest prompt minus its own prompt length (expected "
                f"{e['padding_tokens']}, got {g['padding_tokens']})")
    if set(g["decoded"]) - set(e["decoded"]):
        return "only requests that are not finished get a decode row"
    return None


def static_invariants(trace, B: int) -> str | None:
    """The rules of static batching, read off a trace: a batch starts only when the last
    one has left its slots (nobody joins mid-batch), and until it ends every request of
    the batch has a row in every decode step: a decode row while it runs, a padding row
    once it is done."""
    batch: set[str] = set()
    previous_slots: list = []
    for step in trace.steps:
        started = {rid for rid, _, _ in step.prefill}
        if started:
            if any(previous_slots):
                joined = ", ".join(sorted(started))
                return (f"step {step.index}: {joined} started while the batch before still held "
                        f"its slots ({[r for r in previous_slots if r]}): in static batching nobody "
                        f"joins a running batch")
            batch = started
        rows = set(step.decoded) | set(step.padding)
        if step.decoded and rows != batch:
            missing = sorted(batch - rows)
            if missing and all(rid in {r for s in trace.steps[:step.index + 1] for r in s.finished}
                               for rid in missing):
                return (f"step {step.index}: finished {', '.join(missing)} had no row: a finished "
                        f"request stays in its batch as a padding row until the batch ends")
            return (f"step {step.index}: the decode step ran rows {sorted(rows)}, but the batch is "
                    f"{sorted(batch)}")
        done = set(step.decoded) & {r for r in step.padding}
        if done:
            return f"step {step.index}: {sorted(done)} got a decode row and a padding row"
        previous_slots = list(step.slots)
    return None


def static_scheduler(cls) -> Verdict:
    """Check ``MyStaticScheduler`` (a ``StaticScheduler`` subclass whose ``batches()`` the
    learner wrote): small cases step by step against the library's scheduler, then whole
    workloads through ``run_workload`` with the rules of static batching checked on the trace."""
    fake = FakeModel()
    eos_prompt, eos_len = _eos_prompt(fake)
    rng = np.random.default_rng(0)  # lengths drawn like the mixed workload's
    mixed_p, mixed_o = rng.integers(40, 301, 16), rng.integers(4, 65, 16)
    rows = [
        ("two batches: 5 requests with B=3; the 4th and 5th wait until all of the first three "
         "are done", 3, [Req(fake_prompt(4 + i, 10 + i), o) for i, o in enumerate([3, 7, 2, 5, 4])]),
        ("one batch with fewer requests than slots: 3 requests (prompts of 5, 9 and 3 tokens, "
         "outputs of 4, 2 and 6 tokens), B=4",
         4, [Req(fake_prompt(5, 1), 4), Req(fake_prompt(9, 2), 2), Req(fake_prompt(3, 3), 6)]),
        ("every request wants a single token (3 requests, B=2): the prefill makes it, no decode rows",
         2, [Req(fake_prompt(6, 20 + i), 1) for i in range(3)]),
        (f"a request stops early on EOS (the fake model's token 0, after {eos_len} tokens) and "
         "stays in its batch as a padding row", 3,
         [Req(fake_prompt(7, 30), 9), Req(eos_prompt, 12, ignore_eos=False), Req(fake_prompt(5, 31), 8)]),
        ("B=1: one request at a time", 1, [Req(fake_prompt(4, 40 + i), o) for i, o in enumerate([3, 1, 4])]),
    ]

    def case(label, B, reqs):
        expected = run_requests(fake_engine(StaticScheduler, B, fake), reqs)

        def call(c):
            if not (isinstance(c, type) and issubclass(c, StaticScheduler)):
                raise TypeError("pass your scheduler class (a subclass of StaticScheduler), "
                                "e.g. check.static_scheduler(MyStaticScheduler)")
            return run_requests(fake_engine(c, B, fake), reqs)

        return Case(label, call, expected,
                    lambda got, exp: compare_runs(got, exp, reqs, fake, _static_hint),
                    show=_show_run)

    hint = ("take up to B requests from the queue only when no batch runs; yield one prefill, "
            "then one decode step per call (finished rows as padding); when every request of "
            "the batch is done, free them all and empty self.batch")
    wholes = [
        ("whole workload: 16 requests with prompt and output lengths drawn like the mixed "
         "workload's, B=8", 8, fake_workload("mix", mixed_o, mixed_p, 50)),
        ("whole workload: 30 requests, outputs 1 to 40 tokens, B=4 (eight batches)", 4,
         fake_workload("w", rng.integers(1, 41, 30), rng.integers(3, 30, 30), 500)),
    ]
    cases = [case(*row) for row in rows]
    cases += [whole_case(label, B, wl, fake, StaticScheduler, StaticScheduler, static_invariants, hint)
              for label, B, wl in wholes]
    return run_cases("static_scheduler", cls, cases)


def _static_run(output_lens: list[int], B: int) -> Run:
    """The static engine (fake model) on short prompts with these output lengths, all at once."""
    return run_requests(fake_engine(StaticScheduler, B),
                        [Req(fake_prompt(5, 60 + i), o) for i, o in enumerate(output_lens)])


def static_step_count(output_lens: list[int], B: int) -> int:
    """The engine steps static batching takes for these output lengths, all arriving at once."""
    return len(_static_run(output_lens, B).steps)


MIXED_OUTPUTS = [42, 37, 38, 61, 20, 53, 44, 4, 28, 56, 37, 6, 50, 48, 55, 14]  # the mixed workload's


def output_lens_cases(rows, truth: Callable[[list[int], int], int],
                      diagnose_for: Callable[[list[int], int], Callable], hint: str) -> list[Case]:
    """Cases for a count ``fn(output_lens, B) -> int``, from rows of (label, output_lens, B):
    the right count is ``truth(lens, B)``, a wrong one is explained by ``diagnose_for(lens, B)``."""
    return [Case(label, lambda f, l=lens, b=B: f(list(l), b), truth(lens, B),
                 whole_number_compare(diagnose_for(lens, B)), hint=hint)
            for label, lens, B in rows]


# ---------------------------------------------------------------------------------------
# Exercise: the slot-steps one static batch wastes.

def wasted_slot_steps(fn: Callable) -> Verdict:
    """Check ``fn(output_lens, B) -> int``: one static batch of ``len(output_lens) <= B``
    requests runs ``max(output_lens) - 1`` decode steps of ``B`` slots each; the slot-steps
    that make no token (padding rows and empty slots) are wasted."""

    def truth(lens, B):
        decode_steps = [s for s in _static_run(lens, B).steps if s["decoded"]]
        return sum(B - len(s["decoded"]) for s in decode_steps)

    def diagnose_for(lens, B):
        def diagnose(got, expected):
            m = max(lens)
            if got == sum(m - o for o in lens) and len(lens) < B:
                empty = B - len(lens)
                return (f"that counts the padding rows, but {empty} of the {B} slots "
                        f"{'holds' if empty == 1 else 'hold'} no request at all: "
                        f"{'it wastes' if empty == 1 else 'they waste'} every decode step too")
            if got == B * m - sum(lens) or got == sum(m - o for o in lens) + (B - len(lens)) * m:
                return (f"the batch runs max - 1 = {m - 1} decode steps, not {m}: each request's "
                        "first token comes from the prefill, not from a decode row")
            return ""
        return diagnose

    rows = [
        ("outputs [5, 2, 3] filling B=3 slots", [5, 2, 3], 3),
        ("outputs [5, 2, 3] in B=4 slots (one slot stays empty)", [5, 2, 3], 4),
        ("four equal outputs [6, 6, 6, 6], B=4: nothing wasted", [6, 6, 6, 6], 4),
        ("outputs [1, 10], B=2: one short request beside a long one", [1, 10], 2),
        ("outputs [1, 1], B=2: the prefill makes every token, there is no decode step", [1, 1], 2),
        ("the first batch of the mixed workload: [42, 37, 38, 61, 20, 53, 44, 4], B=8",
         MIXED_OUTPUTS[:8], 8),
    ]
    return run_cases("wasted_slot_steps", fn, output_lens_cases(
        rows, truth, diagnose_for,
        "count, over the max(output_lens) - 1 decode steps, the slots that made no "
        "token: B slots per step minus the decode rows of requests still running"))


# ---------------------------------------------------------------------------------------
# Exercise: how many steps static batching takes.

def static_steps(fn: Callable) -> Verdict:
    """Check ``fn(output_lens, B) -> int``: the engine steps a static engine with ``B`` slots
    takes for requests that all arrive at once and generate ``output_lens`` tokens."""

    def diagnose_for(lens, B):
        groups = [lens[i:i + B] for i in range(0, len(lens), B)]

        def diagnose(got, expected):
            if got == sum(max(g) for g in groups):
                return ("each batch takes max - 1 steps, not max: the prefill makes every "
                        "request's first token in the batch's first step, together with the "
                        "first decode row")
            if got == sum(max(g) - 1 for g in groups):
                return ("a batch whose requests all want a single token still takes one step "
                        "(its prefill)")
            if len(groups) > 1 and got in (max(lens) - 1, max(lens)):
                return (f"with B={B}, the {len(lens)} requests run as {len(groups)} batches, one "
                        f"after the other, in arrival order")
            return ""
        return diagnose

    rows = [
        ("one request with 3 output tokens, B=1", [3], 1),
        ("outputs [5, 2, 3] as one batch, B=3", [5, 2, 3], 3),
        ("outputs [5, 2, 3] with B=2: batches [5, 2] then [3]", [5, 2, 3], 2),
        ("outputs [1, 1, 1] with B=2: two batches of single-token requests", [1, 1, 1], 2),
        ("outputs [4, 9, 2, 2, 7] with B=1: one request at a time", [4, 9, 2, 2, 7], 1),
        ("the mixed workload's outputs, B=8", MIXED_OUTPUTS, 8),
        ("the mixed workload's outputs, B=16 (a single batch)", MIXED_OUTPUTS, 16),
    ]
    return run_cases("static_steps", fn, output_lens_cases(
        rows, static_step_count, diagnose_for,
        "split the requests into batches of B in arrival order; a batch lasts "
        "until its longest request is done"))
