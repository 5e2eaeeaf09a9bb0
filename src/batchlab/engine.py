"""The engine: submit / step / poll / cancel, tying a scheduler (policy) to the model
runner (mechanism), and recording a trace of every step.

Thread safety: ``submit``, ``poll`` and ``cancel`` may be called from any thread while
another thread calls ``step`` (``EngineLoop`` does exactly that). They only touch
request bookkeeping under a lock; the forward passes run outside it, so a poll never
waits for the model.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from typing import Sequence

from . import metrics
from .kv import BlockManager
from .loop import EngineLoop  # noqa: F401  (re-exported: it lived here before loop.py)
from .model import LoadedModel
from .policies import Admission
from .prompts import check_prompt_ids, clamp_new_tokens
from .request import Request, State
from .runner import Chunk, ModelRunner
from .sampling import SamplingParams, sample_rows
from .scheduler import (Batch, ContinuousScheduler, Scheduler, SequentialScheduler,
                        StallFreeScheduler, StaticScheduler)
from .trace import StepRecord, Trace

KINDS = ("sequential", "static", "continuous", "stallfree")


class Engine:
    def __init__(self, lm: LoadedModel, scheduler: Scheduler, runner, max_seq_len: int,
                 trace_limit: int | None = None, admission: Admission | None = None):
        self.lm, self.scheduler, self.runner = lm, scheduler, runner
        self.admission = admission or Admission()  # default: admit everything, shed nothing
        self.blocks = scheduler.blocks
        self.max_seq_len = max_seq_len
        self.trace = Trace(scheduler.kind, scheduler.max_batch_size,
                           num_kv_blocks=scheduler.blocks.num_blocks)
        # A long-running server keeps only the last `trace_limit` steps, and forgets a
        # request's record once poll has reported it done, so memory stays bounded.
        self.trace_limit = trace_limit
        if trace_limit is not None:
            self.trace.steps = collections.deque(maxlen=trace_limit)
        self.clock = scheduler.clock  # seconds since the engine was made; every timestamp uses it
        self._lock = threading.Lock()
        self._requests: dict[str, Request] = {}  # every request not yet reported done by poll
        self._inbox: list[Request] = []  # submitted, not yet in the scheduler's queue
        self._cancelled: list[Request] = []  # cancelled, not yet swept out of the scheduler
        self._ids = itertools.count()
        self._step_index = 0
        self.finished_by_reason: dict[str, int] = {}

    # -- the client side ------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int = 32, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               ignore_eos: bool = False, request_id: str | None = None, priority: int = 0,
               arrival_s: float | None = None) -> str:
        """Queue a request; return its id. Bad arguments raise ValueError and change nothing;
        a full queue (see ``policies.Admission``) raises ``QueueFull``.

        ``priority``: lower is more important (as in vLLM); continuous and stall-free
        engines serve the queue by it and preempt the least important first. Static and
        sequential engines serve first come, first served. ``arrival_s`` (default: now)
        lets a driver that submits between steps give the time the request was due."""
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
            raise ValueError("submit takes a list of token ids; encode text with the tokenizer first")
        prompt_ids = list(prompt_ids)
        check_prompt_ids(prompt_ids, self.lm.tokenizer.vocab_size, self.max_seq_len)
        max_new = clamp_new_tokens(len(prompt_ids), max_new_tokens, self.max_seq_len)
        sampling = SamplingParams(temperature, top_p, top_k, seed)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer (lower is more important), got {priority!r}")
        need = self.blocks.blocks_for(len(prompt_ids) + max_new)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"prompt + max_new_tokens = {len(prompt_ids) + max_new} tokens needs {need} KV blocks, "
                f"but the engine has {self.blocks.num_blocks} blocks of {self.blocks.block_size} "
                f"tokens; raise num_kv_blocks")
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            self.admission.check_room(self._queue_depth)
            stop = frozenset() if ignore_eos else self.lm.tokenizer.eos_token_ids
            now = self.clock()
            arrived = now if arrival_s is None else min(float(arrival_s), now)
            req = Request(rid, prompt_ids, max_new, sampling, stop, arrived, priority=priority)
            self._requests[rid] = req
            self._inbox.append(req)
            self.trace.requests[rid] = req.record
        return rid

    def poll(self, req_id: str) -> tuple[list[int], str, str | None]:
        """Drain the request's new tokens and read its status in one atomic step.

        Returns ``(new_tokens, status, finish_reason)``; status is "running", "done" or
        "unknown". Reading tokens and status separately could miss the last tokens
        (produced between the two calls) -- hence one call under one lock. Once "done" has
        been reported the engine forgets the request, and later polls say "unknown".
        """
        with self._lock:
            req = self._requests.get(req_id)
            if req is None:
                return [], "unknown", None
            tokens, req.pending = req.pending, []
            if req.finished:
                del self._requests[req_id]
                if self.trace_limit is not None:
                    self.trace.requests.pop(req_id, None)
                return tokens, "done", req.finish_reason
            return tokens, "running", None

    def cancel(self, req_id: str) -> bool:
        """Stop a request in any state; True if it was running, False if finished or unknown.
        Its slot and KV blocks are freed at the start of the next step."""
        with self._lock:
            req = self._requests.get(req_id)
            if req is None or req.finished:
                return False
            self._finish(req, "cancelled")
            self._cancelled.append(req)
            return True

    # -- the engine side -------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration. Returns False when there was nothing to do."""
        with self._lock:
            self._sweep()  # 1. cancelled requests leave, freeing their slots and KV blocks
            for req in self._inbox:
                if not req.finished:
                    self.scheduler.add(req)
            self._inbox.clear()
            for req in self.admission.to_shed(self.scheduler.queue, self.clock()):
                self._finish(req, "shed")  # waited too long: it leaves without running
                self.scheduler.remove(req)
            if not self.scheduler.has_work():
                return False
            record = StepRecord(self._step_index, self.clock(), queued=len(self.scheduler.queue))
        self._step_index += 1
        # 2-5. The scheduler hands out one forward pass at a time and sees each result.
        for batch in self.scheduler.batches():
            self._run(batch, record)
        record.slots = [r.id if r is not None else None for r in self.scheduler.slots]
        record.kv_blocks_used = self.blocks.num_blocks - self.blocks.num_free
        record.block_tables = {rid: list(table) for rid, table in self.blocks.tables.items()}
        record.cached_blocks = list(self.blocks.evictable)
        record.preempted, self.scheduler.preempted = self.scheduler.preempted, []
        record.end_s = self.clock()
        self.trace.steps.append(record)
        return True

    def sweep(self) -> None:
        """Free what cancelled requests hold now (``step`` does this first anyway)."""
        with self._lock:
            self._sweep()

    def _sweep(self) -> None:
        for req in self._cancelled:
            self.scheduler.remove(req)
        self._cancelled.clear()

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def _run(self, batch: Batch, record: StepRecord) -> None:
        """Run one forward pass, then sample and record the new tokens."""
        with self._lock:  # a request cancelled meanwhile does not run
            decode = [r for r in batch.decode if not r.finished]
            prefill = [(r, n) for r, n in batch.prefill if not r.finished]
        chunks, samples = [], []  # samples: (request, chunk index) that get a new token
        for req in decode:
            self.blocks.ensure(req.id, req.num_computed + 1)
            samples.append((req, len(chunks)))
            chunks.append(Chunk(req.id, req.next_input(), req.num_computed))
        for req in batch.padding:  # recompute its last position; the result is thrown away
            self.blocks.ensure(req.id, req.num_computed + 1)
            chunks.append(Chunk(req.id, req.next_input(), req.num_computed))
        for req, n in prefill:  # the prompt (+ generated tokens, recomputed after preemption)
            self.blocks.ensure(req.id, req.num_computed + n)
            if req.num_computed + n == req.prefill_len:
                samples.append((req, len(chunks)))
            chunks.append(Chunk(req.id, req.token_ids(req.num_computed, req.num_computed + n),
                                req.num_computed))
            record.prefill.append((req.id, req.num_computed, n))
        if not chunks:
            return
        record.decoded += [r.id for r in decode]
        record.slot_of.update({r.id: r.slot for r in decode + [r for r, _ in prefill] + batch.padding
                               if r.slot is not None})
        record.padding += [r.id for r in batch.padding]
        record.padding_tokens += batch.padding_tokens
        start = self.clock()  # a simulator's clock advances inside forward()
        logits = self.runner.forward(chunks)
        tokens = sample_rows(logits[[i for _, i in samples]], [r.sampler for r, _ in samples]) \
            if samples else []
        record.forward_s += self.clock() - start
        record.passes += 1
        with self._lock:
            for req in decode:
                req.num_computed += 1
            for req, n in prefill:
                req.num_computed += n
            for req in decode + [r for r, _ in prefill]:  # full blocks join the prefix cache
                if not req.finished:
                    self.blocks.cache_full_blocks(req.id, req.num_computed, req.token_ids)
            now = self.clock()
            for (req, _), token in zip(samples, tokens):
                if req.finished:  # cancelled while the pass ran
                    continue
                record.emitted.setdefault(req.id, []).append(token)
                reason = req.add_token(token, now)
                if reason is not None:
                    self._finish(req, reason)
                    record.finished[req.id] = reason
                    self.scheduler.remove(req)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish(reason, self.clock())
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def queue_depth(self) -> int:
        """Requests submitted but not yet admitted (for admission control and /metrics)."""
        with self._lock:
            return self._queue_depth()

    def _queue_depth(self) -> int:
        return sum(not r.finished for r in (*self._inbox, *self.scheduler.queue))

    # -- what happened ----------------------------------------------------------------------
    def stats(self) -> dict:
        """Live counters (queue, running, KV blocks, preemptions, prefix-cache hits in
        blocks and in tokens, finishes) plus every metric of ``metrics.summarize`` over the
        trace so far."""
        with self._lock:
            snapshot = Trace(self.trace.kind, self.trace.max_batch_size, list(self.trace.steps),
                             dict(self.trace.requests))
            running = sum(1 for r in self._requests.values() if not r.finished)
            finished = dict(self.finished_by_reason)
            queued = self._queue_depth()
        return {**metrics.summarize(snapshot), "running": running, "queued": queued,
                "finished": finished, "num_kv_blocks": self.blocks.num_blocks,
                "free_kv_blocks": self.blocks.num_free,
                "preemptions": self.scheduler.num_preemptions,
                "prefix_cache_hits": self.blocks.hit_blocks,
                "prefix_cache_hit_tokens": self.blocks.hit_tokens}


