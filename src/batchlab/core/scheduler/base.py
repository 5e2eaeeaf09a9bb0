"""The scheduler base: what every kind shares and nothing a kind decides. A queue, B decode
slots, the KV blocks (reserved whole: ``fits``, ``start``), and the flow of a pass: ``grow``
and ``prepare`` before the runner, ``postprocess`` after it (asking the kind's
``finish_reason``, and its ``accept`` for a verify row), ``remove`` / ``release`` when a
request leaves, ``fail`` when a pass raises. Beside it, ``Batch``: what a kind plans for one
pass, and ``StopRules``: the finishing rules that the shipped kinds mix in."""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..kv import BlockManager
from ..policies import Policy, PriorityPolicy
from ..request import Request, State, is_int
from ..runner import Chunk


@dataclass
class Batch:
    """The scheduler's word for one forward pass: which *requests* run and how many prompt
    tokens each. The runner's word for the same pass is ``runner.Chunk`` (which *tokens* run,
    where their keys and values live); ``Scheduler.prepare`` turns a Batch into Chunks, so the
    runner never needs to know about requests, queues or the block manager."""

    decode: list[Request] = field(default_factory=list)  # one token each
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt tokens)
    padding: list[Request] = field(default_factory=list)  # static: finished rows still computed
    padding_tokens: int = 0  # static: prompt padding a padded batch would compute (not run)
    # speculative decoding: request id -> the draft tokens its decode row carries (a verify
    # row of 1 + k tokens); ``postprocess`` fills ``accepted``: id -> drafts that became output
    drafts: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens this pass pushes through the model: decode rows (with their drafts),
        padding rows and prefill chunks."""
        drafted = sum(len(self.drafts.get(r.id, ())) for r in self.decode)
        return len(self.decode) + drafted + len(self.padding) + sum(n for _, n in self.prefill)

    @property
    def requests(self) -> list[Request]:
        return [*self.decode, *(r for r, _ in self.prefill), *self.padding]


@dataclass(frozen=True)
class Option:
    """One option of a scheduler kind, as a command line offers it. ``examples``: values
    the tests run every kind with (edge cases first), so a new kind is tested by declaring
    it."""

    type: type
    help: str
    examples: tuple = ()


class Scheduler:
    """What every policy shares: a queue, B decode slots, the KV blocks, and the flow of
    a pass (``prepare`` before the runner, ``postprocess`` after it).

    It decides nothing: planning (``batches``), the finishing rules (``finish_reason``) and
    which drafts a verify row keeps (``accept``, speculative decoding) are each kind's own
    code, and a kind that does not write them is told so. Its KV memory is the simplest
    there is: ``fits`` / ``start`` reserve a request's whole KV memory
    (prompt + every token it may generate) when it starts, so nothing ever runs out later.
    ``OnDemandKV`` replaces that with blocks taken as requests grow, and preemption when the
    pool runs dry (lesson 8). ``running`` lists every admitted request (it holds KV
    blocks), in admission order.
    """

    kind = "base"
    description = ""  # one line: what this kind does (the CLI, ``batchlab demo``, the README)
    options: dict[str, Option] = {
        "max_batch_size": Option(
            int, "decode slots: at most this many requests decode together (B)", (1, 3, 8)
        ),
    }
    bench_variants: dict[str, dict] = {}  # engines of this kind in ``batchlab bench``: name -> options
    kv_on_demand = False  # blocks taken as requests grow (so prefix caching can share them)
    prefill_lane = False  # prefilling requests hold no decode slot (pictures draw a lane)
    rectangular = False  # a finished request keeps its row (slot, KV) until its whole batch ends

    def __init__(
        self,
        blocks: BlockManager,
        clock: Callable[[], float],
        max_batch_size: int = 8,
        policy: Policy | None = None,
    ):
        if not is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        self.blocks, self.clock = blocks, clock
        self.policy = policy or PriorityPolicy()
        self.queue: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_batch_size
        self.running: list[Request] = []  # admitted, holding KV blocks, in admission order
        self.preempted: list[str] = []  # preempted during the current step
        self.num_preemptions = 0

    @classmethod
    def option_defaults(cls) -> dict:
        """The options this kind takes, with their defaults: its constructor's keyword
        arguments after ``(blocks, clock)``."""
        params = list(inspect.signature(cls.__init__).parameters.values())[3:]
        return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    @classmethod
    def option_specs(cls) -> dict[str, tuple[object, Option | None]]:
        """Each option with its default and its ``Option`` (None where no class in the
        kind's lineage describes it, e.g. ``policy``: an object, not a command-line value)."""
        described: dict[str, Option] = {}
        for klass in reversed(cls.__mro__):
            described.update(getattr(klass, "options", {}) or {})
        return {name: (default, described.get(name)) for name, default in cls.option_defaults().items()}

    # -- bookkeeping shared by all policies --------------------------------------------
    def add(self, req: Request) -> None:
        self.queue.append(req)

    def has_work(self) -> bool:
        return bool(self.queue) or bool(self.running)

    def in_state(self, *states: State) -> list[Request]:
        """The admitted requests in any of ``states``, in admission order."""
        return [r for r in self.running if r.state in states]

    def free_slot(self) -> int | None:
        return next((i for i, r in enumerate(self.slots) if r is None), None)

    def take_slot(self, req: Request) -> None:
        slot = self.free_slot()
        if slot is None:
            raise RuntimeError(
                f"take_slot({req.id}): every decode slot is taken; check "
                f"free_slot() is not None first (or free finished requests)"
            )
        req.slot = slot
        self.slots[slot] = req

    def reserve(self, req: Request) -> bool:
        """Reserve KV blocks for the whole request (prompt + every token it may generate);
        False if the pool cannot promise them now."""
        if not self.blocks.can_reserve(req.prompt_len + req.max_new_tokens):
            return False
        self.blocks.reserve(req.id, req.prompt_len + req.max_new_tokens)
        return True

    def fits(self, req: Request, max_tokens: float) -> bool:
        """Can ``req`` start now, its first chunk at most ``max_tokens`` tokens? Here: can the
        pool promise its whole KV memory (``OnDemandKV`` asks for less)."""
        return self.blocks.can_reserve(req.prompt_len + req.max_new_tokens)

    def start(self, req: Request, max_tokens: float) -> int:
        """``req`` (checked with ``fits``) leaves the queue and starts prefilling, its KV memory
        reserved; returns its first chunk's length: at most ``max_tokens``."""
        if not self.reserve(req):
            raise MemoryError(
                f"start({req.id}): the KV pool cannot hold its {req.prompt_len} + "
                f"{req.max_new_tokens} tokens now ({self.blocks.num_free} blocks free); "
                f"start a request only if self.fits(req, ...)"
            )
        self.begin(req)
        return min(max_tokens, req.prefill_left)

    def begin(self, req: Request) -> None:
        """``req`` leaves the queue and starts prefilling: it joins ``running``."""
        if req in self.queue:
            self.queue.remove(req)
        self.running.append(req)
        req.set_state(State.PREFILLING, self.clock())

    def remove(self, req: Request) -> None:
        """A request leaves (finished, cancelled): free everything it held -- except, in a
        ``rectangular`` batch, a row that still runs: it stays as padding until its batch
        ends and the kind's planning releases it."""
        if self.rectangular and req in self.running:
            return
        self.release(req)

    def release(self, req: Request) -> None:
        """Forget ``req`` and free its slot and KV blocks. A running request released before
        it finished gives its memory back while it still has work: that is a preemption
        (``OnDemandKV.preempt``), and it is counted here, for the trace and ``stats()``."""
        if req in self.queue:
            self.queue.remove(req)
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        if req in self.running:
            self.running.remove(req)
            if not req.finished:
                self.preempted.append(req.id)
                self.num_preemptions += 1
                req.record.preemptions += 1
        req.slot = None
        self.blocks.release(req.id)

    def check_pool_holds(self, num_tokens: int) -> None:
        """Refuse (ValueError) a request that could never fit the KV pool."""
        need = self.blocks.blocks_for(num_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"prompt + max_new_tokens = {num_tokens} tokens needs {need} KV blocks, but the "
                f"engine has {self.blocks.num_blocks} blocks of {self.blocks.block_size} tokens; "
                f"raise num_kv_blocks"
            )

    def passes(self) -> Iterator[Batch]:
        """This step's passes: what the engine iterates. Starts the step's bookkeeping, then
        runs the kind's own planning, ``batches()``, through ``runnable``."""
        self.preempted = []
        yield from self.runnable(self.batches())

    MAX_EMPTY_PASSES = 1000  # in a row, within one step: a planner that will never stop

    def runnable(self, planned: Iterator[Batch]) -> Iterator[Batch]:
        """The passes of ``planned`` that can run: each given its KV memory (``grow``), an
        empty one (nothing planned, or every row gone) dropped. A planner that keeps yielding
        passes with nothing left to run is stopped with a RuntimeError, not followed for ever."""
        empty = 0
        for batch in planned:
            batch = self.grow(batch)
            if batch.decode or batch.prefill:
                empty = 0
                yield batch
                continue
            empty += 1
            if empty >= self.MAX_EMPTY_PASSES:
                raise RuntimeError(
                    f"{type(self).__name__}.batches() yielded {empty} passes in a row with nothing "
                    f"left to run in them: yield a Batch only for requests still in self.running"
                )

    def grow(self, batch: Batch) -> Batch:
        """Give ``batch``'s rows the KV memory they write; return the batch that can run. Here
        nothing to do: every request's memory was reserved whole when it started."""
        return batch

    def finish_reason(self, req: Request, token: int) -> str | None:
        """The finishing rules, after ``req`` got ``token`` (already in ``req.output_ids``):
        "stop", "length", or None to go on (the kind's own code)."""
        raise NotImplementedError(
            f'{type(self).__name__} must write finish_reason(req, token): "stop" when token is '
            f'one of req.stop_ids, "length" when req has max_new_tokens tokens, else None'
        )

    def batches(self) -> Iterator[Batch]:
        """Planning: yield this step's passes, one ``Batch`` each (the kind's own code)."""
        raise NotImplementedError(
            f"{type(self).__name__} must write batches(): the base class plans nothing (it holds "
            f"the queue, the slots, the KV blocks and the flow of a pass, and decides no admission, "
            f"chunk or placement). Yield one Batch per forward pass of the step."
        )

    # -- one pass: before and after the runner --------------------------------------------
    def prepare(self, batch: Batch) -> list[Chunk]:
        """Take the KV blocks ``batch`` writes and describe it to the runner: one chunk per
        request, in ``batch.requests`` order. (On-demand kinds took them in ``grow``; for
        up-front kinds this is where reserved blocks are taken.)"""
        # A decode row: its last token, then its drafts if it has any (a verify row). An empty
        # list of drafts is no verify row. A row whose stop tokens are still banned
        # (``min_new_tokens`` not reached) verifies none: the ban is the same at every position
        # of a row, and a draft could cross the limit. Nor does a constrained row (structured
        # output): its mask after a draft depends on that draft. Blocks taken for dropped drafts go back.
        for r in batch.decode:
            if r.id in batch.drafts and (
                r.sampler.banned or r.constraint is not None or not batch.drafts[r.id]
            ):
                del batch.drafts[r.id]
                self.blocks.truncate(r.id, r.num_computed + 1)
        chunks = [
            self._chunk(r, r.next_input(), sample=True, drafts=batch.drafts.get(r.id, []))
            for r in batch.decode
        ]
        for req, n in batch.prefill:  # the prompt (+ generated tokens, recomputed after preemption)
            end = req.num_computed + n
            chunks.append(
                self._chunk(req, req.token_ids(req.num_computed, end), sample=end == req.prefill_len)
            )
        # static: a finished row's last position is recomputed and the result thrown away
        chunks += [self._chunk(r, r.next_input(), sample=False) for r in batch.padding]
        return chunks

    def _chunk(self, req: Request, tokens: list[int], sample: bool, drafts: list[int] = ()) -> Chunk:
        tokens = [*tokens, *drafts]
        start, end = req.num_computed, req.num_computed + len(tokens)
        table = self.blocks.ensure(req.id, end)
        self.blocks.check_writable(req.id, start, end)
        return Chunk(req.id, tokens, start, list(table), req.sampler if sample else None, len(drafts))

    def postprocess(
        self, batch: Batch, tokens: list[int | list[int] | None], now: float
    ) -> list[tuple[Request, int, str | None]]:
        """The one result hook, after every pass of every kind: advance each request by
        what it computed, hand out the new tokens (one per ``batch.requests`` entry, None
        where none was sampled; for a verify row, its picks, of which ``accept`` keeps some),
        each through the kind's ``finish_reason``, name the full blocks of the accepted tokens
        for the prefix cache, free the requests that finished, and move a request whose
        prompt is done on to decoding (it holds a slot) or to await a slot. Returns
        ``(request, token, finish reason or None)`` for every token handed out."""
        events = []
        rows = len(batch.decode) + len(batch.prefill)
        done = []
        for i, (req, token) in enumerate(zip(batch.requests, tokens)):
            if i >= rows:  # padding: nothing computed that counts
                continue
            start, decode = req.num_computed, i < len(batch.decode)
            req.num_computed += 1 if decode else batch.prefill[i - len(batch.decode)][1]
            if req.finished:  # cancelled during the pass: it leaves at the next sweep
                continue
            drafts = batch.drafts.get(req.id, []) if decode else []
            if token is None:
                run = []
            elif drafts:  # a verify row: the drafts its picks confirm, then the model's own token
                run = self.accept(req, drafts, token)
            else:
                run = [token]
            handed = 0
            for new in run:
                handed += 1
                reason = self.hand_out(req, new, now)
                events.append((req, new, reason))
                if reason is not None:  # a finishing rule fell inside the run: the rest is dropped
                    break
            if drafts:
                # The KV cache keeps the input token and the drafts handed out (the last token
                # handed out is the next input). The rejected drafts' keys and values are
                # garbage: the length goes back over them and the blocks wholly past it are
                # freed (rewind), so nothing unverified is ever read or cached.
                req.num_computed = start + max(handed, 1)
                batch.accepted[req.id] = min(handed, len(run) - 1)
                self.blocks.truncate(req.id, req.num_computed)
            # Full blocks of verified tokens join the prefix cache, now that the tokens are
            # handed out and the length is final (and before a finished request gives its
            # blocks back, so that a later prompt can share them).
            self.blocks.cache_full_blocks(req.id, req.num_computed, req.token_ids)
            if req.finished:
                done.append(req)
        for req in done:
            self.remove(req)
        for req, _ in batch.prefill:  # a finished prompt moves on: decode in its slot, or await one
            if req.prefill_left == 0 and req.state is State.PREFILLING:
                req.set_state(State.DECODING if req.slot is not None else State.AWAITING_SLOT, self.clock())
        return events

    def accept(self, req: Request, drafts: list[int], picks: list[int]) -> list[int]:
        """The tokens a verify row adds: the drafts its picks confirm, then the model's own
        (the kind's own rule: the stall-free kind's speculates, lesson 11's the learner's)."""
        raise NotImplementedError(
            f"{type(self).__name__} must write accept(req, drafts, picks): keep the drafts while each "
            f"equals the model's pick at its own position, then add the model's pick where the first "
            f"one did not (or after the last draft, a bonus); return those tokens"
        )

    def hand_out(self, req: Request, token: int, now: float) -> str | None:
        """``req`` gets ``token``; the kind's ``finish_reason`` says whether it ends there
        (then it finishes now; ``postprocess`` frees it after the pass)."""
        req.add_token(token, now)
        reason = self.finish_reason(req, token)
        if reason not in (None, "stop", "length"):
            raise TypeError(
                f'{type(self).__name__}.finish_reason returned {reason!r}: "stop", "length" or None'
            )
        if reason is not None:
            req.finish(reason, now)
        return reason

    def fail(self, batch: Batch, cause: BaseException, now: float) -> list[Request]:
        """The pass of ``batch`` raised ``cause``: its requests finish with reason "error"
        and give back everything they hold. Returns the requests it finished."""
        ended = [req for req in batch.requests if req.fail(cause, now)]
        for req in batch.requests:
            self.remove(req)
        return ended

    def abandon(self, cause: BaseException, now: float) -> list[Request]:
        """The step raised ``cause`` in the scheduler's own code, so its state cannot be trusted:
        every request it holds, queued or running, finishes with reason "error" and gives
        back everything it holds. Returns the requests it finished."""
        held = [*self.queue, *self.running]
        ended = [req for req in held if req.fail(cause, now)]
        for req in held:
            self.release(req)
        return ended

    def kv_usage(self) -> dict:
        """What KV memory looks like now (for the trace and ``stats``)."""
        b = self.blocks
        return {
            "num_kv_blocks": b.num_blocks,
            "free_kv_blocks": b.num_free,
            "kv_blocks_used": b.num_blocks - b.num_free,
            "block_tables": {rid: list(t) for rid, t in b.tables.items()},
            "cached_blocks": list(b.evictable),
            "preemptions": self.num_preemptions,
            "prefix_cache_hits": b.hit_blocks,
            "prefix_cache_hit_tokens": b.hit_tokens,
        }


# The finishing rules of the shipped kinds: when a new token ends a request. (A learner's
# engine has its own, written in lesson 1.)
class StopRules:
    """A request ends with "stop" on one of its stop tokens (EOS unless ``ignore_eos``, and
    its ``stop_token_ids``), else with "length" once it has ``max_new_tokens`` tokens. The
    engine cut ``max_new_tokens`` at submit so that prompt + output fits ``max_seq_len``, and
    the sampler picks no stop token before ``min_new_tokens``. Mixed into a ``Scheduler``."""

    def finish_reason(self, req: Request, token: int) -> str | None:
        if token in req.stop_ids:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None
