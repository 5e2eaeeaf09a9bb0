"""The simulator: the SAME engine and schedulers, with the model replaced by a cost model
and the wall clock by a virtual one, so 10,000 requests run in seconds.

- ``VirtualClock``: time that moves only when told to. The engine takes every timestamp
  from it (``make_engine(..., clock=...)``), so traces and metrics read exactly as for a
  real run.
- ``CostModel``: a forward pass's time predicted from what it computes -- a linear model
  whose coefficients are fitted by least squares to timings of the real model
  (:mod:`batchlab.costfit`; this machine's fit ships as ``data/cost_model.json``).
- ``SimRunner``: a drop-in for ``ModelRunner``. It advances the clock by the predicted
  time of each pass and returns logits that pick a fixed token, with no model compute.
- ``simulate``: feeds a workload's arrivals on virtual time and steps the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .runner import Chunk, Runner
from .fake import FakeModel
from .trace import Trace
from .driver import run_workload
from .workloads import Workload

COST_MODEL_FILE = Path(__file__).parent / "data" / "cost_model.json"

#: What a forward pass computes, as the cost model sees it (one number each).
FEATURES = (
    "passes",  # 1 per pass: fixed overhead (kernel launches, the lm head's set-up)
    "tokens",  # tokens pushed through every linear layer (decode rows + prefill tokens)
    "decode_rows",  # decode rows (each a separate attention over its own context)
    "decode_context",  # sum of the decode rows' context lengths (KV read by attention)
    "prefill_chunks",  # prefill chunks (each its own attention call)
    "prefill_attention",  # sum over chunks of chunk length x context length (quadratic part)
)


def pass_features(chunks: Sequence[Chunk]) -> np.ndarray:
    """The ``FEATURES`` of one forward pass over ``chunks``."""
    rows = [c.start + 1 for c in chunks if len(c.tokens) == 1]
    prefills = [(len(c.tokens), c.start + len(c.tokens)) for c in chunks if len(c.tokens) > 1]
    return np.array([
        1.0,
        float(len(rows) + sum(n for n, _ in prefills)),
        float(len(rows)),
        float(sum(rows)),
        float(len(prefills)),
        float(sum(n * ctx for n, ctx in prefills)),
    ])


@dataclass
class CostModel:
    """seconds = coefficients · features(pass). ``error`` holds the fit's relative error
    on held-out passes (median, p90), so anyone using it knows how far to trust it."""

    coefficients: dict[str, float]
    error: dict[str, float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # how, where and when it was fitted

    def __post_init__(self):
        missing = [f for f in FEATURES if f not in self.coefficients]
        if missing:
            raise ValueError(f"cost model lacks coefficients for {', '.join(missing)}")
        self._w = np.array([self.coefficients[f] for f in FEATURES])

    def predict(self, chunks: Sequence[Chunk]) -> float:
        """Predicted seconds of one forward pass over ``chunks`` (never below zero)."""
        return max(float(pass_features(chunks) @ self._w), 0.0)

    def predict_features(self, x: np.ndarray) -> np.ndarray:
        return np.maximum(np.asarray(x) @ self._w, 0.0)

    @classmethod
    def fit(cls, features: np.ndarray, seconds: np.ndarray, meta: dict | None = None) -> "CostModel":
        """Least-squares fit, minimising *relative* error (each row weighted by 1/seconds)
        so short decode steps count as much as long prefills; non-negative by clipping."""
        x, y = np.asarray(features, dtype=float), np.asarray(seconds, dtype=float)
        w, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
        return cls({f: float(v) for f, v in zip(FEATURES, w)}, meta=meta or {})

    def relative_errors(self, features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
        """|predicted - measured| / measured for each pass."""
        y = np.asarray(seconds, dtype=float)
        return np.abs(self.predict_features(features) - y) / y

    def to_json(self) -> str:
        return json.dumps({"coefficients": self.coefficients, "error": self.error,
                           "meta": self.meta}, indent=2)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "CostModel":
        """The committed fit for the course machine, or one written by ``batchlab fit-cost --json``."""
        data = json.loads(Path(path or COST_MODEL_FILE).read_text())
        return cls(data["coefficients"], data.get("error", {}), data.get("meta", {}))


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
    ``ignore_eos`` so that lengths, not tokens, decide when a request ends."""

    def __init__(self, lm, cost: CostModel, clock: VirtualClock):
        self.lm, self.cost, self.clock = lm, cost, clock
        self.passes = 0

    def forward(self, chunks: list[Chunk]) -> None:
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
    from .engine import make_engine

    clock = VirtualClock()
    return make_engine(kind, SIM_MODEL, runner=sim_runner(cost or CostModel.load(), clock),
                       clock=clock, **options)


def simulate(engine, workload: Workload, priorities: dict[str, int] | None = None) -> Trace:
    """Run ``workload`` on a simulated engine (``driver.run_workload``, whose clock
    jumps to the next arrival when the engine is idle) and return its trace."""
    if not isinstance(engine.clock, VirtualClock):
        raise ValueError("simulate needs an engine made by make_sim_engine (a virtual clock)")
    return run_workload(engine, workload, progress=False, priorities=priorities)


def service_rate(workload: Workload, kind: str = "stallfree", cost: CostModel | None = None,
                 **options) -> float:
    """μ: requests per second the engine completes when it never runs out of work --
    every request of ``workload`` arrives at once, and the rate is measured over the
    run. (Arrivals faster than this build a queue that only grows.)"""
    engine = make_sim_engine(kind, cost, **options)
    trace = simulate(engine, workload.with_arrivals("all"))
    return len(trace.requests) / engine.clock()


def queue_timeline(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(step start times, requests waiting in the queue) over a run."""
    return (np.array([s.start_s for s in trace.steps]), np.array([s.queued for s in trace.steps]))
