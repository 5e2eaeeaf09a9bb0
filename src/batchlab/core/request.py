"""A request's whole lifecycle in one place.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .numbers import is_int
from .sampling import Sampler, SamplingParams
from .structured import Constraint
from .trace import RequestRecord


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
