"""Running a workload on an engine: the one driver of every run (real engines, the
simulator, the exercise checkers), the detector of an engine that is stuck, and the
measurement of this machine's speeds that places the arrivals of ``interference``.

The workloads themselves (what is sent) are data, in ``workloads``; this module is what
sends them, so it sits above the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace

import numpy as np

from ..core import metrics
from ..core.engine import make_engine
from ..core.trace import RequestRecord, Trace
from .workloads import Speeds, Workload, WorkloadRequest, _maker


class EngineStuck(RuntimeError):
    """The engine kept stepping without running anything (a scheduler bug): the driver
    stops instead of looping forever."""


def run_workload(
    engine,
    workload: Workload,
    progress: bool = True,
    timeout_s: float | None = None,
    temperature: float = 0.0,
    priorities: dict[str, int] | None = None,
    max_idle_steps: int = 50,
    after_step: Callable[[object, Mapping[str, RequestRecord]], None] | None = None,
    stop_at_eos: bool = False,
) -> Trace:
    """Run ``workload`` on ``engine`` and return the trace of this run alone. The one
    driver of every run: real engines, the simulator and the exercise checkers.

    Each request is submitted once its arrival time (seconds after the run starts, on the
    engine's clock) has come, with ``arrival_s`` = when it was *due*: a request due while
    a step was running is submitted after the step, and that wait is part of its TTFT, as
    it would be in a server. When the engine is idle and the next request is still to
    come, the driver waits for it: a clock with ``advance_to`` (an engine's own
    ``EngineClock``, the simulator's ``VirtualClock``) jumps forward to it, since nothing runs
    meanwhile; any other clock is slept on. A request refused at the door (``QueueFull``) gets a record
    finished with reason ``"rejected"``, so the trace accounts for every request.
    ``priorities`` maps request ids to a ``submit`` priority (0 for an id it leaves out). After ``timeout_s`` seconds
    the requests still running are cancelled. ``max_idle_steps`` steps in a row that run
    no forward pass raise ``EngineStuck``. ``after_step(engine, records)``, if given, is
    called after every step with the records of the requests submitted so far (id to
    record, refused ones included): the clients of a server, acting between steps
    (``engine.poll`` their tokens, ``engine.cancel`` a request).

    Every request is submitted with ``ignore_eos=True`` (it generates exactly its
    ``max_new_tokens``), except one with ``structured_outputs``: that is submitted with them
    and EOS honoured, since a constrained answer ends at EOS once it is complete. With
    ``stop_at_eos`` every request honours EOS (``max_new_tokens`` is then a cap).
    """
    reqs = sorted(workload.requests, key=lambda r: r.arrival_s)  # stable: ties keep order
    if len({r.id for r in reqs}) != len(reqs):
        raise ValueError("workload request ids must be unique")
    clock = engine.clock
    wait_until = getattr(clock, "advance_to", None) or (lambda t: time.sleep(max(0.0, t - clock())))
    t0 = clock()
    records: dict[str, RequestRecord] = {}
    nxt = idle = 0
    bar = _progress_bar(reqs, workload.name, progress)
    try:
        while True:
            wall = clock()
            if timeout_s is not None and wall - t0 > timeout_s:
                _cancel_unfinished(engine, records)
                break
            nxt = _submit_due(engine, reqs, nxt, t0, wall, records, temperature, priorities, stop_at_eos)
            stepped = engine.step()
            if after_step is not None:
                after_step(engine, records)
            if stepped:
                idle = _after_step(engine, bar, idle, max_idle_steps)
            elif nxt < len(reqs):
                wait_until(t0 + reqs[nxt].arrival_s)  # idle: on to the next arrival
            else:
                break
    finally:
        bar.close()
    return _this_run(engine, reqs, records, t0, timeout_s)


def _progress_bar(reqs, name: str, progress: bool):
    """The run's progress bar, in output tokens (off unless ``progress``)."""
    from tqdm.auto import tqdm

    total = sum(r.max_new_tokens for r in reqs)
    return tqdm(total=total, unit="tok", desc=name, disable=not progress, leave=False)


def _submit_due(
    engine, reqs, nxt: int, t0: float, wall: float, records, temperature, priorities, stop_at_eos=False
) -> int:
    """Submit every request from ``reqs[nxt]`` on that is due at ``wall`` (with ``arrival_s``
    = when it was due) and note its record; one refused at the door (``QueueFull``) gets a
    record finished with reason ``"rejected"``. Returns the index of the next one not due.
    EOS is ignored unless ``stop_at_eos`` or the request carries ``structured_outputs`` (then
    passed on: a constrained answer ends at EOS once complete)."""
    from ..core.policies import QueueFull

    # due times compared as the idle wait sets them (t0 + arrival), so a virtual
    # clock's rounding cannot leave a request forever just short of due
    while nxt < len(reqs) and t0 + reqs[nxt].arrival_s <= wall:
        r, due = reqs[nxt], t0 + reqs[nxt].arrival_s
        nxt += 1
        extra = {} if priorities is None else {"priority": priorities.get(r.id, 0)}
        if r.structured_outputs is not None:
            extra["structured_outputs"] = r.structured_outputs
        try:
            engine.submit(
                r.prompt_ids,
                max_new_tokens=r.max_new_tokens,
                ignore_eos=not stop_at_eos and r.structured_outputs is None,
                temperature=temperature,
                request_id=r.id,
                arrival_s=due,
                **extra,
            )
        except QueueFull:
            records[r.id] = _rejected(r, due)
            continue
        records[r.id] = engine.trace.requests[r.id]
    return nxt


def _rejected(r: WorkloadRequest, due: float) -> RequestRecord:
    """The record of a request refused at the door: finished when it was due, ``"rejected"``."""
    return RequestRecord(
        r.id,
        r.prompt_len,
        r.max_new_tokens,
        due,
        [(due, "finished")],
        finished_s=due,
        finish_reason="rejected",
    )


def _cancel_unfinished(engine, records: dict[str, RequestRecord]) -> None:
    """The timeout: cancel every request still running, and one step sweeps them out."""
    for rid, rec in records.items():
        if rec.finished_s is None:
            engine.cancel(rid)
    engine.step()  # sweeps the cancelled requests out


def _after_step(engine, bar, idle: int, max_idle_steps: int) -> int:
    """Count the step that just ran: its tokens on the progress bar, and the steps in a row
    that ran no forward pass (returned), ``EngineStuck`` at ``max_idle_steps``."""
    step = engine.trace.steps[-1]
    bar.update(sum(map(len, step.emitted.values())))
    idle = 0 if step.passes else idle + 1
    if idle >= max_idle_steps:
        raise EngineStuck(
            f"the engine stepped {idle} times in a row without running anything: "
            f"its scheduler says it has work, but batches() yields nothing"
        )
    return idle


def _this_run(engine, reqs, records: dict[str, RequestRecord], t0: float, timeout_s) -> Trace:
    """The trace of this run alone (its steps, its requests in arrival order), once every
    request has ended; an unfinished request without a timeout, or a failing engine, raises."""
    unfinished = sorted(rid for rid, rec in records.items() if rec.finished_s is None)
    if unfinished and timeout_s is None:
        raise RuntimeError(
            f"the engine is idle but {len(unfinished)} requests are not done: {unfinished[:5]}"
        )
    if getattr(engine, "failing", None):  # every request has ended; a broken engine is said, not hidden
        engine.raise_if_failing()
    steps = [s for s in list(engine.trace.steps) if s.start_s >= t0]  # this run's steps only
    return replace(engine.trace, steps=steps, requests={r.id: records[r.id] for r in reqs if r.id in records})


REPETITIONS_CAP = "BATCHLAB_REPETITIONS"


def capped(repetitions: int) -> int:
    """``repetitions``, or fewer where ``BATCHLAB_REPETITIONS`` caps it. The test suite sets it to
    1: a lesson run under test checks that every cell runs and what nbval compares (schedules,
    verdicts), never a timing, so one round of each timed comparison is enough there. Unset
    (a learner, the bench), every round runs."""
    cap = os.environ.get(REPETITIONS_CAP)
    if not cap:
        return repetitions
    if not cap.isdigit() or int(cap) < 1:
        raise ValueError(f"{REPETITIONS_CAP} must be a whole number of at least 1, not {cap!r}")
    return min(repetitions, int(cap))


def interleaved_order(names: Iterable, repetitions: int) -> Iterator[tuple[int, object]]:
    """(round, name) of every run of side-by-side timing: ``repetitions`` rounds, each
    running every name once in the order given (A B C A B C ...), so a slow moment of a
    shared machine lands on all of them instead of on one. The one interleaving of
    ``run_interleaved``, ``batchlab bench`` and the micro-benchmarks."""
    names = list(names)
    for round_ in range(repetitions):
        for name in names:
            yield round_, name


def run_interleaved(
    engines: Mapping[str, Callable[[], object]],
    workload: Workload | Mapping[str, Workload],
    repetitions: int = 3,
    **run_options,
) -> dict[str, list[Trace]]:
    """Time engines side by side, fairly: ``repetitions`` rounds, each running every engine
    once in the order given (A B C A B C ...), each time on a fresh engine, so a slow moment
    of a shared machine lands on all of them instead of on one. Returns each name's traces,
    one per round, in round order; ``metrics.median_range`` reads them.

    ``engines`` maps a name to a function of no arguments that makes a fresh engine
    (``lambda: make_engine("static", lm, max_batch_size=8)``), run with ``run_workload``.
    A peer that ``run_workload`` cannot drive may be given as a function that runs itself
    and returns its trace (``lambda: peers.run_mlxlm_workload(lm, wl, 8, progress=False)``).
    ``workload`` is one workload for all, or one per name. ``run_options`` go to every
    ``run_workload`` call (``progress`` is off unless asked for). ``BATCHLAB_REPETITIONS``
    caps the rounds (``capped``)."""
    if repetitions < 1:
        raise ValueError(f"repetitions must be at least 1, not {repetitions}")
    if not engines:
        raise ValueError("no engines to run")
    if isinstance(workload, Mapping):
        missing = [name for name in engines if name not in workload]
        if missing:
            raise ValueError(f"no workload for {', '.join(map(repr, missing))}")
    run_options.setdefault("progress", False)
    traces: dict[str, list[Trace]] = {name: [] for name in engines}
    for _, name in interleaved_order(engines, capped(repetitions)):
        made = engines[name]()
        if not isinstance(made, Trace):
            work = workload[name] if isinstance(workload, Mapping) else workload
            made = run_workload(made, work, **run_options)
        traces[name].append(made)
    return traces


def measure_speeds(lm, batch_size: int = 16, prefill_tokens: int = 256) -> Speeds:
    """This machine's ``Speeds`` (about 10 s on a 2-core CPU): the median step of a
    continuous engine decoding ``batch_size`` requests, and the prefill throughput of
    a sequential engine on a ``prefill_tokens``-token prompt (the second of two; the
    first warms up). Prefill gets slower per token as prompts grow (attention), so
    measure at the length you want to predict: a 256-token rate underestimates the
    prefill of a 520-token prompt by about a quarter."""

    maker, rng = _maker(getattr(lm, "tokenizer", lm)), np.random.default_rng(0)
    reqs = [WorkloadRequest(f"decode-{i}", maker.make(40, rng)[0], batch_size + 8) for i in range(batch_size)]
    trace = run_workload(
        make_engine("continuous", lm, max_batch_size=batch_size), Workload("speeds", "", reqs), progress=False
    )
    step = metrics.decode_step_s(trace, batch_size)
    reqs = [WorkloadRequest(f"prefill-{i}", maker.make(prefill_tokens, rng)[0], 1) for i in range(2)]
    trace = run_workload(make_engine("sequential", lm), Workload("speeds", "", reqs), progress=False)
    last = [s for s in trace.steps if s.prefill][-1]
    return Speeds(
        decode_step_s=step, prefill_tokens_per_s=sum(n for _, _, n in last.prefill) / last.forward_s
    )
