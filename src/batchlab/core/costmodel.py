"""The cost model: a forward pass's time predicted from what it computes, and the token
budget it implies for a latency target (pure Python: numpy, no MLX).

A linear model -- seconds = coefficients · features(pass) -- whose coefficients are fitted
by least squares to timings of the real model (:mod:`batchlab.measurement.costfit`, ``batchlab
fit-cost``); the course machine's fit ships as ``data/cost_model.json``. The simulator
runs on it, and the stall-free scheduler picks its token budget from it (Sarathi-Serve
§4.3: the largest budget whose step still meets the time-between-tokens target).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .request import is_int, is_number
from .runner import Chunk

COST_MODEL_FILE = Path(__file__).parents[1] / "data" / "cost_model.json"

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
    """The ``FEATURES`` of one forward pass over ``chunks``. A verify row (a decode row with
    k drafts, speculative decoding) is what it computes: a chunk of 1 + k tokens over its
    context, priced as a prefill chunk (its attention is one, in every runner)."""
    rows = [c.start + 1 for c in chunks if len(c.tokens) == 1]
    prefills = [(len(c.tokens), c.start + len(c.tokens)) for c in chunks if len(c.tokens) > 1]
    return np.array(
        [
            1.0,
            float(len(rows) + sum(n for n, _ in prefills)),
            float(len(rows)),
            float(sum(rows)),
            float(len(prefills)),
            float(sum(n * ctx for n, ctx in prefills)),
        ]
    )


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
        return json.dumps(
            {"coefficients": self.coefficients, "error": self.error, "meta": self.meta}, indent=2
        )

    @classmethod
    def load(cls, path: str | Path | None = None) -> "CostModel":
        """The committed fit for the course machine, or one written by ``batchlab fit-cost --json``."""
        data = json.loads(Path(path or COST_MODEL_FILE).read_text())
        return cls(data["coefficients"], data.get("error", {}), data.get("meta", {}))


TYPICAL_CONTEXT = 256  # tokens each decode row has in its KV cache, for budget planning
#: The default TBT target, in decode steps of a full batch (the cost model's prediction at
#: ``TYPICAL_CONTEXT``). The performance goal is p99 TBT <= 2 decode steps at >= 0.95 of the
#: naive engine's throughput; the target sits below 2 because a real step runs at a longer
#: context than the typical one and the model's prediction errs by a few percent (its
#: held-out p90 error): planned at 1.75 steps, the dearest steps stay below 2.
DEFAULT_SLO_DECODE_STEPS = 1.75


def predicted_decode_step_s(cost: CostModel, batch_size: int, context: int = TYPICAL_CONTEXT) -> float:
    """Predicted seconds of one decode step of ``batch_size`` rows at ``context`` tokens each."""
    return cost.predict([Chunk(f"d{i}", [0], context) for i in range(batch_size)])


def hybrid_step_s(
    cost: CostModel, batch_size: int, prefill_tokens: int, context: int = TYPICAL_CONTEXT
) -> float:
    """Predicted seconds of a step with ``batch_size`` decode rows and one prefill chunk of
    ``prefill_tokens`` tokens (starting at ``context``) riding along."""
    chunks = [Chunk(f"d{i}", [0], context) for i in range(batch_size)]
    if prefill_tokens > 0:
        chunks.append(Chunk("p", [0] * prefill_tokens, context))
    return cost.predict(chunks)


def default_tbt_slo(cost: CostModel, batch_size: int, context: int = TYPICAL_CONTEXT) -> float:
    """The default TBT target: ``DEFAULT_SLO_DECODE_STEPS`` predicted decode steps."""
    return DEFAULT_SLO_DECODE_STEPS * predicted_decode_step_s(cost, batch_size, context)


def token_budget_for_slo(
    cost: CostModel,
    batch_size: int,
    tbt_slo_s: float | None = None,
    context: int = TYPICAL_CONTEXT,
    limit: int = 8192,
) -> int:
    """The largest token budget (>= ``batch_size``) whose predicted step -- every slot
    decoding at ``context`` plus one prefill chunk filling the rest, starting at
    ``context`` -- stays within ``tbt_slo_s`` (Sarathi-Serve §4.3, with the fitted cost
    model standing in for its profiling). ``tbt_slo_s=None``: ``default_tbt_slo``.
    A target below one decode step can only give the decodes alone: ``batch_size``;
    one that even ``limit`` tokens meet gives ``limit``.

    The search is a bisection, so it needs the predicted step to grow with the chunk:
    it does for any cost model whose per-token and attention coefficients are >= 0
    (``CostModel.fit`` gives those on real timings; a model that does not is refused)."""
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not is_int(limit) or limit < batch_size:
        raise ValueError(f"limit must be an integer >= batch_size ({batch_size}), got {limit!r}")
    for name in ("tokens", "prefill_attention"):
        if cost.coefficients[name] < 0:
            raise ValueError(
                f"the cost model's {name!r} coefficient is negative "
                f"({cost.coefficients[name]:.3g}): a longer chunk would be "
                f"predicted cheaper, so no budget follows from a target"
            )
    if tbt_slo_s is None:
        tbt_slo_s = default_tbt_slo(cost, batch_size, context)
    if not is_number(tbt_slo_s) or not tbt_slo_s > 0:
        raise ValueError(f"tbt_slo must be a number of seconds > 0, got {tbt_slo_s!r}")

    def fits(n: int) -> bool:
        return hybrid_step_s(cost, batch_size, n, context) <= tbt_slo_s

    lo, hi = 0, limit - batch_size  # prefill tokens: lo always fits (or is 0), hi may not
    if fits(hi):
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return batch_size + lo
