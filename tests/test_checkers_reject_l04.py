"""Lesson 4's checkers reject known-wrong solutions and name the mistake. Each wrong
version is the lesson's piece with one mistake."""

from __future__ import annotations

import math

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
import pytest

from batchlab.course import checks as check
from batchlab import course
from batchlab.core.request import State
from batchlab.core.scheduler import Batch, ContinuousScheduler
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

    def prefill(self):
        for req in self.in_state(State.PREFILLING)[:1]:
            n = self.chunk(req)
            if n == req.prefill_left and req.num_computed > 0:
                req.set_state(State.AWAITING_SLOT, self.clock())
                return
            yield Batch(prefill=[(req, n)])


class ChunkWithTheDecodes(MyChunkedScheduler):
    """Runs the chunk and the decode rows as one pass (lesson 5's idea, not this engine's)."""

    def prefill(self):
        for req in self.in_state(State.PREFILLING)[:1]:
            yield Batch(decode=[r for r in self.slots if r is not None], prefill=[(req, self.chunk(req))])


class IgnoresTheStep(MyChunkedScheduler):
    """Keeps lesson 2's rule: the whole rest of the prompt in one chunk."""

    def chunk(self, req):
        return req.prefill_left


class OffByOneAtTheBoundary(MyChunkedScheduler):
    """Leaves one token over when the rest is exactly a chunk: a 256-token prompt in 128 + 127 + 1."""

    def chunk(self, req):
        return min(self.prefill_step, req.prefill_left - 1) or 1


class AdmitsWhilePrefilling(MyChunkedScheduler):
    """With chunks, a prompt takes several steps: this admits the next one meanwhile, and
    prefills both."""

    def admit(self):
        if self.queue and not self.in_state(State.AWAITING_SLOT):
            self.admit_next(math.inf)

    def prefill(self):
        for req in self.in_state(State.PREFILLING):
            yield Batch(prefill=[(req, self.chunk(req))])


class StartsBlind(MyChunkedScheduler):
    """Starts the next request whether or not the pool holds its KV memory."""

    def admit_next(self, max_tokens):
        req = self.policy.next_queued(self.queue)
        return req, self.start(req, min(max_tokens, self.chunk(req)))


class TakesAnyStep(MyChunkedScheduler):
    """Never checks prefill_step: 0 silently means 'no chunking', 2.5 makes half tokens."""

    def __init__(self, blocks, clock, max_batch_size=8, prefill_step=None, policy=None):
        MyContinuousScheduler.__init__(self, blocks, clock, max_batch_size, policy=policy)
        self.prefill_step = prefill_step or math.inf


class NotWritten(MyContinuousScheduler):
    def __init__(self, blocks, clock, max_batch_size=8, prefill_step=None, policy=None):
        super().__init__(blocks, clock, max_batch_size, policy=policy)
        self.prefill_step = prefill_step

    def chunk(self, req):
        raise NotImplementedError("write chunk")


def test_the_lessons_piece_passes_and_ours_fails_only_the_lineage():
    verdict = check.chunked_scheduler(MyChunkedScheduler)
    assert verdict, verdict.message
    ours = check.chunked_scheduler(ContinuousScheduler)
    assert ours.passed == ours.total - 1 and ours.failed[0].startswith("derives from Scheduler"), ours.message


@pytest.mark.parametrize(
    "wrong, first_case, says",
    [
        (IgnoresTheStep, "2 of 13", ["more than prefill_step=128", "min(prefill_step, tokens left)"]),
        (
            NoLastChunk,
            "2 of 13",
            ["r2 went on to awaiting a slot with only 256 of its 300 prompt", "last chunk never ran"],
        ),
        (ChunkWithTheDecodes, "2 of 13", ["got two decode rows: a request makes one token a step"]),
        (
            StartsBlind,
            "12 of 13",
            ["the KV pool ran out (16 blocks): MemoryError: start(r", "self.fits(req, n)"],
        ),
        (TakesAnyStep, "13 of 13", ["prefill_step=0 was accepted"]),
    ],
)
def test_chunked_scheduler_rejects(wrong, first_case, says):
    assert_rejected(check.chunked_scheduler(wrong), first_case, *says)


@pytest.mark.parametrize(
    "design, says",
    [
        (OffByOneAtTheBoundary, "were [(0, 128), (128, 128), (256, 43), (299, 1)]"),
        (AdmitsWhilePrefilling, "prefilled 2 chunks; the lesson's rule one"),
    ],
)
def test_a_chunk_rule_of_ones_own_keeps_the_contract_and_is_named(design, says):
    """Chunks cut otherwise (never over prefill_step), or two prompts prefilled at once: other
    rules, not broken ones. They pass, and the verdict says where they part from the lesson's."""
    verdict = check.chunked_scheduler(design)
    assert verdict and verdict.differs and says in verdict.message, verdict.message


def test_a_last_chunk_that_never_runs_fails_the_whole_workloads_too():
    assert "fails too: a whole workload" in check.chunked_scheduler(NoLastChunk).message


@pytest.mark.parametrize(
    "piece", [NotWritten, course.Missing("MyChunkedScheduler", "my_engine/chunked.py does not exist yet")]
)
def test_an_unwritten_piece_is_reported_as_not_written(piece):
    verdict = check.chunked_scheduler(piece)
    assert not verdict and verdict.not_written, verdict.message


def _right_long_ttft(prompt_len, prefill_step, prefill_tokens_per_s, decode_step_s):
    chunks = 1 if prefill_step is None else math.ceil(prompt_len / prefill_step)
    return prompt_len / prefill_tokens_per_s + (chunks - 1) * decode_step_s


@pytest.mark.parametrize(
    "wrong, says",
    [
        (
            lambda p, s, r, d: p / r + (1 if s is None else math.ceil(p / s)) * d,
            "that counts a decode pass per chunk",
        ),
        (lambda p, s, r, d: p / r + (0 if s is None else p // s - 1) * d, "the number of chunks is off"),
        (lambda p, s, r, d: p / r, "leaves out the decode passes"),
        (lambda p, s, r, d: 0.5, "predict_long_ttft: "),
    ],
    ids=["a-pass-per-chunk", "rounds-down", "no-decodes", "a-constant"],
)
def test_predict_long_ttft_rejects_each_known_mistake(wrong, says):
    assert check.predict_long_ttft(_right_long_ttft)
    verdict = check.predict_long_ttft(wrong)
    assert not verdict and not verdict.not_written and says in verdict.message, verdict.message


def _right_largest(target, rate, decode, choices):
    return max((c for c in choices if c / rate + decode <= target), default=None)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (
            lambda t, r, d, cs: min((c for c in cs if c / r + d <= t), default=None),
            "the smallest chunk that fits",
        ),
        (lambda t, r, d, cs: max((c for c in cs if c / r <= t), default=None), "leaves out the decode pass"),
        (lambda t, r, d, cs: max(cs), "over the target"),
        (lambda t, r, d, cs: 100, "is not one of the choices"),
        (lambda t, r, d, cs: max((c for c in cs if c / r + d <= t), default=0), "the answer is None"),
    ],
    ids=["smallest", "no-decode", "always-largest", "not-a-choice", "zero-for-none"],
)
def test_largest_chunk_rejects_each_known_mistake(wrong, says):
    assert check.largest_chunk(_right_largest)
    verdict = check.largest_chunk(wrong)
    assert not verdict and not verdict.not_written and says in verdict.message, verdict.message