def make_engine(kind: str, lm: LoadedModel, max_batch_size: int | None = None,
                prefill_step: int | None = None, token_budget: int | None = None,
                kv_block_size: int = 16, num_kv_blocks: int | None = None,
                max_seq_len: int | None = None, executor=ModelRunner,
                trace_limit: int | None = None, enable_prefix_cache: bool = False,
                admission: Admission | None = None, clock=None) -> Engine:
    """Build an engine of one kind: sequential | static | continuous | stallfree.

    Options that do not apply to a kind are an error, not silently ignored:
    sequential takes no batch size; only continuous takes ``prefill_step``; only
    stallfree takes ``token_budget``. ``executor(lm, blocks)`` builds what runs the
    batches: the real ``ModelRunner`` unless a test or simulator passes another.
    ``enable_prefix_cache`` (continuous and stallfree) shares the KV blocks of a prompt
    prefix that an earlier request already computed.
    ``admission`` bounds the queue and sheds stale requests (default: neither).
    ``clock()`` gives every timestamp in seconds (default: real time since the engine
    was made; the simulator passes its virtual clock).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of {', '.join(KINDS)}")
    given = {"max_batch_size": max_batch_size, "prefill_step": prefill_step,
             "token_budget": token_budget}
    allowed = {"sequential": set(), "static": {"max_batch_size"},
               "continuous": {"max_batch_size", "prefill_step"},
               "stallfree": {"max_batch_size", "token_budget"}}[kind]
    wrong = [k for k, v in given.items() if v is not None and k not in allowed]
    if enable_prefix_cache and kind not in ("continuous", "stallfree"):
        wrong.append("enable_prefix_cache")
    if wrong:
        raise ValueError(f"{', '.join(wrong)} does not apply to the {kind} engine")
    max_seq_len = max_seq_len or lm.max_seq_len
    if not isinstance(max_seq_len, int) or not 2 <= max_seq_len <= lm.max_seq_len:
        raise ValueError(f"max_seq_len must be an integer in [2, {lm.max_seq_len}]")
    batch = 1 if kind == "sequential" else (8 if max_batch_size is None else max_batch_size)
    if num_kv_blocks is None:  # room for a full-length request, or ~1k tokens per slot
        num_kv_blocks = math.ceil(max(max_seq_len, (batch + 1) * 1024) / kv_block_size)
    blocks = BlockManager(num_kv_blocks, kv_block_size, enable_prefix_cache)
    if clock is None:
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

    scheduler = {
        "sequential": lambda: SequentialScheduler(blocks, clock),
        "static": lambda: StaticScheduler(batch, blocks, clock),
        "continuous": lambda: ContinuousScheduler(batch, blocks, clock, prefill_step),
        "stallfree": lambda: StallFreeScheduler(
            batch, blocks, clock, 256 if token_budget is None else token_budget),
    }[kind]()
    return Engine(lm, scheduler, executor(lm, blocks), max_seq_len, trace_limit, admission)
