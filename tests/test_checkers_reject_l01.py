"""Lesson 1's checkers reject known-wrong solutions and name the mistake (fake model, instant)."""

from __future__ import annotations

import contextlib
import io

import pytest

from batchlab.course import checks
from batchlab.core.scheduler import Batch, Scheduler, StaticScheduler

import learner_pieces


def checker_quiet(checker: str, solution):
    """The verdict of ``check.<checker>(solution)``, without its printout."""
    with contextlib.redirect_stdout(io.StringIO()):
        return getattr(checks, checker)(solution)


def start_batch(self) -> bool:
    """The right way to start a batch (shared by the wrong solutions below)."""
    while self.queue and len(self.running) < self.max_batch_size and self.reserve(self.queue[0]):
        req = self.queue[0]
        self.begin(req)
        self.take_slot(req)
    return bool(self.running)


def prefill(self):
    longest = max(r.prompt_len for r in self.running)
    return Batch(
        prefill=[(r, r.prompt_len) for r in self.running],
        padding_tokens=sum(longest - r.prompt_len for r in self.running),
    )


def end_batch(self):
    if all(r.finished for r in self.running):
        for r in list(self.running):
            self.release(r)


class Static(Scheduler):
    """What the lesson's stub gives: the base, and a finished row keeps its slot (with the
    lesson's finishing rules, so that each wrong piece below has one mistake)."""

    kind = "my-static"
    rectangular = True
    finish_reason = learner_pieces.MyStaticScheduler.finish_reason


class Rules(learner_pieces.MyStaticScheduler):
    """The lesson's batches, with one wrong finishing rule each (below)."""


class NeverStops(Rules):
    """Forgets the stop tokens: EOS never ends a request."""

    def finish_reason(self, req, token):
        return "length" if len(req.output_ids) >= req.max_new_tokens else None


class StopsOnTokenZero(Rules):
    """Hard-codes EOS as token 0: ignore_eos and stop_token_ids are not honoured."""

    def finish_reason(self, req, token):
        if token == 0:
            return "stop"
        return "length" if len(req.output_ids) >= req.max_new_tokens else None


class OneTokenLate(Rules):
    """Off by one: ends a request only after max_new_tokens + 1 tokens."""

    def finish_reason(self, req, token):
        if token in req.stop_ids:
            return "stop"
        return "length" if len(req.output_ids) > req.max_new_tokens else None


class SaysTrue(Rules):
    """Returns True/False, not a reason."""

    def finish_reason(self, req, token):
        return token in req.stop_ids or len(req.output_ids) >= req.max_new_tokens


class FreesOnlyCleanEndings(Rules):
    """Ends the batch only when every row stopped or reached its length: a row that ended
    with an error (a failed pass) keeps the batch, and the engine, stuck."""

    def batches(self):
        if not self.running:
            if not start_batch(self):
                return
            yield prefill(self)
        live = [r for r in self.running if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.running if r.finished])
        if all(r.finish_reason in ("stop", "length") for r in self.running):
            for r in list(self.running):
                self.release(r)


class JoinsMidBatch(Static):
    """Tops the batch up whenever a request finishes: continuous batching, not static."""

    rectangular = False  # finished rows leave at once

    def batches(self):
        fresh = []
        while self.queue and self.free_slot() is not None and self.reserve(self.queue[0]):
            req = self.queue[0]
            self.begin(req)
            self.take_slot(req)
            fresh.append(req)
        if fresh:
            yield Batch(prefill=[(r, r.prompt_len) for r in fresh])
        live = [r for r in self.running if not r.finished and r not in fresh]
        if live:
            yield Batch(decode=live)


class NeverFreesTheBatch(Static):
    """Forgets to end the batch: it keeps saying it has work and yields nothing."""

    def batches(self):
        if not self.running:
            if not start_batch(self):
                return
            yield prefill(self)
        live = [r for r in self.running if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.running if r.finished])


