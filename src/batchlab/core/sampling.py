"""Turning a row of logits into a token: greedy, temperature, top-k, top-p.

Every request carries its own ``SamplingParams`` and its own random stream, so a
request's samples depend only on its seed, never on which requests share its batch.
``SamplingParams`` carries the rest of what a request asks of its generation too (its
length, what ends it, what it must match), as vLLM's does: one object from the server
to the request. Pure numpy: requests and schedulers import this without MLX; the runner
turns its MLX logits into tokens with ``runner.sample``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .numbers import is_int
from .structured import StructuredOutputs


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of its generation (vLLM's ``SamplingParams``): how each token is
    picked, how many it may have, what ends it and what its answer must match. Every check
    that needs no model is made here, a ValueError naming the field; the vocabulary, the
    maximum sequence length, the KV pool and the grammar are the engine's
    (``EngineBase.check_request``). ``priority`` is not here: it is the engine's order, not
    the request's generation (as in vLLM, an argument of ``submit``)."""

    temperature: float = 0.0  # 0 means greedy (always the most likely token)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep only the k most likely tokens (0 = all)
    seed: int | None = None
    max_new_tokens: int = 32  # the most tokens it generates (cut to fit the maximum sequence length)
    min_new_tokens: int = 0  # no stop token is sampled before it has this many (vLLM's min_tokens)
    ignore_eos: bool = False  # EOS does not end it (its stop_token_ids still do, as in vLLM)
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end it (any sequence; kept as a tuple)
    # what its answer must match (a StructuredOutputs, or vLLM's dict of one); None: plain text
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
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
        if not is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        stops = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(stops, (str, bytes, dict)) or not isinstance(stops, Iterable):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stops!r}")
        stops = tuple(stops)
        bad = [t for t in stops if not is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {bad[:3]!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        spec = self.structured_outputs
        if spec is not None:
            if isinstance(spec, dict):
                spec = StructuredOutputs.from_dict(spec)
            if not isinstance(spec, StructuredOutputs):
                raise ValueError(f"structured_outputs must be a StructuredOutputs or a dict, got {spec!r}")
            if self.ignore_eos:
                raise ValueError(
                    "a constrained request ends at EOS once its answer is complete: it cannot ignore_eos"
                )
            object.__setattr__(self, "structured_outputs", spec)

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
