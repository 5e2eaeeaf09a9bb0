"""The engine: submit / step / poll / cancel, tying a scheduler (policy, and the owner of
KV memory) to a runner (mechanism), and recording a trace of every step. Each pass is
``scheduler.prepare`` → ``runner.run`` → ``scheduler.postprocess``; the engine itself
never touches KV blocks.

Thread discipline: ``submit``, ``poll``, ``cancel``, ``queue_depth`` and ``stats`` may be
called from any thread while another thread calls ``step`` (``EngineLoop`` does exactly
that). One lock guards every request, the scheduler's state and the trace: each of
those calls holds it, and so does ``step`` for everything but the forward passes --
the scheduler plans each pass (and takes its KV blocks) under the lock, ``runner.run``
computes it outside, the scheduler takes the result under the lock again. So a poll
never waits for the model, and nobody ever reads a half-planned step.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import threading
import time
from typing import Sequence

from . import metrics
from .runner import Model, Runner
from .kv import BlockManager
from .policies import Admission, AdmissionBase
from .request import CheckedRequest, Request, SamplingParams, check_prompt_ids, clamp_new_tokens, is_int
from .structured import Constraint, StructuredOutputs, compile_constraint
from .scheduler import KINDS, Batch, Scheduler, import_from_here, scheduler_class  # noqa: F401 (engine's names)
from .trace import StepRecord, Trace

log = logging.getLogger("batchlab")


class EngineFailing(RuntimeError):
    """Half or more of an engine's forward passes failed: a bug in the engine or its runner
    (or in a learner's scheduler), not bad luck for one request."""


def _sampling_params(params: SamplingParams | None, fields: dict) -> SamplingParams:
    """A request's ``SamplingParams``: ``params`` itself, or one made of the keywords ``fields``
    (``submit(ids, max_new_tokens=8, temperature=0.7)``); both, or a keyword that is not one of
    its fields, is a ValueError."""
    if params is not None:
        if fields:
            raise ValueError(
                f"give params= or the keywords {', '.join(sorted(fields))}, not both "
                f"(a SamplingParams holds them all)"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {params!r}")
        return params
    known = [f.name for f in dataclasses.fields(SamplingParams)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(
            f"a request has no parameter {', '.join(unknown)}: it takes request_id, arrival_s, "
            f"priority and SamplingParams' fields ({', '.join(known)})"
        )
    return SamplingParams(**fields)


class EngineBase:
    """The engine without its front: ``submit``, ``step`` (plan, run, postprocess, under one
    lock), the trace, stats and failure. ``poll`` and ``cancel``, the calls a client makes to
    read and stop its request, are the front's: ``Engine`` has ours, a learner's engine its
    own (lesson 6)."""

    def __init__(
        self,
        lm: Model,
        scheduler: Scheduler,
        runner: Runner,
        max_seq_len: int,
        trace_limit: int | None = None,
        admission: AdmissionBase | None = None,
        lock=None,
    ):
        self.lm, self.scheduler, self.runner = lm, scheduler, runner
        self.admission = admission or Admission()  # default: admit everything, shed nothing
        self.max_seq_len = max_seq_len
        self.trace = Trace(
            scheduler.kind,
            scheduler.max_batch_size,
            num_kv_blocks=scheduler.kv_usage()["num_kv_blocks"],
            prefill_lane=scheduler.prefill_lane,
            token_budget=getattr(scheduler, "token_budget", None),  # as the kind chose it
        )
        # A long-running server keeps only the last `trace_limit` steps, and forgets a
        # request's record once poll has reported it done, so memory stays bounded.
        self.trace_limit = trace_limit
        if trace_limit is not None:
            self.trace.steps = collections.deque(maxlen=trace_limit)
        self.clock = scheduler.clock  # seconds since the engine was made; every timestamp uses it
        # The one lock of the thread discipline above. ``lock`` (anything with the context
        # manager protocol) lets a checker count how often a front takes it.
        self._lock = lock if lock is not None else threading.Lock()
        self._requests: dict[str, Request] = {}  # every request not yet reported done by poll
        self._inbox: list[Request] = []  # submitted, not yet in the scheduler's queue
        self._cancelled: list[Request] = []  # cancelled, not yet swept out of the scheduler
        self._ids = itertools.count()
        self._step_index = 0
        self.finished_by_reason: dict[str, int] = {}
        # Forward passes that ran and that raised, and the first error: a pass that fails
        # now and then ends its requests and the engine goes on; passes that fail as often
        # as they run are a broken engine, said once (``failing``).
        self.passes_ok = self.passes_failed = 0
        self.spec_drafted = self.spec_accepted = 0  # draft tokens verified, and kept, since the start
        self.first_error: BaseException | None = None
        self._said_failing = False

    # -- the client side ------------------------------------------------------------------
    def check_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        **fields,
    ) -> CheckedRequest:
        """Check a request against this engine and return it for ``enqueue``; a bad argument
        raises ValueError (nothing changes: this touches no shared state, so it needs no lock).

        ``params`` (a ``SamplingParams``) is everything the request asks of its generation;
        without it, the keywords ``fields`` make one (``max_new_tokens=8, temperature=0.7``...:
        ``SamplingParams``'s fields, which check themselves). Giving both is an error.
        ``priority``: lower is more important (as in vLLM); continuous and stall-free engines
        serve the queue by it and preempt the least important first. Static and sequential
        engines serve first come, first served.

        What needs the engine is checked here: the prompt's ids, the stop tokens within the
        vocabulary, ``max_new_tokens`` cut so that prompt + output fits the maximum sequence
        length, the KV pool large enough, and ``structured_outputs`` compiled (one the grammar
        library cannot compile is a ValueError naming it). ``stop_token_ids`` end the request
        too (also with ``ignore_eos``, as in vLLM), and no stop token is sampled before it has
        ``min_new_tokens`` tokens (vLLM's ``min_tokens``)."""
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
            raise ValueError("submit takes a list of token ids; encode text with the tokenizer first")
        prompt_ids = list(prompt_ids)
        check_prompt_ids(prompt_ids, self.lm.tokenizer.vocab_size, self.max_seq_len)
        params = _sampling_params(params, fields)
        if not is_int(priority):
            raise ValueError(f"priority must be an integer (lower is more important), got {priority!r}")
        vocab = self.lm.tokenizer.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[:3]!r}")
        max_new = clamp_new_tokens(len(prompt_ids), params.max_new_tokens, self.max_seq_len)
        self.scheduler.check_pool_holds(len(prompt_ids) + max_new)  # the pool's size never changes
        eos = frozenset() if params.ignore_eos else self.lm.tokenizer.eos_token_ids
        spec = params.structured_outputs
        return CheckedRequest(
            prompt_ids,
            params,
            max_new,
            eos | frozenset(params.stop_token_ids),
            priority,
            constraint=None if spec is None else self.compile(spec),
        )

    def new_id(self) -> str:
        """A request id nobody has had (call it under ``self._lock``)."""
        return f"req-{next(self._ids)}"

    def enqueue(self, req_id: str, checked: CheckedRequest, arrival_s: float | None = None) -> Request:
        """The request ``req_id``, as ``check_request`` returned it (``checked``), arrived now
        (or at ``arrival_s``, no later than now: a driver that submits between steps gives the
        time the request was due): known to ``poll`` and ``cancel`` from here on, handed to the
        next step. Call it under ``self._lock``."""
        now = self.clock()
        arrived = now if arrival_s is None else min(float(arrival_s), now)
        req = checked.request(req_id, arrived)
        self._requests[req_id] = req
        self._inbox.append(req)
        self.trace.requests[req_id] = req.record
        return req

    def submit(
        self,
        prompt_ids: Sequence[int],
        request_id: str | None = None,
        arrival_s: float | None = None,
        **params,
    ) -> str:
        """Queue a request; return its id. Bad arguments (``check_request``), an id in use
        raise ValueError and change nothing; a full queue (see ``policies.Admission``) raises
        ``QueueFull``. The front's to write (lesson 6)."""
        raise NotImplementedError(
            f"{type(self).__name__} must write submit(): check the request, then under one hold of "
            f"self._lock give it an id (yours or a new one), refuse an id in use, check the queue's "
            f"room and enqueue it"
        )

    def poll(self, req_id: str) -> tuple[list[int], str, str | None]:
        """The request's new tokens and its status: ``(new_tokens, status, finish_reason)``,
        status "running", "done" or "unknown". The front's to write (lesson 6)."""
        raise NotImplementedError(
            f"{type(self).__name__} must write poll(): drain the request's new tokens and read "
            f"its status in one atomic step, under self._lock"
        )

    def cancel(self, req_id: str) -> bool:
        """Stop a request; True if it was running. The front's to write (lesson 6)."""
        raise NotImplementedError(
            f"{type(self).__name__} must write cancel(): finish a running request as "
            f"'cancelled' and hand it to the next step's sweep, under self._lock"
        )

    def stop_string_met(self, req_id: str) -> bool:
        """The request's text met one of its stop strings (the server detokenizes; the engine
        sees only tokens): it finishes now with reason "stop", a completed request like one
        that met EOS, and gives back its slot and KV blocks at the next sweep. True if it
        was running."""
        with self._lock:
            req = self._requests.get(req_id)
            if req is None or req.finished:
                return False
            self._finish(req, "stop")
            self._cancelled.append(req)
            return True

    # -- the engine side -------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration. Returns False when there was nothing to do.

        If the scheduler's code raises (its planning, its finishing rules, the shedding
        policy: a learner's, say), the step is lost: every request the scheduler held ends
        with reason "error" and gives back its slot and KV blocks, the engine is left clean
        for the next step (``contained`` names the error), and the error is raised to the
        caller. ``EngineLoop`` logs it and serves on; a checker reports it."""
        try:
            return self._step()
        except Exception as e:
            self._contain(e)
            raise

    def _contain(self, e: Exception) -> None:
        with self._lock:
            now = self.clock()
            ended = [r for r in self._inbox if r.fail(e, now)]  # submitted, not yet handed over: they end too
            ended += self.scheduler.abandon(e, now)
            self._inbox.clear()
            for _ in ended:
                self._count("error")
            self.passes_failed += 1
            self.first_error = self.first_error or e
            self.contained = e
        log.error(
            "the scheduler raised; the %d request(s) it held finish with reason 'error'",
            len(ended),
            exc_info=e,
        )

    contained: BaseException | None = None  # the last error a step raised after cleaning up

    def _step(self) -> bool:
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
            passes = self.scheduler.passes()
        # 2-5. The scheduler hands out one forward pass at a time and sees each result.
        while True:
            with self._lock:
                self._sweep()  # a request cancelled during the last pass leaves before the next
                batch = next(passes, None)  # planning: under the lock
                if batch is None:
                    self._end_step(record)
                    return True
                chunks = self.scheduler.prepare(batch)
                self._record_pass(batch, record)
            self._run(batch, chunks, record)

    def sweep(self) -> None:
        """Free what cancelled requests hold now (``step`` does this first anyway)."""
        with self._lock:
            self._sweep()

    def _sweep(self) -> None:
        for req in self._cancelled:
            self.scheduler.remove(req)
        self._cancelled.clear()

    def run_until_idle(self) -> None:
        """Step until there is nothing to do. Raises ``EngineFailing`` at the end (every
        request has finished by then) if half or more of the passes failed."""
        while self.step():
            pass
        self.raise_if_failing()

    @property
    def failing(self) -> str | None:
        """Why this engine is broken, or None: at least two forward passes failed, and no
        fewer failed than ran. One failure among many is not this (its requests end with
        "error" and the others go on); this is every pass of some kind failing."""
        if self.passes_failed < 2 or self.passes_failed < self.passes_ok:
            return None
        e = self.first_error
        return (
            f"{self.passes_failed} of the engine's {self.passes_ok + self.passes_failed} forward "
            f"passes failed, the first with {type(e).__name__}: {str(e).rstrip('.')}. This is a bug in the engine, "
            f"its runner or its scheduler, not in the requests: every request those passes "
            f"carried ended with finish reason 'error'."
        )

    def raise_if_failing(self) -> None:
        if self.failing:
            raise EngineFailing(self.failing) from self.first_error

    def _record_pass(self, batch: Batch, record: StepRecord) -> None:
        record.decoded += [r.id for r in batch.decode]
        record.prefill += [(r.id, r.num_computed, n) for r, n in batch.prefill]
        record.slot_of.update({r.id: r.slot for r in batch.requests if r.slot is not None})
        record.padding += [r.id for r in batch.padding]
        record.padding_tokens += batch.padding_tokens
        for rid, drafts in batch.drafts.items():
            record.drafts[rid] = record.drafts.get(rid, 0) + len(drafts)

    def _run(self, batch: Batch, chunks, record: StepRecord) -> None:
        """One forward pass, outside the lock; the scheduler takes the new tokens (or the
        failure) under it, and the engine records what happened."""

        def masks():  # structured output: constrained rows' masks, before or during the pass
            began = self.clock()
            self.constrain(batch, chunks)
            record.mask_s += self.clock() - began

        start = None  # when the pass began (a simulator's clock advances inside the runner)
        try:
            if not self.masks_during_pass:
                masks()
            start = self.clock()
            tokens = (
                self.runner.run(chunks, meanwhile=masks)
                if self.masks_during_pass
                else self.runner.run(chunks)
            )
        except Exception as e:  # the pass is lost: its requests end, everyone else goes on
            with self._lock:
                self._pass_failed(e, len(chunks))
                for req in self.scheduler.fail(batch, e, self.clock()):
                    self._count("error")
                    record.finished[req.id] = "error"
            return
        finally:
            record.forward_s += self.clock() - start if start is not None else 0.0
            record.passes += 1
        with self._lock:
            self.passes_ok += 1
            for req, token, reason in self.scheduler.postprocess(batch, tokens, self.clock()):
                record.emitted.setdefault(req.id, []).append(token)
                if reason is not None:
                    self._count(reason)
                    record.finished[req.id] = reason
            for rid, n in batch.accepted.items():
                record.accepted[rid] = record.accepted.get(rid, 0) + n
            # speculation's running totals (the trace may keep only its last steps)
            self.spec_drafted += sum(map(len, batch.drafts.values()))
            self.spec_accepted += sum(batch.accepted.values())

    # Where structured output's masks are filled: before the pass (False), or in a second thread
    # while the model computes (True, ``Runner.run``'s ``meanwhile``). llguidance fills one in
    # 0.01-0.11 ms on this course's CPUs (docs/results/grammar_libraries.md), far less than a
    # pass, so ours fills them before; lesson 12 measures both with the learner's slower masks.
    masks_during_pass = False

    def compile(self, spec: StructuredOutputs) -> Constraint:
        """A fresh constraint for one request's ``structured_outputs`` (``check_request`` calls
        it); ValueError for a pattern it cannot compile. The engine's to write (lesson 12)."""
        raise ValueError(
            f"{type(self).__name__} does not do structured output: it has no compile() (lesson 12 writes one)"
        )

    def constrain(self, batch: Batch, chunks) -> None:
        """Structured output: give each constrained request whose chunk samples in this pass its
        mask for the next token (``Sampler.allowed``). The engine's to write (lesson 12)."""
        if any(r.constraint is not None for r in batch.requests):
            raise NotImplementedError(f"{type(self).__name__} must write constrain(batch, chunks)")

    def _pass_failed(self, e: Exception, num_chunks: int) -> None:
        """Count a failed pass; log the first failure with its traceback, later ones in a line,
        and the moment the engine turns ``failing``, once."""
        self.passes_failed += 1
        if self.first_error is None:
            self.first_error = e
            log.error(
                "a forward pass of %d chunks failed; its requests finish with reason 'error'",
                num_chunks,
                exc_info=e,
            )
        else:  # said once above; an operator who wants each one sets the level to INFO
            log.info("a forward pass of %d chunks failed: %s: %s", num_chunks, type(e).__name__, e)
        if self.failing and not self._said_failing:
            self._said_failing = True
            log.error("the engine is failing: %s", self.failing)

    def _end_step(self, record: StepRecord) -> None:
        record.slots = [r.id if r is not None else None for r in self.scheduler.slots]
        kv = self.scheduler.kv_usage()
        record.kv_blocks_used, record.block_tables = kv["kv_blocks_used"], kv["block_tables"]
        record.cached_blocks = kv["cached_blocks"]
        record.preempted = list(self.scheduler.preempted)
        record.end_s = self.clock()
        self.trace.steps.append(record)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish(reason, self.clock())
        self._count(reason)

    def _count(self, reason: str) -> None:
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def queue_depth(self) -> int:
        """Requests submitted but not yet admitted (for admission control and /metrics)."""
        with self._lock:
            return self._queue_depth()

    def slots_busy(self) -> int:
        """Decode slots holding a request now (for /metrics and the dashboard)."""
        with self._lock:
            return sum(r is not None for r in self.scheduler.slots)

    def num_running(self) -> int:
        """Requests admitted and not finished (for /metrics and the dashboard)."""
        with self._lock:
            return self._running()

    def _queue_depth(self) -> int:
        return sum(not r.finished for r in (*self._inbox, *self.scheduler.queue))

    def _running(self) -> int:
        return sum(1 for r in self._requests.values() if not r.finished) - self._queue_depth()

    # -- what happened ----------------------------------------------------------------------
    def stats(self) -> dict:
        """Live counters (queued: submitted, not yet admitted; running: admitted, not finished; KV blocks, preemptions, prefix-cache hits in
        blocks and in tokens, finishes) plus every metric of ``metrics.summarize`` over the
        trace so far."""
        with self._lock:
            snapshot = Trace(
                self.trace.kind, self.trace.max_batch_size, list(self.trace.steps), dict(self.trace.requests)
            )
            queued = self._queue_depth()
            running = self._running()
            finished = dict(self.finished_by_reason)
            kv = self.scheduler.kv_usage()
        return {
            **metrics.summarize(snapshot),
            "running": running,
            "queued": queued,
            "finished": finished,
            **{
                k: kv[k]
                for k in (
                    "num_kv_blocks",
                    "free_kv_blocks",
                    "preemptions",
                    "prefix_cache_hits",
                    "prefix_cache_hit_tokens",
                )
            },
        }