class StartsOverAFullBatch(Static):
    """Starts the next batch when every row is done, but never frees the old rows: their
    slots are still taken (take_slot raises a RuntimeError)."""

    def batches(self):
        if not self.running or all(r.finished for r in self.running):
            fresh = []
            while self.queue and len(fresh) < self.max_batch_size and self.reserve(self.queue[0]):
                req = self.queue[0]
                self.begin(req)
                self.take_slot(req)
                fresh.append(req)
            if not fresh:
                return
            yield Batch(prefill=[(r, r.prompt_len) for r in fresh])
        live = [r for r in self.running if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.running if r.finished])


class NoPaddingRows(Static):
    """Drops finished rows from the decode step instead of keeping them as padding rows."""

    def batches(self):
        if not self.running:
            if not start_batch(self):
                return
            yield prefill(self)
        live = [r for r in self.running if not r.finished]
        if live:
            yield Batch(decode=live)
        end_batch(self)


class NeverReserves(Static):
    """Takes B requests without reserving their KV memory: fine in a big pool, a MemoryError
    in a small one."""

    def batches(self):
        if not self.running:
            while self.queue and len(self.running) < self.max_batch_size:
                req = self.queue[0]
                self.begin(req)
                self.take_slot(req)
            if not self.running:
                return
            yield prefill(self)
        live = [r for r in self.running if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.running if r.finished])
        end_batch(self)


class NeverBegins(Static):
    """Moves requests into the batch by hand without ``begin``: they never become PREFILLING,
    so the engine never moves them on to DECODING."""

    def batches(self):
        if not self.running:
            while self.queue and len(self.running) < self.max_batch_size and self.reserve(self.queue[0]):
                req = self.queue.popleft()
                self.running.append(req)
                self.take_slot(req)
            if not self.running:
                return
            yield prefill(self)
        live = [r for r in self.running if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.running if r.finished])
        end_batch(self)


class ForgetsTheBlocks(Static):
    """Ends the batch by emptying its slots by hand: the rows' KV blocks are never given back."""

    def batches(self):
        if not self.running:
            if not start_batch(self):
                return
            yield prefill(self)
        live = [r for r in self.running if not r.finished]
        if live:
            yield Batch(decode=live, padding=[r for r in self.running if r.finished])
        if all(r.finished for r in self.running):
            self.slots = [None] * self.max_batch_size
            self.running.clear()


@pytest.mark.parametrize(
    "wrong, first_case, names",
    [
        (JoinsMidBatch, 2, "in static batching nobody joins a running batch"),
        (NeverFreesTheBatch, 2, "stepped 50 times in a row without running anything"),
        (NeverFreesTheBatch, 2, "free them all (self.release(req))"),
        (StartsOverAFullBatch, 2, "RuntimeError: take_slot"),
        (StartsOverAFullBatch, 2, "free each with self.release(req) before the next batch starts"),
        (NoPaddingRows, 2, "stays in its batch as a padding row"),
        (NeverReserves, 9, "the KV pool ran out (16 blocks): MemoryError"),
        (NeverReserves, 9, "only if self.reserve(req) promises its whole KV memory"),
        (NeverBegins, 2, "its state was never set to DECODING"),
        (NeverBegins, 2, "self.begin(req)"),
        (ForgetsTheBlocks, 2, "KV block(s) were still held"),
        (NeverStops, 10, "its first token, made by its prefill, is EOS"),
        (StopsOnTokenZero, 5, "got only 1 of its 8 tokens"),
        (OneTokenLate, 2, "should have finished after"),
        (SaysTrue, 2, "finish_reason returned False"),
        (FreesOnlyCleanEndings, 12, "the engine got stuck"),
    ],
)
def test_static_scheduler_rejects(wrong, first_case, names):
    verdict = checker_quiet("static_scheduler", wrong)
    assert not verdict and not verdict.not_written
    assert f"The first that does not:\n  case {first_case} of 12" in verdict.message, verdict.message
    assert names in verdict.message, verdict.message


