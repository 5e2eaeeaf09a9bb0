"""The peer: mlx-lm's own continuous batching (``BatchGenerator``) on the same model,
driven through the same workloads and measured into the same kind of ``Trace``, so
every metric and plot of batchlab applies to it unchanged.

``BatchGenerator`` prefills new prompts in chunks of ``prefill_step_size`` tokens as
passes of their own, between decode steps; every decoding sequence waits for each of
those passes. Note that it silently raises ``completion_batch_size`` to
``prefill_batch_size`` when that is larger, so we set both to keep B what we say.

Why a run loop of its own, not ``driver.run_workload``: the driver speaks our engine's
interface (submit, step, poll, cancel, and a trace the engine records), and
``BatchGenerator`` has none of it (``insert`` and ``next``, answers as they come). This
loop follows the same arrivals by the same rule (a request is due at its ``arrival_s``)
and records the same ``Trace``, so every metric reads both alike.

Structured output: ``BatchGenerator`` cannot constrain an answer, and ``mlx_lm.server``
ignores ``response_format`` (mlx-lm 0.32.2's server has no handling of it; mlx-lm issue
#1007). A request with ``structured_outputs`` runs here on its prompt alone, unconstrained,
and ends at EOS like an answer of ``mlx_lm.server``: what an application gets from mlx-lm.
"""

from __future__ import annotations

import time

from ..model.load import LoadedModel
from ..core.trace import RequestRecord, StepRecord, Trace
from .workloads import Workload


def run_mlxlm_workload(
    lm: LoadedModel,
    workload: Workload,
    batch_size: int,
    prefill_step_size: int = 2048,
    progress: bool = True,
    stop_at_eos: bool = False,
) -> Trace:
    """Run ``workload`` (greedy, arrivals honoured) on mlx-lm's BatchGenerator. EOS is ignored
    (each request generates exactly its ``max_new_tokens``) except with ``stop_at_eos`` and
    for a request with ``structured_outputs``: that one ends at EOS, unconstrained (mlx-lm
    cannot constrain)."""
    from mlx_lm.generate import BatchGenerator
    from tqdm.auto import tqdm

    gen = BatchGenerator(
        lm.model,
        completion_batch_size=batch_size,
        prefill_batch_size=min(batch_size, 8),
        prefill_step_size=prefill_step_size,
    )
    trace = Trace("mlx-lm", batch_size)
    reqs = sorted(workload.requests, key=lambda r: r.arrival_s)
    by_uid: dict[int, RequestRecord] = {}
    left = {}
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    bar = tqdm(
        total=sum(r.max_new_tokens for r in reqs),
        unit="tok",
        desc=f"mlx-lm {workload.name}",
        disable=not progress,
        leave=False,
    )
    stop_of = _stop_sequences(lm, reqs, stop_at_eos)
    nxt = 0
    try:
        while nxt < len(reqs) or left:
            nxt = _insert_due(gen, reqs, nxt, clock(), trace, by_uid, left, stop_of)
            if not left:
                time.sleep(max(0.0, reqs[nxt].arrival_s - clock()))
                continue
            trace.steps.append(_step(gen, trace, by_uid, left, clock, bar))
    finally:
        bar.close()
        gen.close()
    return trace


def _stop_sequences(lm, reqs, stop_at_eos: bool) -> dict | None:
    """Each request's stop sequences for ``BatchGenerator.insert`` (by id): none (EOS ignored),
    or EOS where ``stop_at_eos`` or the request carries ``structured_outputs``. None when no
    request stops at EOS (then ``insert`` is called as before)."""
    if not stop_at_eos and all(r.structured_outputs is None for r in reqs):
        return None
    from mlx_lm.generate import StopSequences  # per-request stop sequences (mlx-lm 0.32)

    never, eos = StopSequences(), StopSequences([[t] for t in sorted(lm.tokenizer.eos_token_ids)])
    return {r.id: eos if stop_at_eos or r.structured_outputs is not None else never for r in reqs}


def _insert_due(
    gen, reqs, nxt: int, now: float, trace: Trace, by_uid: dict, left: dict, stop_of: dict | None = None
) -> int:
    """Insert into ``gen`` every request from ``reqs[nxt]`` on that has arrived by ``now``,
    each with its record (queued at its arrival), its tokens left and its stop sequences
    (``stop_of``, by request id; None: EOS ignored by all); returns the index of the next
    one not yet arrived."""
    due = []
    while nxt < len(reqs) and reqs[nxt].arrival_s <= now:
        due.append(reqs[nxt])
        nxt += 1
    if due:
        stops = {} if stop_of is None else {"stop_sequences": [stop_of[r.id] for r in due]}
        uids = gen.insert([r.prompt_ids for r in due], max_tokens=[r.max_new_tokens for r in due], **stops)
        for uid, r in zip(uids, due):
            rec = RequestRecord(
                r.id,
                r.prompt_len,
                r.max_new_tokens,
                r.arrival_s,
                state_times=[(r.arrival_s, "queued")],
            )
            by_uid[uid] = trace.requests[r.id] = rec
            left[uid] = r.max_new_tokens
    return nxt


def _step(gen, trace: Trace, by_uid: dict, left: dict, clock, bar) -> StepRecord:
    """One ``gen.next()`` as a step of the trace: its tokens go to their requests' records,
    and the requests it finished leave ``left``."""
    step = StepRecord(len(trace.steps), clock())
    _, generated = gen.next()
    step.end_s = step.forward_s = clock()
    step.forward_s -= step.start_s
    step.passes = 1
    for response in generated:
        rec = by_uid[response.uid]
        rec.output_ids.append(int(response.token))
        rec.token_times_s.append(step.end_s)
        if rec.first_token_s is None:
            rec.first_token_s = step.end_s
        step.decoded.append(rec.id)
        step.emitted.setdefault(rec.id, []).append(int(response.token))
        bar.update(1)
        if response.finish_reason is not None:
            rec.finished_s, rec.finish_reason = step.end_s, response.finish_reason
            step.finished[rec.id] = response.finish_reason
            del left[response.uid]
    return step
