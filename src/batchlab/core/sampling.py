"""Turning a row of logits into a token: greedy, temperature, top-k, top-p.

Every request carries its own ``SamplingParams`` and its own random stream, so a
request's samples depend only on its seed, never on which requests share its batch.
Pure numpy: requests and schedulers import this without MLX; the runner turns its MLX
logits into tokens with ``runner.sample``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .numbers import is_int


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (always the most likely token)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep only the k most likely tokens (0 = all)
    seed: int | None = None

    def __post_init__(self):
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """One request's sampler: its parameters plus its private random stream."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        # ids this request may not take now: its stop tokens until it has ``min_tokens``
        # (set by the request as it grows)
        self.banned: frozenset[int] = frozenset()
        # structured output: bool [vocab], the tokens its constraint allows next (set before
        # each pass its row samples in); None: every token
        self.allowed: np.ndarray | None = None

    @property
    def restricted(self) -> bool:
        """Some tokens are ruled out of its next pick (banned, or outside its mask)."""
        return bool(self.banned) or self.allowed is not None

    def restrict(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one row of ``logits`` with every ruled-out token at -inf. The mask comes
        first: when banning the stop tokens would leave no token at all (the constraint's
        answer is complete, so only EOS may follow), they stay allowed."""
        row = logits.astype(np.float32, copy=True)
        if self.allowed is not None:
            row[~self.allowed] = -np.inf
        if self.banned:
            kept = row.copy()
            row[list(self.banned)] = -np.inf
            if not np.isfinite(row).any():
                row = kept
        return row

    def sample(self, logits: np.ndarray) -> int:
        """Pick a token from one row of float32 logits (not used for greedy rows)."""
        p = self.params
        scaled = logits.astype(np.float64) / p.temperature
        candidates = np.arange(scaled.size)
        if 0 < p.top_k < scaled.size:
            candidates = np.argpartition(-scaled, p.top_k)[: p.top_k]
        order = candidates[np.argsort(-scaled[candidates], kind="stable")]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(order.size, p=probs)])


def sample_rows(logits: np.ndarray, samplers: list[Sampler]) -> list[int]:
    """One token per row of ``logits`` [N, vocab]: argmax for greedy rows, the row's own
    sampler for the others; a row's ruled-out ids (``Sampler.restrict``) get no weight."""
    picks = np.argmax(logits, axis=-1).tolist()
    for i, s in enumerate(samplers):
        row = logits[i]
        if s.restricted:
            row = s.restrict(row)
            picks[i] = int(np.argmax(row))
        if not s.params.greedy:
            picks[i] = s.sample(row)
    return picks