def test_the_max_seq_len_case_rejects_a_rule_that_reads_max_seq_len_wrong():
    """max_seq_len is folded into max_new_tokens at submit; a rule that adds the prompt to the
    count ends requests early at the boundary."""

    class CountsThePrompt(Rules):
        def finish_reason(self, req, token):
            if token in req.stop_ids:
                return "stop"
            return "length" if req.prompt_len + len(req.output_ids) >= req.max_new_tokens else None

    verdict = checker_quiet("static_scheduler", CountsThePrompt)
    assert not verdict and "got only" in verdict.message, verdict.message


def test_a_piece_without_finishing_rules_is_not_written():
    class NoRules(Scheduler):
        kind = "my-static"
        rectangular = True
        batches = learner_pieces.MyStaticScheduler.batches

    verdict = checker_quiet("static_scheduler", NoRules)
    assert not verdict and verdict.not_written and "must write finish_reason" in verdict.message


def test_static_scheduler_passes_the_lessons_piece():
    verdict = checker_quiet("static_scheduler", learner_pieces.MyStaticScheduler)
    assert verdict, verdict.message


def test_our_static_scheduler_passes_every_case_but_the_lineage():
    """Ours schedules right, but a piece that derives from it could pass by calling it."""
    verdict = checker_quiet("static_scheduler", StaticScheduler)
    assert verdict.passed == verdict.total - 1 and verdict.failed[0].startswith("derives from Scheduler")
    assert "this is our StaticScheduler: pass your own class" in verdict.message

    class Delegates(StaticScheduler):
        def batches(self):
            yield from super().batches()

    verdict = checker_quiet("static_scheduler", Delegates)
    assert verdict.passed == verdict.total - 1, verdict.message
    assert "derive from Scheduler (or your own earlier piece)" in verdict.message


def test_a_piece_that_hands_batches_to_super_is_not_written():
    """Deriving from the base, calling super() reaches a base that plans nothing."""

    class OnlySuper(Static):
        def batches(self):
            yield from super().batches()

    verdict = checker_quiet("static_scheduler", OnlySuper)
    assert not verdict and "must write batches()" in verdict.message, verdict.message


def test_a_piece_that_never_reserves_passes_every_case_but_the_small_pool():
    """The memory case is what catches it: the other cases' pool holds everybody."""
    verdict = checker_quiet("static_scheduler", NeverReserves)
    assert verdict.passed == verdict.total - 1 and verdict.failed[0].startswith("memory")


def test_static_scheduler_whole_workload_checks_the_rules():
    """The invariants on a whole trace name a request that joined a running batch."""
    from batchlab.course.checks._pieces import fake_workload, run_piece
    from batchlab.course.checks.lesson01 import static_invariants

    wl = fake_workload("w", [(5, o) for o in [3, 9, 2, 5, 4, 7]], 1)
    trace = run_piece(JoinsMidBatch, wl, max_batch_size=3).trace
    problem = static_invariants(trace, 3)
    assert problem and "nobody joins a running batch" in problem
    assert static_invariants(run_piece(StaticScheduler, wl, max_batch_size=3).trace, 3) is None


def test_static_scheduler_asks_for_a_class():
    verdict = checker_quiet("static_scheduler", lambda: None)
    assert not verdict and "subclass of Scheduler" in verdict.message


def test_wasted_slot_steps_rejects_forgetting_the_prefill_token():
    verdict = checker_quiet("wasted_slot_steps", lambda lens, B: B * max(lens) - sum(lens))
    assert not verdict and not verdict.not_written


def test_static_steps_rejects_counting_max_steps():
    verdict = checker_quiet(
        "static_steps", lambda lens, B: sum(max(lens[i : i + B]) for i in range(0, len(lens), B))
    )
    assert not verdict and "max - 1 steps, not max" in verdict.message
