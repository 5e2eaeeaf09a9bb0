"""The simulator: the SAME engine and schedulers, with the model replaced by a cost model
and the wall clock by a virtual one, so 10,000 requests run in seconds.

- ``VirtualClock``: time that moves only when told to. The engine takes every timestamp
  from it (``make_engine(..., clock=...)``), so traces and metrics read exactly as for a
  real run.
- ``costmodel.CostModel``: a forward pass's time predicted from what it computes (fitted
  to timings of the real model by :mod:`batchlab.measurement.costfit`).
- ``SimRunner``: a drop-in for ``ModelRunner``. It advances the clock by the predicted
  time of each pass and returns logits that pick a fixed token, with no model compute.
- ``simulate``: feeds a workload's arrivals on virtual time and steps the engine.
"""

from __future__ import annotations

import numpy as np

from ..core.costmodel import CostModel
from ..core.fake import FakeModel
from ..core.runner import Chunk, Runner
from ..core.trace import Trace
from .driver import run_workload
from .workloads import Workload


class VirtualClock:
    """Seconds of simulated time; callable like the engine's clock."""

    def __init__(self, start: float = 0.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not run backwards")
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, float(t))


class SimRunner(Runner):
    """Stands where ``ModelRunner`` goes; build with :func:`sim_runner`.

    It computes nothing: each pass costs the cost model's prediction on the virtual
    clock, and every sampled token is ``1``. Simulated workloads therefore set
    ``ignore_eos`` so that lengths, not tokens, decide when a request ends. A verify row
    (speculative decoding) is priced as the prefill chunk of 1 + k tokens it is, and gets a
    ``1`` at each of its positions; so once prompt lookup finds ``1``s to propose, the model
    "agrees" with every draft: a simulation shows speculation's best case, not its
    acceptance."""

    def __init__(self, lm, cost: CostModel, clock: VirtualClock):
        self.lm, self.cost, self.clock = lm, cost, clock
        self.passes = 0

    def forward(self, chunks: list[Chunk], head_rows: list[int] | None = None) -> None:
        self.clock.advance(self.cost.predict(chunks))
        self.passes += 1

    def sample(self, logits, rows: list[int], samplers) -> list[int]:
        return [1] * len(rows)


def sim_runner(cost: CostModel, clock: VirtualClock):
    """The ``runner`` argument of ``make_engine`` for a simulated engine."""
    return lambda lm, num_blocks, block_size: SimRunner(lm, cost, clock)


# Tokens do not matter in a simulation: a tiny vocabulary, room for the longest synthetic request.
SIM_MODEL = FakeModel(vocab_size=8, eos_id=0, max_seq_len=2048)


def make_sim_engine(kind: str = "stallfree", cost: CostModel | None = None, **options):
    """``make_engine(kind, ...)`` on a virtual clock with the cost model as its runner.
    Returns the engine; its clock is ``engine.clock``."""
    from ..core.engine import make_engine

    clock = VirtualClock()
    return make_engine(
        kind, SIM_MODEL, runner=sim_runner(cost or CostModel.load(), clock), clock=clock, **options
    )


def simulate(engine, workload: Workload, priorities: dict[str, int] | None = None, after_step=None) -> Trace:
    """Run ``workload`` on a simulated engine (``driver.run_workload``, whose clock
    jumps to the next arrival when the engine is idle) and return its trace.
    ``after_step(engine, records)`` is the clients' turn after every step (``run_workload``'s)."""
    if not isinstance(engine.clock, VirtualClock):
        raise ValueError("simulate needs an engine made by make_sim_engine (a virtual clock)")
    return run_workload(engine, workload, progress=False, priorities=priorities, after_step=after_step)


def service_rate(
    workload: Workload, kind: str = "stallfree", cost: CostModel | None = None, **options
) -> float:
    """μ: requests per second the engine completes when it never runs out of work --
    every request of ``workload`` arrives at once, and the rate is measured over the
    run. (Arrivals faster than this build a queue that only grows.)"""
    engine = make_sim_engine(kind, cost, **options)
    trace = simulate(engine, workload.with_arrivals("all"))
    return len(trace.requests) / engine.clock()


def queue_timeline(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(step start times, requests waiting in the queue) over a run."""
    return (np.array([s.start_s for s in trace.steps]), np.array([s.queued for s in trace.steps]))
