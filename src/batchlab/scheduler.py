"""Schedulers: the policy half of the engine, in pure Python (no MLX).

A scheduler owns the waiting queue and the decode slots, and decides what the model
runs. Its ``batches()`` is a generator: it yields one ``Batch`` (one forward pass) at
a time, the engine runs it and records the new tokens, and the generator resumes and
sees the result. The four kinds differ only here:

- ``SequentialScheduler``: one request at a time, start to finish.
- ``StaticScheduler``: up to B requests start together; nobody joins until all finish.
- ``ContinuousScheduler``: iteration-level scheduling in five phases (see ``batches``).
- ``StallFreeScheduler``: a token budget per step, decodes first, one fused pass.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .kv import BlockManager
from .request import Request, State


@dataclass
class Batch:
    """The work of one forward pass."""

    decode: list[Request] = field(default_factory=list)  # one token each
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt tokens)
    padding: list[Request] = field(default_factory=list)  # static: finished rows still computed
    padding_tokens: int = 0  # static: prompt padding a padded batch would compute (not run)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + len(self.padding) + sum(n for _, n in self.prefill)


class Scheduler:
    """What every policy shares: a FIFO queue, B decode slots, KV admission."""

    kind = "base"

    def __init__(self, max_batch_size: int, blocks: BlockManager, clock: Callable[[], float]):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        self.blocks, self.clock = blocks, clock
        self.queue: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_batch_size

    # -- bookkeeping shared by all policies --------------------------------------------
    def add(self, req: Request) -> None:
        self.queue.append(req)

    def has_work(self) -> bool:
        return bool(self.queue) or any(self.slots)

    def free_slot(self) -> int | None:
        return next((i for i, r in enumerate(self.slots) if r is None), None)

    def take_slot(self, req: Request) -> None:
        req.slot = self.free_slot()
        self.slots[req.slot] = req

    def try_admit(self, req: Request) -> bool:
        """Reserve KV blocks for the whole request (prompt + every token it may generate)."""
        if not self.blocks.can_reserve(req.prompt_len + req.max_new_tokens):
            return False
        self.blocks.reserve(req.id, req.prompt_len + req.max_new_tokens)
        return True

    def remove(self, req: Request) -> None:
        """Forget a finished or cancelled request and free everything it held."""
        if req in self.queue:
            self.queue.remove(req)
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        req.slot = None
        self.blocks.release(req.id)

    def batches(self) -> Iterator[Batch]:
        raise NotImplementedError


class SequentialScheduler(Scheduler):
    """One request at a time: prefill its whole prompt, decode it to the end, next."""

    kind = "sequential"

    def __init__(self, blocks: BlockManager, clock):
        super().__init__(1, blocks, clock)

    def batches(self):
        current = self.slots[0]
        if current is None:
            if not self.queue or not self.try_admit(self.queue[0]):
                return
            current = self.queue.popleft()
            self.take_slot(current)
            current.set_state(State.PREFILLING, self.clock())
            yield Batch(prefill=[(current, current.prompt_len)])
            if not current.finished:
                current.set_state(State.DECODING, self.clock())
            return
        yield Batch(decode=[current])


class StaticScheduler(Scheduler):
    """Static batching: take up to B queued requests, prefill them together, decode until
    the longest is done. Finished rows stay in the batch as padding (computed, thrown
    away, their KV memory held) because a rectangular batch cannot shrink."""

    kind = "static"

    def __init__(self, max_batch_size: int, blocks: BlockManager, clock):
        super().__init__(max_batch_size, blocks, clock)
        self.batch: list[Request] = []

    def has_work(self) -> bool:
        return bool(self.queue) or bool(self.batch)

    def remove(self, req: Request) -> None:
        if req not in self.batch:  # still queued: forget it now
            super().remove(req)
        # in the batch: it stays as a padding row until the whole batch ends

    def batches(self):
        if not self.batch:
            while self.queue and len(self.batch) < self.max_batch_size and self.try_admit(self.queue[0]):
                req = self.queue.popleft()
                self.take_slot(req)
                req.set_state(State.PREFILLING, self.clock())
                self.batch.append(req)
            if not self.batch:
                return
            longest = max(r.prompt_len for r in self.batch)
            yield Batch(prefill=[(r, r.prompt_len) for r in self.batch],
                        padding_tokens=sum(longest - r.prompt_len for r in self.batch))
            for r in self.batch:
                if not r.finished:
                    r.set_state(State.DECODING, self.clock())
        live = [r for r in self.batch if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.batch if r.finished])
        if all(r.finished for r in self.batch):  # the batch is over: free its rows
            for r in self.batch:
                super().remove(r)
            self.batch = []


class ContinuousScheduler(Scheduler):
    """Continuous (iteration-level) batching. Each step:

    1. (engine) sweep cancelled requests out;
    2. admit the next queued request into prefilling;
    3. advance its prefill by one chunk of ``prefill_step`` tokens (a separate pass);
    4. move a fully prefilled request into a free decode slot, or keep it waiting;
    5. one batched decode pass over every occupied slot.

    ``prefill_step=None`` prefills a whole prompt at once: the naive variant whose long
    prompts stall everybody's decoding (lesson 3).
    """

    kind = "continuous"

    def __init__(self, max_batch_size: int, blocks: BlockManager, clock,
                 prefill_step: int | None = None):
        super().__init__(max_batch_size, blocks, clock)
        if prefill_step is not None and (not isinstance(prefill_step, int) or prefill_step < 1):
            raise ValueError(f"prefill_step must be an integer >= 1, got {prefill_step!r}")
        self.prefill_step = prefill_step or math.inf
        self.prefilling: Request | None = None
        self.awaiting: deque[Request] = deque()

    def has_work(self) -> bool:
        return super().has_work() or self.prefilling is not None or bool(self.awaiting)

    def remove(self, req: Request) -> None:
        if self.prefilling is req:
            self.prefilling = None
        if req in self.awaiting:
            self.awaiting.remove(req)
        super().remove(req)

    def batches(self):
        now = self.clock
        # 2. Admit one request at a time, and none while a prefilled one still waits.
        if self.prefilling is None and not self.awaiting and self.queue \
                and self.try_admit(self.queue[0]):
            self.prefilling = self.queue.popleft()
            self.prefilling.set_state(State.PREFILLING, now())
        # 3. One chunk of its prompt; the chunk that ends the prompt samples a token.
        req = self.prefilling
        if req is not None:
            yield Batch(prefill=[(req, min(self.prefill_step, req.prefill_left))])
            if req.finished or req.prefill_left == 0:
                self.prefilling = None
                if not req.finished:
                    req.set_state(State.AWAITING_SLOT, now())
                    self.awaiting.append(req)
        # 4. Place prefilled requests into free slots.
        while self.awaiting and self.free_slot() is not None:
            req = self.awaiting.popleft()
            self.take_slot(req)
            req.set_state(State.DECODING, now())
        # 5. One decode step for every occupied slot.
        rows = [r for r in self.slots if r is not None]
        if rows:
            yield Batch(decode=rows)


class StallFreeScheduler(Scheduler):
    """Sarathi-Serve's stall-free batching: a budget of ``token_budget`` tokens a step.
    Every running decode goes first (one token each), then the partial prefills continue
    with what is left, then new requests are admitted while budget and slots remain.
    Everything runs as ONE forward pass, so decodes never wait for a prompt.
    A prefilling request holds its slot from admission, so nobody waits for a slot."""

    kind = "stallfree"

    def __init__(self, max_batch_size: int, blocks: BlockManager, clock, token_budget: int = 256):
        super().__init__(max_batch_size, blocks, clock)
        if not isinstance(token_budget, int) or token_budget < max_batch_size:
            raise ValueError(f"token_budget must be an integer >= max_batch_size "
                             f"({max_batch_size}), got {token_budget!r}")
        self.token_budget = token_budget
        self.prefilling: list[Request] = []  # in admission order

    def remove(self, req: Request) -> None:
        if req in self.prefilling:
            self.prefilling.remove(req)
        super().remove(req)

    def batches(self):
        budget = self.token_budget
        decode = [r for r in self.slots if r is not None and r.state is State.DECODING]
        budget -= len(decode)
        prefill = []
        for req in self.prefilling:
            n = min(budget, req.prefill_left)
            if n > 0:
                prefill.append((req, n))
                budget -= n
        while budget > 0 and self.queue and self.free_slot() is not None \
                and self.try_admit(self.queue[0]):
            req = self.queue.popleft()
            self.take_slot(req)
            req.set_state(State.PREFILLING, self.clock())
            self.prefilling.append(req)
            n = min(budget, req.prompt_len)
            prefill.append((req, n))
            budget -= n
        if decode or prefill:
            yield Batch(decode=decode, prefill=prefill)
        for req, _ in prefill:
            if req.prefill_left == 0 and req in self.prefilling:
                self.prefilling.remove(req)
                if not req.finished:
                    req.set_state(State.DECODING, self.clock())