class Engine(EngineBase):
    """The engine with our front: ``submit``, ``poll`` and ``cancel``, safe from any thread."""

    def submit(
        self,
        prompt_ids: Sequence[int],
        request_id: str | None = None,
        arrival_s: float | None = None,
        **params,
    ) -> str:
        """Queue a request; return its id. Every argument is checked first, outside the lock
        (``check_request``: ValueError, nothing changes); then, under one hold of the lock,
        the id is chosen and refused if in use, the queue's room checked (``QueueFull``) and
        the request enqueued: no other thread can take the same id or the last place in the
        queue in between, and ``poll`` knows the request as soon as ``submit`` returns."""
        checked = self.check_request(prompt_ids, **params)
        with self._lock:
            rid = request_id if request_id is not None else self.new_id()
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            self.admission.check_room(self._queue_depth)
            self.enqueue(rid, checked, arrival_s)
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
        Its slot and KV blocks are freed by the next sweep, before the engine plans its next pass
        (right after the pass running now, or first in the next step)."""
        with self._lock:
            req = self._requests.get(req_id)
            if req is None or req.finished:
                return False
            self._finish(req, "cancelled")
            self._cancelled.append(req)
            return True

    def compile(self, spec: StructuredOutputs) -> Constraint:
        """llguidance's constraint for the pattern or schema; ``CompileError`` names what it
        cannot compile."""
        return compile_constraint(spec, self.lm.tokenizer)

    def constrain(self, batch: Batch, chunks) -> None:
        """Each constrained request whose chunk samples in this pass gets its mask."""
        constrained = {r.id: r for r in batch.requests if r.constraint is not None}
        for c in chunks:
            if c.sampler is not None and c.req_id in constrained:
                c.sampler.allowed = constrained[c.req_id].constraint.allowed()


class EngineClock:
    """An engine's default clock: seconds of real time since it was made. ``advance_to(t)``
    is for the one moment nothing runs, an idle engine waiting for the next request a
    workload has yet to send (``driver.run_workload``): the clock jumps to ``t`` instead of
    the driver sleeping until then. The engine holds no work, so every timestamp after it is
    what a sleep would have given; only the wall time of the run is shorter."""

    def __init__(self):
        self.start, self.skipped = time.perf_counter(), 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self.start + self.skipped

    def advance_to(self, t: float) -> None:
        self.skipped += max(0.0, t - self())


def make_engine(
    kind: str | type[Scheduler],
    lm: Model,
    *,
    runner=None,
    kv_block_size: int = 16,
    num_kv_blocks: int | None = None,
    max_seq_len: int | None = None,
    trace_limit: int | None = None,
    enable_prefix_cache: bool = False,
    admission: AdmissionBase | None = None,
    clock=None,
    engine_class: type[EngineBase] = Engine,
    lock=None,
    **options,
) -> Engine:
    """Build an engine around a scheduler: a kind name (``scheduler.KINDS``), a scheduler
    class of your own (a subclass of ``Scheduler``), or ``"module:Class"`` naming one.

    ``options`` are the scheduler's own (``max_batch_size``, ``prefill_step``,
    ``token_budget``, ``policy``...: the keyword arguments of its constructor); one that
    the kind does not take is an error, not silently ignored. ``runner(lm, num_blocks,
    block_size)`` builds what runs the passes; by default the model's own
    ``default_runner`` (MLX's ``ModelRunner`` for a loaded model, ``FakeRunner`` for the
    fake), so the engine core never imports MLX. ``enable_prefix_cache`` (kinds that take KV on demand)
    shares the KV blocks of a prompt prefix that an earlier request already computed.
    ``admission`` bounds the queue and sheds stale requests (default: neither).
    ``clock()`` gives every timestamp in seconds (default: ``EngineClock``, real time since the
    engine was made; the simulator passes its virtual clock). ``engine_class`` (``Engine``, or
    an ``EngineBase`` subclass with a learner's own poll/cancel front) is what gets built; ``lock``
    replaces its lock (a checker's counting one).
    """
    if not (isinstance(engine_class, type) and issubclass(engine_class, EngineBase)):
        raise ValueError(f"engine_class must be a subclass of EngineBase, got {engine_class!r}")
    cls = scheduler_class(kind)
    name = cls.kind
    defaults = cls.option_defaults()
    options = {k: v for k, v in options.items() if v is not None}  # None: the default
    wrong = [k for k in options if k not in defaults]
    if enable_prefix_cache and not cls.kv_on_demand:
        wrong.append("enable_prefix_cache")
    if wrong:
        raise ValueError(
            f"{', '.join(wrong)} does not apply to the {name} engine "
            f"(it takes: {', '.join(defaults) or 'no options'})"
        )
    max_seq_len = max_seq_len or lm.max_seq_len
    if not isinstance(max_seq_len, int) or not 2 <= max_seq_len <= lm.max_seq_len:
        raise ValueError(f"max_seq_len must be an integer in [2, {lm.max_seq_len}]")
    batch = options.get("max_batch_size", defaults.get("max_batch_size", 1))
    if num_kv_blocks is None:  # room for a full-length request, or ~1k tokens per slot
        num_kv_blocks = (
            math.ceil(max(max_seq_len, (batch + 1) * 1024) / kv_block_size) if isinstance(batch, int) else 1
        )
    blocks = BlockManager(num_kv_blocks, kv_block_size, enable_prefix_cache)
    clock = EngineClock() if clock is None else clock
    scheduler = cls(blocks, clock, **options)
    if runner is None:  # the model says what runs it: the MLX side injects its runner
        runner = getattr(lm, "default_runner", None)
        if runner is None:
            raise ValueError(f"{type(lm).__name__} has no default_runner: pass runner=")
    return engine_class(
        lm, scheduler, runner(lm, num_kv_blocks, kv_block_size), max_seq_len, trace_limit, admission, lock
    )
