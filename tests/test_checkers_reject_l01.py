"""Lesson 1's checkers reject known-wrong solutions and name the mistake (fake model, instant)."""

from __future__ import annotations

import contextlib
import io

import pytest

from batchlab import checks
from batchlab.batch import Batch
from batchlab.request import State
from batchlab.scheduler import Scheduler, StaticScheduler


def checker_quiet(checker: str, solution):
    """The verdict of ``check.<checker>(solution)``, without its printout."""
    with contextlib.redirect_stdout(io.StringIO()):
        return getattr(checks, checker)(solution)


def start_batch(self) -> bool:
    """The right way to start a batch (shared by the wrong solutions below)."""
    while self.queue and len(self.batch) < self.max_batch_size and self.reserve(self.queue[0]):
        req = self.queue.popleft()
        self.take_slot(req)
        req.set_state(State.PREFILLING, self.clock())
        self.batch.append(req)
    return bool(self.batch)


class JoinsMidBatch(StaticScheduler):
    """Tops the batch up whenever a request finishes: continuous batching, not static."""

    def batches(self):
        new = [r for r in self.queue][: self.max_batch_size - len(self.batch)]
        fresh = []
        for req in new:
            if self.free_slot() is None or not self.reserve(req):
                break
            self.queue.remove(req)
            self.take_slot(req)
            req.set_state(State.PREFILLING, self.clock())
            self.batch.append(req)
            fresh.append(req)
        if fresh:
            longest = max(r.prompt_len for r in fresh)
            yield Batch(prefill=[(r, r.prompt_len) for r in fresh],
                        padding_tokens=sum(longest - r.prompt_len for r in fresh))
            for r in fresh:
                if not r.finished:
                    r.set_state(State.DECODING, self.clock())
        live = [r for r in self.batch if not r.finished]
        if live:
            yield Batch(decode=live)
        for r in [r for r in self.batch if r.finished]:
            Scheduler.remove(self, r)
            self.batch.remove(r)


class NeverFreesTheBatch(StaticScheduler):
    """Forgets to end the batch: it keeps saying it has work and yields nothing."""

    def batches(self):
        if not self.batch:
            if not start_batch(self):
                return
            yield Batch(prefill=[(r, r.prompt_len) for r in self.batch])
            for r in self.batch:
                if not r.finished:
                    r.set_state(State.DECODING, self.clock())
        live = [r for r in self.batch if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.batch if r.finished])


class NoPaddingRows(StaticScheduler):
    """Drops finished rows from the decode step instead of keeping them as padding rows."""

    def batches(self):
        if not self.batch:
            if not start_batch(self):
                return
            longest = max(r.prompt_len for r in self.batch)
            yield Batch(prefill=[(r, r.prompt_len) for r in self.batch],
                        padding_tokens=sum(longest - r.prompt_len for r in self.batch))
            for r in self.batch:
                if not r.finished:
                    r.set_state(State.DECODING, self.clock())
        live = [r for r in self.batch if not r.finished]
        if live:
            yield Batch(decode=live)
        if not live:
            for r in self.batch:
                Scheduler.remove(self, r)
            self.batch = []


@pytest.mark.parametrize("wrong, names", [
    (JoinsMidBatch, "nobody joins until every request of the batch is done"),
    (NeverFreesTheBatch, "kept stepping without running anything"),
    (NoPaddingRows, "stays in the batch as a padding row"),
])
def test_static_scheduler_rejects(wrong, names):
    verdict = checker_quiet("static_scheduler", wrong)
    assert not verdict and not verdict.not_written
    assert names in verdict.message, verdict.message


def test_static_scheduler_whole_workload_reports_a_stuck_engine():
    """On a whole workload the one driver stops a stuck scheduler; the case fails, no hang."""
    verdict = checker_quiet("static_scheduler", NeverFreesTheBatch)
    assert any(label.startswith("whole workload") for label in verdict.failed)


def test_static_scheduler_whole_workload_checks_the_rules():
    """The invariants on a whole trace name a request that joined a running batch."""
    from batchlab.checks.lesson01 import fake_workload, run_whole, static_invariants
    from batchlab.fake import FakeModel
    wl = fake_workload("w", [3, 9, 2, 5, 4, 7], [5] * 6, 1)
    run = run_whole(JoinsMidBatch, 3, wl, FakeModel())
    problem = static_invariants(run.trace, 3)
    assert problem and "nobody joins a running batch" in problem
    assert static_invariants(run_whole(StaticScheduler, 3, wl, FakeModel()).trace, 3) is None


def test_static_scheduler_asks_for_a_class():
    verdict = checker_quiet("static_scheduler", lambda: None)
    assert not verdict and "subclass of StaticScheduler" in verdict.message


def test_wasted_slot_steps_rejects_forgetting_the_prefill_token():
    verdict = checker_quiet("wasted_slot_steps", lambda lens, B: B * max(lens) - sum(lens))
    assert not verdict and not verdict.not_written


def test_static_steps_rejects_counting_max_steps():
    verdict = checker_quiet("static_steps", lambda lens, B: sum(
        max(lens[i:i + B]) for i in range(0, len(lens), B)))
    assert not verdict and "max - 1 steps, not max" in verdict.message
