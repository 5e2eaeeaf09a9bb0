"""A request's whole lifecycle in one place: its states, what it asks of its generation
(``SamplingParams``) and how its tokens are picked (``Sampler``).

    queued -> prefilling -> (awaiting slot) -> decoding -> finished

*Prefill* runs the prompt's tokens through the model to fill the KV cache; it ends by
sampling the first new token. *Decode* then adds one token per step (or several, when
speculative decoding's drafts are accepted: ``scheduler.StallFreeScheduler.drafts``). A request
finishes on an EOS token ("stop"), at max_new_tokens or the maximum sequence length
("length"), when cancelled ("cancelled"), shed by an overloaded engine ("shed"), or when
its forward pass failed ("error").

When KV memory runs out a running request may be *preempted*: it gives back all its
blocks and goes back to the queue, keeping the tokens it generated. Re-admitted, it
prefills prompt + generated tokens again (*recompute*) and carries on where it stopped.

What a request asks of its generation is one ``SamplingParams`` (as in vLLM), from the
server to the request; its ``Sampler`` turns a row of logits into its next token (greedy,
temperature, top-k, top-p) with its own random stream, so a request's samples depend only
on its seed, never on which requests share its batch. Pure numpy: schedulers import this
without MLX. The argument checks the core shares (``is_int``, ``is_number``) are here too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from .structured import Constraint, StructuredOutputs
from .trace import RequestRecord


# In Python ``True`` is an ``int`` (``True + 1 == 2``), so "an integer" and "a number" in the
# core's argument checks leave bools out: ``max_batch_size=True`` is a mistake to name, not a
# batch of one.
def is_int(value) -> bool:
    """A Python ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A Python ``int`` or ``float`` that is not a ``bool`` (it may be inf or NaN: check the range)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


class State(str, Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    AWAITING_SLOT = "awaiting_slot"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    max_new_tokens: int  # already cut to fit the maximum sequence length
    sampling: SamplingParams
    stop_ids: frozenset[int]  # EOS ids (empty when ignore_eos)
    arrival_s: float
    state: State = State.QUEUED
    num_computed: int = 0  # tokens whose keys and values are in the KV cache
    output_ids: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # generated, not yet handed out by poll
    finish_reason: str | None = None
    slot: int | None = None  # decode slot while it holds one
    priority: int = 0  # lower is more important (as in vLLM)
    min_new_tokens: int = 0  # its stop tokens are not sampled before it has this many
    error: BaseException | None = None  # why it finished with reason "error"
    constraint: Constraint | None = None  # structured output: what its answer must match
    prefill_len: int = field(init=False)  # tokens to prefill: the prompt (+ outputs after preemption)
    sampler: Sampler = field(init=False)
    record: RequestRecord = field(init=False)  # timestamps for metrics and timelines

    def __post_init__(self):
        self.sampler = Sampler(self.sampling)
        self._ban_stops_until_min()
        self.prefill_len = self.prompt_len
        self.record = RequestRecord(
            self.id,
            self.prompt_len,
            self.max_new_tokens,
            self.arrival_s,
            state_times=[(self.arrival_s, self.state.value)],
            output_ids=self.output_ids,
            priority=self.priority,
        )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_left(self) -> int:
        return max(self.prefill_len - self.num_computed, 0)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens ``start..stop-1`` of the whole sequence: prompt, then generated tokens."""
        p = self.prompt_len
        return self.prompt_ids[start : min(stop, p)] + self.output_ids[max(start - p, 0) : max(stop - p, 0)]

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    def set_state(self, state: State, now: float) -> None:
        self.state = state
        self.record.state_times.append((now, state.value))

    def finish(self, reason: str, now: float) -> None:
        self.finish_reason = self.record.finish_reason = reason
        self.record.finished_s = now
        self.set_state(State.FINISHED, now)

    def fail(self, cause: BaseException, now: float) -> bool:
        """Finish with reason "error" because of ``cause``; False if it had finished already."""
        if self.finished:
            return False
        self.finish("error", now)
        self.error = cause
        return True

    def next_input(self) -> list[int]:
        """The token a decode step feeds in: the last one generated."""
        return [self.output_ids[-1]]

    def add_token(self, token: int, now: float) -> None:
        """Record a new token (whether it ends the request is the scheduler's
        ``finish_reason``)."""
        self.output_ids.append(token)
        self.pending.append(token)
        if self.constraint is not None:
            self.constraint.advance(token)
        self.record.token_times_s.append(now)
        if self.record.first_token_s is None:
            self.record.first_token_s = now
        self._ban_stops_until_min()

    def _ban_stops_until_min(self) -> None:
        """vLLM's ``min_tokens``: until the request has that many tokens, its sampler may not
        pick a stop token (it picks the best other one)."""
        self.sampler.banned = self.stop_ids if len(self.output_ids) < self.min_new_tokens else frozenset()


@dataclass(frozen=True)
class CheckedRequest:
    """A request whose arguments the engine has checked (``EngineBase.check_request``) and
    that nobody has queued yet: what ``EngineBase.enqueue`` makes a ``Request`` of."""

    prompt_ids: list[int]
    params: SamplingParams  # as asked
    max_new_tokens: int  # params.max_new_tokens, cut so that prompt + output fits max_seq_len
    stop_ids: frozenset[int]  # EOS (unless params.ignore_eos) and params.stop_token_ids
    priority: int = 0  # lower is more important (as in vLLM)
    constraint: Constraint | None = None  # params.structured_outputs, compiled for this request

    def request(self, req_id: str, arrival_s: float) -> Request:
        """The ``Request`` ``req_id``, arrived at ``arrival_s``."""
        return Request(
            req_id,
            self.prompt_ids,
            self.max_new_tokens,
            self.params,
            self.stop_ids,
            arrival_s,
            priority=self.priority,
            min_new_tokens=self.params.min_new_tokens,
            constraint=self.constraint,
        )


def check_prompt_ids(ids: list, vocab_size: int, max_seq_len: int) -> None:
    """Raise ValueError unless ``ids`` is a usable prompt for a model with these limits."""
    if len(ids) == 0:
        raise ValueError("the prompt is empty: it needs at least one token")
    bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids must be integers in [0, {vocab_size}); got {bad[:5]!r}")
    if len(ids) >= max_seq_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the maximum sequence length is "
            f"{max_seq_len}, which must leave room for at least one new token"
        )


def clamp_new_tokens(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> int:
    """How many tokens a request may generate: ``max_new_tokens``, cut so prompt + output
    fits in ``max_seq_len`` (such a request finishes with reason "length" at the limit)."""
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return min(max_new_tokens, max_seq_len - prompt_len)
