"""Lesson 4's checkers reject known-wrong solutions and name the mistake. The chunked
scheduler's wrong versions are subclasses of the library's ``ContinuousScheduler`` (the
learner's extends their own lesson-2 class; the checker sees only the class)."""

from __future__ import annotations

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
import pytest

from batchlab.course import checks as check
from batchlab import course
from batchlab.core.batch import Batch
from batchlab.core.request import State
from batchlab.core.scheduler import ContinuousScheduler
from learner_pieces import MyChunkedScheduler, MyContinuousScheduler


def assert_rejected(verdict, first_case: str, *says: str) -> None:
    """The verdict fails (not as "not written yet"), its first failing case starts with
    ``first_case``, and it says each of ``says``."""
    assert not verdict and not verdict.not_written, verdict.message
    assert f"The first that does not:\n  case {first_case}" in verdict.message, verdict.message
    for words in says:
        assert words in verdict.message, f"{words!r} not in:\n{verdict.message}"


class NoLastChunk(MyChunkedScheduler):
    """Sends the request to wait for a slot when only the last chunk is left, so that chunk
    (the one that samples the first token) never runs."""

    def prefill_chunk(self):
        for req in self.in_state(State.PREFILLING)[:1]:
            n = min(self.prefill_step, req.prefill_left)
            if n == req.prefill_left and req.num_computed > 0:
                req.set_state(State.AWAITING_SLOT, self.clock())
                return
            if self.make_room(req, n):
                yield Batch(prefill=[(req, n)])


class ChunkWithTheDecodes(MyChunkedScheduler):
    """Runs the chunk and the decode rows as one pass (lesson 5's idea, not this engine's)."""

    def prefill_chunk(self):
        for req in self.in_state(State.PREFILLING)[:1]:
            n = min(self.prefill_step, req.prefill_left)
            if self.make_room(req, n):
                yield Batch(decode=[r for r in self.slots if r is not None], prefill=[(req, n)])


class NoMakeRoom(MyChunkedScheduler):
    """Yields each chunk without taking its blocks: fine in a big pool, a MemoryError in a
    small one."""

    def prefill_chunk(self):
        for req in self.in_state(State.PREFILLING)[:1]:
            yield Batch(prefill=[(req, min(self.prefill_step, req.prefill_left))])


class NotWritten(MyContinuousScheduler):
    def prefill_chunk(self):
        raise NotImplementedError("write prefill_chunk")


@pytest.mark.parametrize("solution", [ContinuousScheduler, MyChunkedScheduler])
def test_the_reference_and_the_lessons_piece_pass(solution):
    verdict = check.chunked_scheduler(solution)
    assert verdict, verdict.message


def test_a_chunk_that_ignores_prefill_step_is_rejected():
    """The lesson-2 piece, not extended: its whole-prompt prefill_chunk ignores prefill_step."""
    assert_rejected(
        check.chunked_scheduler(MyContinuousScheduler),
        "1 of 10",
        "more than prefill_step=128",
        "min(prefill_step, tokens left)",
    )


def test_a_last_chunk_that_never_runs_is_rejected():
    verdict = check.chunked_scheduler(NoLastChunk)
    assert_rejected(
        verdict,
        "1 of 10",
        "r2 went on to awaiting a slot with only 256 of its 300 prompt",
        "last chunk never ran",
    )
    assert "fails too: a whole workload" in verdict.message


def test_a_chunk_fused_with_the_decodes_is_rejected():
    assert_rejected(check.chunked_scheduler(ChunkWithTheDecodes), "1 of 10", "a pass of its own")


def test_a_chunk_without_make_room_is_rejected_in_the_small_pool():
    verdict = check.chunked_scheduler(NoMakeRoom)
    assert_rejected(
        verdict,
        "10 of 10",
        "the KV pool ran out (16 blocks): MemoryError",
        "self.make_room(req, n) before yielding it",
    )
    assert verdict.passed == 9


@pytest.mark.parametrize(
    "piece", [NotWritten, course.Missing("MyChunkedScheduler", "my_engine/chunked.py does not exist yet")]
)
def test_an_unwritten_piece_is_reported_as_not_written(piece):
    verdict = check.chunked_scheduler(piece)
    assert not verdict and verdict.not_written, verdict.message
