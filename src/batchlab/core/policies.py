"""Policies: who is served first, who gives way, and what happens under overload.

``PriorityPolicy`` orders the queue and picks the victim of a preemption; the
schedulers consult it. ``Policy`` and ``AdmissionBase`` are the same interfaces with no
decision in them, for a learner's own (lessons 8 and 9). *Admission control* and *load shedding* decide what an engine
does when more work arrives than it can serve.

*Admission control* refuses a request at the door (``submit`` raises ``QueueFull``) when
the queue already holds ``max_queue`` waiting requests: the client learns at once and can
retry or go elsewhere (a server answers HTTP 429). *Load shedding* drops requests that
were admitted but have waited so long that serving them is pointless: each step, queued
requests that have waited more than ``max_wait_s`` finish with reason ``"shed"``. Both
keep the queue, and so the waiting time of everybody behind it, bounded under overload.

The engine consults one ``Admission`` object; the default admits everything and sheds
nothing, so an engine without options behaves exactly as before.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from .request import Request, State, is_number


class Policy:
    """What the schedulers ask a policy. The order is the meaning of a request's
    ``priority`` (lower is more important, as in vLLM): the queue is served by priority,
    then queue order, so with every priority 0 it is first come, first served, and a
    preempted request (put back at the front) comes first again; among equals the older
    request matters more. Who gives way when KV memory runs out is a decision, so this
    base makes none: ``victim`` is a subclass's to write (lesson 8)."""

    @staticmethod
    def importance(req: Request) -> tuple:
        return req.priority, req.arrival_s  # smaller is more important

    def next_queued(self, queue: deque[Request]) -> Request:
        return min(queue, key=lambda r: r.priority)  # the first of the best priority

    def victim(self, running: list[Request]) -> Request:
        raise NotImplementedError(
            f"{type(self).__name__} must write victim(running): which running request gives "
            f"back its KV blocks when the pool runs dry"
        )


class PriorityPolicy(Policy):
    """Ours: the victim of a preemption is the least important running request, the
    newest among equals (it has the least work to lose), the last admitted on a tie."""

    def victim(self, running: list[Request]) -> Request:
        return max(reversed(running), key=self.importance)  # ties: the latest admitted


class AgingPolicy(PriorityPolicy):
    """Ours, with *aging*: a waiting request gains importance as it waits, one priority level
    every ``age_s`` seconds, so a request of a less important class is never starved: it
    starts before every more important request that arrived ``age_s`` (per level) after it.
    Aging at a steady rate never needs the clock: two requests' aged priorities
    ``priority - (now - arrival_s) / age_s`` compare as ``arrival_s + age_s * priority`` do,
    whatever ``now`` is. So the order is fixed at arrival, a deadline of sorts: the earlier
    deadline is more important, the more important class on a tie."""

    def __init__(self, age_s: float = 30.0):
        if not is_number(age_s) or not 0 < age_s < math.inf:
            raise ValueError(f"age_s must be a number of seconds > 0, got {age_s!r}")
        self.age_s = age_s

    def importance(self, req: Request) -> tuple:
        return req.arrival_s + self.age_s * req.priority, req.priority  # smaller is more important

    def next_queued(self, queue: deque[Request]) -> Request:
        return min(queue, key=self.importance)  # the first in queue order among equals


class QueueFull(Exception):
    """``submit`` was refused because the queue is at its bound (a server's HTTP 429)."""


@dataclass(frozen=True)
class AdmissionBase:
    """Admission with no rule in it: ``max_queue``, the most requests waiting to start that
    the door lets in (None: unbounded), and ``max_wait_s``, the wait a shedding rule reads
    (None: never shed). Who is refused at the door (``check_room``) and which queued
    requests to shed (``to_shed``) are decisions, so this base makes neither: both are a
    subclass's to write (lesson 9)."""

    max_queue: int | None = None
    max_wait_s: float | None = None

    def __post_init__(self):
        if self.max_queue is not None and (not isinstance(self.max_queue, int) or self.max_queue < 0):
            raise ValueError(f"max_queue must be an integer >= 0 or None, got {self.max_queue!r}")
        if self.max_wait_s is not None and not (
            isinstance(self.max_wait_s, (int, float))
            and self.max_wait_s >= 0
            and math.isfinite(self.max_wait_s)
        ):
            raise ValueError(f"max_wait_s must be a number >= 0 or None, got {self.max_wait_s!r}")

    def check_room(self, queue_depth: Callable[[], int]) -> None:
        """The door: raise ``QueueFull`` to refuse one more request (``queue_depth()``: how
        many wait now)."""
        raise NotImplementedError(
            f"{type(self).__name__} must write check_room(queue_depth): raise QueueFull when "
            f"max_queue requests already wait (None: no bound)"
        )

    def to_shed(self, queue: Iterable[Request], now: float) -> list[Request]:
        """The queued requests to give up on now (finished as "shed")."""
        raise NotImplementedError(
            f"{type(self).__name__} must write to_shed(queue, now): the queued requests to give up on now"
        )


@dataclass(frozen=True)
class Admission(AdmissionBase):
    """Ours: refuse at the door when ``max_queue`` requests wait; shed the queued requests
    with no token yet that waited more than ``max_wait_s``."""

    def check_room(self, queue_depth: Callable[[], int]) -> None:
        """Raise ``QueueFull`` if one more waiting request would exceed the bound.
        (``queue_depth`` is called only when there is a bound: counting costs time.)"""
        if self.max_queue is not None and queue_depth() >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} waiting); retry later")

    def to_shed(self, queue: Iterable[Request], now: float) -> list[Request]:
        """Queued requests with no token yet (one preempted after its first token has begun
        its answer: it stays) that have waited longer than ``max_wait_s``."""
        if self.max_wait_s is None:
            return []
        return [
            r
            for r in queue
            if r.state is State.QUEUED and not r.output_ids and now - r.arrival_s > self.max_wait_s
        ]
