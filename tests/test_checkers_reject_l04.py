"""Lesson 4's checkers reject known-wrong solutions and name the mistake. The chunked
scheduler's wrong versions are subclasses of the library's ``ContinuousScheduler`` (the
learner's extends their own lesson-2 class; the checker sees only the class)."""

from __future__ import annotations

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
import pytest

from batchlab import checks as check
from batchlab import course
from batchlab.batch import Batch
from batchlab.request import State
from batchlab.scheduler import ContinuousScheduler


def assert_rejected(verdict, first_case: str, *says: str) -> None:
    """The verdict fails (not as "not written yet"), its first failing case starts with
    ``first_case``, and it says each of ``says``."""
    assert not verdict and not verdict.not_written, verdict.message
    assert f"The first that does not:\n  case {first_case}" in verdict.message, verdict.message
    for words in says:
        assert words in verdict.message, f"{words!r} not in:\n{verdict.message}"


def wait_for_a_slot(self, req):
    self.prefilling = None
    if not req.finished:
        req.set_state(State.AWAITING_SLOT, self.clock())
        self.awaiting.append(req)


class WholePrompt(ContinuousScheduler):
    """Ignores prefill_step: the whole rest of the prompt in one chunk."""

    def prefill_chunk(self):
        req = self.prefilling
        if req is None:
            return
        yield Batch(prefill=[(req, req.prefill_left)])
        wait_for_a_slot(self, req)


class NoLastChunk(ContinuousScheduler):
    """Sends the request to wait for a slot when only the last chunk is left, so that chunk
    (the one that samples the first token) never runs."""

    def prefill_chunk(self):
        req = self.prefilling
        if req is None:
            return
        n = min(self.prefill_step, req.prefill_left)
        if n == req.prefill_left and req.num_computed > 0:
            wait_for_a_slot(self, req)
            return
        yield Batch(prefill=[(req, n)])
        if req.prefill_left == 0:
            wait_for_a_slot(self, req)


class FinishedTakesASlot(ContinuousScheduler):
    """Sends every request whose prompt is done to wait for a slot, finished or not."""

    def prefill_chunk(self):
        req = self.prefilling
        if req is None:
            return
        n = min(self.prefill_step, req.prefill_left)
        yield Batch(prefill=[(req, n)])
        if req.prefill_left == 0:
            self.prefilling = None
            req.set_state(State.AWAITING_SLOT, self.clock())
            self.awaiting.append(req)


class ChunkWithTheDecodes(ContinuousScheduler):
    """Runs the chunk and the decode rows as one pass (lesson 5's idea, not this engine's)."""

    def batches(self):
        self.admit()
        self.place()
        req = self.prefilling
        chunk = [(req, min(self.prefill_step, req.prefill_left))] if req else []
        rows = [r for r in self.slots if r is not None]
        if chunk or rows:
            yield Batch(decode=rows, prefill=chunk)
        if req is not None and req.prefill_left == 0:
            wait_for_a_slot(self, req)


class NotWritten(ContinuousScheduler):
    def prefill_chunk(self):
        raise NotImplementedError("write prefill_chunk")


def test_the_reference_passes():
    assert check.chunked_scheduler(ContinuousScheduler)


def test_a_chunk_that_ignores_prefill_step_is_rejected():
    assert_rejected(check.chunked_scheduler(WholePrompt), "1 of 9",
                    "more than prefill_step=128", "min(prefill_step, tokens left)")


def test_a_last_chunk_that_never_runs_is_rejected():
    assert_rejected(check.chunked_scheduler(NoLastChunk), "1 of 9", "r2 went on to awaiting a slot with only 256 of its 300 prompt tokens", "last chunk never ran")
    verdict = check.chunked_scheduler(NoLastChunk)
    assert "fails too: a whole workload" in verdict.message


def test_a_finished_request_in_a_slot_is_rejected_not_a_hang():
    verdict = check.chunked_scheduler(FinishedTakesASlot)
    assert_rejected(verdict, "6 of 9", "never takes a slot", "a finished request went on decoding")


def test_a_chunk_fused_with_the_decodes_is_rejected():
    assert_rejected(check.chunked_scheduler(ChunkWithTheDecodes), "1 of 9", "a pass of its own")


@pytest.mark.parametrize("piece", [NotWritten, course.Missing("MyChunkedScheduler", "my_engine/chunked.py does not exist yet")])
def test_an_unwritten_piece_is_reported_as_not_written(piece):
    verdict = check.chunked_scheduler(piece)
    assert not verdict and verdict.not_written, verdict.message
