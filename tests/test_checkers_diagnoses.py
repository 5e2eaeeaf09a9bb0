"""The checkers' diagnoses that the per-lesson reject files leave out: each test feeds a checker
a piece with one plausible mistake and asserts that the verdict fails (or, for a design of the
learner's own, passes and says where it differs) and that its words name that mistake.

Checkers that take the real model (``greedy_generate``, ``stream_text``, ``server_events``) run
here on a byte-level fake (``ByteLM``): text as its UTF-8 bytes, one token each, and a model whose
next token is a hash of the sequence, so every test is instant and needs no model file."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from batchlab.core.scheduler import Batch
from batchlab.core.fake import FakeRunner
from batchlab.core.request import State
from batchlab.course import checks
from batchlab.model.tokenizer import IncrementalDetokenizer
from batchlab.serving.server import ServerBase

import learner_pieces
from learner_pieces import MyAdmission, MyAgingPolicy, MyEngine, MyMemoryScheduler, MyStaticScheduler
from test_checkers_reject_l07 import mistaken


def quiet(checker: str, *args):
    """The verdict of ``checks.<checker>(*args)``, without its printout."""
    with contextlib.redirect_stdout(io.StringIO()):
        return getattr(checks, checker)(*args)


def assert_says(verdict, *says: str, case: str | None = None) -> None:
    """The verdict fails (not as "not written yet"), its first failing case is ``case`` (when
    given, e.g. "3 of 6"), and its message holds each of ``says``."""
    assert not verdict and not verdict.not_written, verdict.message
    if case is not None:
        assert f"The first that does not:\n  case {case}" in verdict.message, verdict.message
    for words in says:
        assert words in verdict.message, f"{words!r} not in:\n{verdict.message}"


def assert_differs(verdict, says: str) -> None:
    """A design of the learner's own: every case keeps the contract, the verdict names where it parts."""
    assert verdict and verdict.differs and says in verdict.message, verdict.message


# --------------------------------------------------------------------------------------
# A byte-level fake of the loaded model, for the checkers that take one.

EOS = 256


class ByteTokenizer:
    """Text as its UTF-8 bytes (ids 0-255); 256 is EOS, shown as "<|end|>"; ids above are words
    "<wN>" (the checkers name fixed ids such as 504)."""

    vocab_size = 1024
    eos_token_ids = frozenset({EOS})

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def encode_chat(self, messages) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        raw = b"".join(bytes([t]) if t < 256 else b"" if t == EOS else f"<w{t}>".encode() for t in ids)
        eos = "" if skip_special_tokens else "<|end|>" * sum(t == EOS for t in ids)
        return raw.decode("utf-8", errors="replace") + eos

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


def _next_token(sequence: list[int]) -> int:
    """EOS at every 11th position, else a printable byte hashed from the sequence."""
    if len(sequence) % 11 == 0:
        return EOS
    return 32 + zlib.crc32(bytes(t % 256 for t in sequence)) % 95


class ByteModel:
    """``model(tokens[1, L], cache=None) -> logits[1, L, vocab]``; the cache is the tokens so far."""

    def make_cache(self) -> list[int]:
        return []

    def __call__(self, inputs, cache=None):
        ids = np.array(inputs)[0].tolist()
        before = list(cache) if cache is not None else []
        if cache is not None:
            cache.extend(ids)
        rows = np.full((len(ids), ByteTokenizer.vocab_size), -1e9, dtype=np.float32)
        for i in range(len(ids)):
            rows[i, _next_token(before + ids[: i + 1])] = 0.0
        return mx.array(rows)[None]


@dataclass
class ByteLM:
    """Stands where a ``LoadedModel`` goes; ``make_engine`` runs it on the fake runner."""

    model: Any = field(default_factory=ByteModel)
    tokenizer: Any = field(default_factory=ByteTokenizer)
    max_seq_len: int = 4096
    vocab_size: int = ByteTokenizer.vocab_size

    @property
    def default_runner(self) -> type:
        return FakeRunner


BYTE_LM = ByteLM()


# --------------------------------------------------------------------------------------
# Lesson 0: greedy_generate, on the byte-level fake.


def _greedy(lm, ids, n, *, keep_eos=True, stop_at_eos=True, cache=True, split_prompt=False):
    """Greedy decoding with the cache (the lesson's), with one of its steps switchable."""
    kv = lm.model.make_cache() if cache else None
    if split_prompt:  # the prompt in two passes
        lm.model(mx.array([ids[: len(ids) // 2]]), cache=kv)
        logits = lm.model(mx.array([ids[len(ids) // 2 :]]), cache=kv)[:, -1, :]
    else:
        logits = lm.model(mx.array([ids]), cache=kv)[:, -1, :]
    seq, out = list(ids), []
    while True:
        token = int(mx.argmax(logits, axis=-1).item())
        if token in lm.tokenizer.eos_token_ids and stop_at_eos:
            return out + [token] if keep_eos else out
        out.append(token)
        seq.append(token)
        if len(out) >= n:
            return out
        step = mx.array([[token]]) if cache else mx.array([seq])
        logits = lm.model(step, cache=kv)[:, -1, :]


def test_greedy_generate_passes_the_lessons_loop_on_the_fake():
    assert quiet("greedy_generate", _greedy, BYTE_LM)


@pytest.mark.parametrize(
    "wrong, case, says",
    [
        (
            lambda lm, ids, n: mx.array(_greedy(lm, ids, n)),
            "1 of 6",
            "that is an array: return a Python list",
        ),
        (lambda lm, ids, n: lm.tokenizer.decode(_greedy(lm, ids, n)), "1 of 6", "but you returned a str"),
        (
            lambda lm, ids, n: [mx.array(t) for t in _greedy(lm, ids, n)],
            "1 of 6",
            "item 0 is mx.array(",
        ),
        (
            lambda lm, ids, n: _greedy(lm, ids, n, stop_at_eos=False),
            "3 of 6",
            "but you kept going after the EOS",
        ),
        (
            lambda lm, ids, n: _greedy(lm, ids, n, keep_eos=False),
            "3 of 6",
            "you stopped at the EOS token 256",
        ),
        (lambda lm, ids, n: ids + _greedy(lm, ids, n), "1 of 6", "tokens come before them (the prompt?)"),
        (
            lambda lm, ids, n: [(t + 1) % 256 for t in _greedy(lm, ids, n)],
            "1 of 6",
            "they first differ at position 0",
        ),
        (lambda lm, ids, n: _greedy(lm, ids, n, cache=False), "6 of 6", "forward pass 1 ran without a cache"),
        (
            lambda lm, ids, n: _greedy(lm, ids, n, split_prompt=True),
            "6 of 6",
            "forward pass 2 was given",
        ),
        (lambda lm, ids, n: _greedy(BYTE_LM, ids, n), "6 of 6", "your function never called lm.model"),
    ],
    ids=[
        "an-array",
        "the-text",
        "arrays-as-items",
        "past-eos",
        "eos-left-out",
        "with-the-prompt",
        "wrong-tokens",
        "no-cache",
        "prompt-in-two-passes",
        "the-global-model",
    ],
)
def test_greedy_generate_names_each_mistake(wrong, case, says):
    assert_says(quiet("greedy_generate", wrong, BYTE_LM), says, case=case)


# --------------------------------------------------------------------------------------
# Lesson 1: the static scheduler's other rules (designs of one's own), and the counts.


class SmallerBatches(MyStaticScheduler):
    """Starts batches of at most 2, whatever max_batch_size says: a rule of one's own."""

    def batches(self):
        B, self.max_batch_size = self.max_batch_size, min(2, self.max_batch_size)
        try:
            yield from super().batches()
        finally:
            self.max_batch_size = B


class NoPaddingTokens(MyStaticScheduler):
    """Forgets to count the padding tokens of the batch's prefill."""

    def batches(self):
        for batch in super().batches():
            if batch.prefill:
                batch = Batch(prefill=batch.prefill)
            yield batch


class EveryRowDecodes(MyStaticScheduler):
    """Puts every row of the batch in the padding list, the live ones too."""

    def batches(self):
        for batch in super().batches():
            if batch.decode:
                batch = Batch(decode=batch.decode, padding=list(self.running))
            yield batch


class HalfTheRows(MyStaticScheduler):
    """Decodes only the first request of the batch while it lives (the others sit idle)."""

    def batches(self):
        for batch in super().batches():
            if len(batch.decode) > 1:
                batch = Batch(decode=batch.decode[:1], padding=batch.padding)
            yield batch


def _reshaped(change):
    """The lesson's static scheduler, each pass it yields changed by ``change(batch)``."""

    class Reshaped(MyStaticScheduler):
        def batches(self):
            for batch in super().batches():
                yield change(batch)

    return Reshaped


class ReturnsOneBatch(MyStaticScheduler):
    """Returns the prefill pass instead of yielding the passes."""

    def batches(self):
        return next(iter(super().batches()), None)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (ReturnsOneBatch, "ReturnsOneBatch.batches returned"),
        (ReturnsOneBatch, "write it as a generator: `yield Batch(...)` for each forward pass"),
        (_reshaped(lambda b: (b.decode, b.prefill)), "not a Batch: yield Batch(decode=..., prefill=...)"),
        (
            _reshaped(lambda b: Batch(decode=b.decode[0], padding=b.padding) if b.decode else b),
            "a Batch whose decode is <request r",
        ),
        (
            _reshaped(lambda b: Batch(decode=[r.id for r in b.decode], padding=b.padding) if b.decode else b),
            "a Batch whose decode holds 'r",
        ),
        (
            _reshaped(lambda b: Batch(prefill=dict(b.prefill)) if b.prefill else b),
            "}, not a list of (request, tokens) pairs",
        ),
        (
            _reshaped(lambda b: Batch(prefill=[r for r, _ in b.prefill]) if b.prefill else b),
            "each item is a pair (request, number of tokens)",
        ),
    ],
    ids=["returns-a-batch", "returns-a-batch-why", "a-tuple", "one-request", "ids", "a-dict", "no-counts"],
)
def test_a_scheduler_that_yields_no_batch_of_requests_is_named(wrong, says):
    assert_says(quiet("static_scheduler", wrong), says, case="2 of 12")


def test_static_batches_smaller_than_B_are_a_design_that_is_named():
    assert_differs(
        quiet("static_scheduler", SmallerBatches), "a new batch takes up to max_batch_size requests"
    )


def test_static_padding_tokens_left_out_are_named():
    assert_differs(
        quiet("static_scheduler", NoPaddingTokens), "padding_tokens: for every request of the batch"
    )


@pytest.mark.parametrize(
    "wrong, says",
    [(EveryRowDecodes, "got a decode row and a padding row"), (HalfTheRows, "the decode step ran rows")],
)
def test_static_scheduler_names_a_wrong_decode_step(wrong, says):
    assert_says(quiet("static_scheduler", wrong), says)


def test_wasted_slot_steps_names_forgetting_the_empty_slots():
    assert_says(
        quiet("wasted_slot_steps", lambda lens, B: sum(max(lens) - o for o in lens)),
        "that counts the padding rows, but 1 of the 4 slots waste every step too",
        case="2 of 6",
    )


@pytest.mark.parametrize(
    "wrong, says",
    [
        (
            lambda lens, B: sum(max(lens[i : i + B]) - 1 for i in range(0, len(lens), B)),
            "still takes one step (its prefill)",
        ),
        (lambda lens, B: max(lens) - 1, "with B=2, the 3 requests run as 2 batches, one after the other"),
        (
            lambda lens, B: float(len(lens)),
            "expected a whole number (a Python int), but you returned a float",
        ),
    ],
    ids=["no-prefill-step", "one-batch", "a-float"],
)
def test_static_steps_names_each_mistake(wrong, says):
    assert_says(quiet("static_steps", wrong), says)


# --------------------------------------------------------------------------------------
# Lesson 2: continuous_steps off by one.


def test_continuous_steps_names_an_off_by_one():
    from batchlab.course.checks._pieces import fake_workload, run_piece

    def one_too_many(lens, B):
        workload = fake_workload("req", [(5, o) for o in lens], 400)
        return len(run_piece("continuous", workload, max_batch_size=B).trace.steps) + 1

    assert_says(quiet("continuous_steps", one_too_many), "off by one: the prefill makes the first token")


# --------------------------------------------------------------------------------------
# Lessons 3 and 4: answers of the wrong kind.


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda t: np.array([[b - a for a, b in zip(t, t[1:])]]), "your array has shape [1, 3]"),
        (
            lambda t: {"gaps": [b - a for a, b in zip(t, t[1:])]},
            "expected a list of numbers, but you returned a dict",
        ),
        (lambda t: [f"{b - a:.2f}" for a, b in zip(t, t[1:])], "item 0: expected a number"),
    ],
    ids=["a-2d-array", "a-dict", "strings"],
)
def test_time_between_tokens_names_an_answer_of_the_wrong_kind(wrong, says):
    assert_says(quiet("time_between_tokens", wrong), says, case="1 of 6")


def test_largest_chunk_names_a_none_where_a_chunk_fits():
    def gives_up_under_a_second(target, rate, decode, choices):
        if target < 1:
            return None
        return max((c for c in choices if c / rate + decode <= target), default=None)

    assert_says(
        quiet("largest_chunk", gives_up_under_a_second), "a chunk size does fit this target", case="1 of 7"
    )


# --------------------------------------------------------------------------------------
# Lesson 5: pack_chunks and skipped_decodes.


def _tokens(chunks):
    return [t for c in chunks for t in c.tokens]


def _positions(chunks):
    return [p for c in chunks for p in range(c.start, c.end)]


def _ends(chunks):
    return [int(e) - 1 for e in np.cumsum([len(c.tokens) for c in chunks])]


@pytest.mark.parametrize(
    "wrong, case, says",
    [
        (lambda cs: {"tokens": _tokens(cs)}, "1 of 6", "return three lists: (tokens, positions, last)"),
        (
            lambda cs: (sorted(_tokens(cs)), _positions(cs), _ends(cs)),
            "5 of 6",
            "the tokens are wrong: every chunk's tokens, one chunk after the other",
        ),
        (lambda cs: (_tokens(cs), [c.start for c in cs], _ends(cs)), "2 of 6", "1 positions for 3 tokens"),
        (
            lambda cs: (_tokens(cs), [p + 1 for p in _positions(cs)], _ends(cs)),
            "1 of 6",
            "the positions are wrong: chunk c's tokens sit at c.start",
        ),
        (lambda cs: (_tokens(cs), _positions(cs), _ends(cs)[-1:]), "4 of 6", "1 last indices for 4 chunks"),
        (
            lambda cs: (_tokens(cs), _positions(cs), [e + 1 for e in _ends(cs)]),
            "1 of 6",
            "off by one: the index",
        ),
        (
            lambda cs: (_tokens(cs), _positions(cs), [len(c.tokens) - 1 for c in cs]),
            "4 of 6",
            "the last indices are wrong: where each chunk's last token sits",
        ),
    ],
    ids=[
        "a-dict",
        "tokens-sorted",
        "a-position-a-chunk",
        "positions-from-1",
        "one-last",
        "last-plus-one",
        "last-in-chunk",
    ],
)
def test_pack_chunks_names_each_mistake(wrong, case, says):
    assert quiet("pack_chunks", lambda cs: (_tokens(cs), _positions(cs), _ends(cs)))
    assert_says(quiet("pack_chunks", wrong), says, case=case)


def _skips(trace):
    """The right answer: steps between a request's first and last token in which it had no decode row."""
    first, last = {}, {}
    for step in trace.steps:
        for rid in step.emitted:
            first.setdefault(rid, step.index)
            last[rid] = step.index
    return [
        (step.index, rid)
        for step in trace.steps
        for rid in first
        if first[rid] < step.index <= last[rid] and rid not in step.decoded
    ]


@pytest.mark.parametrize(
    "wrong, says",
    [
        (
            lambda trace: {pair: True for pair in _skips(trace)},
            "return a list of (step index, request id) pairs, not a dict",
        ),
        (lambda trace: [(k, rid, "skipped") for k, rid in _skips(trace)], "each item should be a pair"),
        (lambda trace: _skips(trace) * 2, "a pair appears twice"),
        (lambda trace: _skips(trace)[:-1], "missed [(2, 'b')]"),
    ],
    ids=["a-dict", "triples", "twice", "one-missed"],
)
def test_skipped_decodes_names_each_mistake(wrong, says):
    assert quiet("skipped_decodes", _skips)
    assert_says(quiet("skipped_decodes", wrong), says)


# --------------------------------------------------------------------------------------
# Lesson 6: the engine's front (submit, poll, cancel) and stream_text.


class PollsTwoThings(MyEngine):
    def poll(self, req_id):
        tokens, status, _ = super().poll(req_id)
        return tokens, status


class ForgetsTheReason(MyEngine):
    def poll(self, req_id):
        tokens, status, _ = super().poll(req_id)
        return tokens, status, None


class PollsWithoutTheLock(MyEngine):
    def poll(self, req_id):
        req = self._requests.get(req_id)
        if req is None:
            return [], "unknown", None
        tokens, req.pending = req.pending, []
        if req.finished:
            del self._requests[req_id]
            return tokens, "done", req.finish_reason
        return tokens, "running", None


def _cancel(engine, req_id, *, says=True, reason="cancelled", only=None):
    """The lesson's cancel, returning ``says``, finishing with ``reason``, for requests whose state
    passes ``only``."""
    with engine._lock:
        req = engine._requests.get(req_id)
        if req is None or req.finished or (only is not None and not only(req.state)):
            return False
        engine._finish(req, reason)
        engine._cancelled.append(req)
        return says


class CancelReturnsNothing(MyEngine):
    def cancel(self, req_id):
        _cancel(self, req_id, says=None)


class CancelsOnlyQueued(MyEngine):
    def cancel(self, req_id):
        return _cancel(self, req_id, only=lambda state: state is State.QUEUED)


class CancelsOnlyStarted(MyEngine):
    def cancel(self, req_id):
        return _cancel(self, req_id, only=lambda state: state is not State.QUEUED)


class CancelEndsAsStop(MyEngine):
    def cancel(self, req_id):
        return _cancel(self, req_id, reason="stop")


class ReturnsTheRequest(MyEngine):
    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        checked = self.check_request(prompt_ids, **params)
        with self._lock:
            rid = request_id if request_id is not None else self.new_id()
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            self.admission.check_room(self._queue_depth)
            return self.enqueue(rid, checked, arrival_s)


class IgnoresTheGivenId(MyEngine):
    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        return super().submit(prompt_ids, None, arrival_s, **params)


class DropsTheParams(MyEngine):
    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        return super().submit(prompt_ids, request_id, arrival_s)


class KeyErrorForAnIdInUse(MyEngine):
    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        if request_id is not None and request_id in self._requests:
            raise KeyError(f"request id {request_id!r} is already in use")
        return super().submit(prompt_ids, request_id, arrival_s, **params)


class IdFromTheStep(MyEngine):
    """Names a request by the engine's step count; refuses only a given id in use."""

    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        checked = self.check_request(prompt_ids, **params)
        with self._lock:
            if request_id is not None and request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            rid = request_id if request_id is not None else f"req-{self._step_index}"
            self.admission.check_room(self._queue_depth)
            self.enqueue(rid, checked, arrival_s)
        return rid


class IdFromTheCountUnlocked(MyEngine):
    """Names a request by how many it knows, read before taking the lock."""

    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        checked = self.check_request(prompt_ids, **params)
        if request_id is not None and request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        rid = request_id if request_id is not None else f"req-{len(self._requests)}"
        time.sleep(0.02)  # whatever runs between reading the count and taking the lock
        with self._lock:
            self.admission.check_room(self._queue_depth)
            self.enqueue(rid, checked, arrival_s)
        return rid


@pytest.mark.parametrize(
    "wrong, says",
    [
        (PollsTwoThings, "poll returns three things: (new_tokens, status, finish_reason)"),
        (ForgetsTheReason, "the tokens and status are right but the finish reason is None"),
        (PollsWithoutTheLock, "your poll never takes self._lock"),
        (CancelReturnsNothing, "cancel returns True or False, not None / None"),
        (CancelsOnlyQueued, "cancel of a decoding request must return True"),
        (CancelsOnlyStarted, "cancel of a queued request must return True"),
        (CancelEndsAsStop, "after cancel, poll should give"),
        (ReturnsTheRequest, "submit returns the request's id (a str), not Request("),
        (IgnoresTheGivenId, "submit(..., request_id='mine') returned 'req-2'"),
        (DropsTheParams, "the submitted request should make"),
        (KeyErrorForAnIdInUse, "raised KeyError"),
        (IdFromTheStep, "two submits without a request_id both got the id 'req-0'"),
        (IdFromTheCountUnlocked, "submits at once got the same id"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_engine_front_names_each_mistake(wrong, says):
    assert_says(quiet("engine_front", wrong), says)


def _stream(poll, rid, detok, *, flush=True, tail=True, stop_on_empty=False, one_more=False, at_end=False):
    """The lesson's stream_text, with one of its steps switchable."""
    pieces = []
    while True:
        tokens, status, _ = poll(rid)
        if status != "running" and not tail:
            break
        if stop_on_empty and not tokens:
            break
        for t in tokens:
            if piece := detok.add(t):
                pieces.append(piece)
        if status != "running":
            if one_more:
                poll(rid)
            break
        if not at_end:
            yield from pieces
            pieces = []
    if flush and (rest := detok.flush()):
        pieces.append(rest)
    yield from pieces


def _by_design(**how):
    def stream(poll, rid, detok):
        yield from _stream(poll, rid, detok, **how)

    return stream


def _token_ids(poll, rid, detok):
    while True:
        tokens, status, _ = poll(rid)
        yield from tokens
        if status != "running":
            return


def _token_by_token(poll, rid, detok):
    while True:
        tokens, status, _ = poll(rid)
        for t in tokens:
            yield BYTE_LM.tokenizer.decode([t])
        if status != "running":
            return


def test_stream_text_passes_the_lessons_stream_on_the_fake():
    assert quiet("stream_text", _by_design(), BYTE_LM)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_token_ids, "yield pieces of text (str), not token ids"),
        (_by_design(one_more=True), "you polled again after the status stopped being 'running'"),
        (_by_design(stop_on_empty=True), "you stopped polling while the status was still 'running'"),
        (_token_by_token, "a piece contains '\\ufffd' (the replacement character)"),
        (_by_design(tail=False), "the tokens that came with the final status are missing"),
        (_by_design(flush=False), "is missing (flush())"),
        (_by_design(at_end=True), "the first piece came out only after the last poll"),
    ],
    ids=[
        "token-ids",
        "polls-after-done",
        "stops-on-an-empty-poll",
        "decodes-alone",
        "drops-the-last-tokens",
        "no-flush",
        "all-at-the-end",
    ],
)
def test_stream_text_names_each_mistake(wrong, says):
    assert_says(quiet("stream_text", wrong, BYTE_LM), says)


# --------------------------------------------------------------------------------------
# Lesson 7: server_events on the byte-level tokenizer (the lesson's switchboard of mistakes), and
# the exercises' answers of the wrong kind.

TOK = BYTE_LM.tokenizer


def test_the_lessons_server_passes_on_the_fake_tokenizer():
    assert quiet("server_events", learner_pieces.MyServer, TOK)
    assert quiet("server_events", mistaken(), TOK)


@pytest.mark.parametrize(
    "mistake, says",
    [
        ("one_piece_a_poll", "not one per token"),
        ("decodes_alone", "half a character"),
        ("shows_eos", "shows a special token"),
        ("no_flush", "stops short"),
        ("status_first", "the last event counts 52 tokens, not 53"),
        ("counts_text_only", "the last event counts 52 tokens, not 53"),
        ("stop_without_cancel", "tell the engine with self.loop.stop_string_met"),
        ("stop_as_cancel", "call self.loop.stop_string_met(rid) instead"),
        ("no_finally", "were never cancelled"),
        ("always_cancels", "had ended by themselves"),
        ("error_as_stop", "raised StreamEnded(..., 500)"),
        ("ignores_closing", "raised StreamEnded(..., 503)"),
        ("says_cancelled", "not ['stop']"),
        ("shared_detokenizer", "request 'a': the text has '\\ufffd'"),
        ("busy", "wait for the next step"),
        ("blocks", "blocking in time.sleep"),
    ],
)
def test_server_events_names_each_mistake_on_the_fake_tokenizer(mistake, says):
    assert_says(quiet("server_events", mistaken(**{mistake: True}), TOK), says)


class StopsWhenNoStopString(learner_pieces.MyServer):
    """Tells the engine a stop string was met whenever a stream ends, stop string or not."""

    async def events(self, rid, stops):
        async for text, reason, count in super().events(rid, stops):
            if reason is not None:
                self.loop.stop_string_met(rid)
            yield text, reason, count


class KeepsGoingAfterTheStop(learner_pieces.MyServer):
    """Sends the stop string's text too (and the rest of the poll)."""

    async def events(self, rid, stops):
        async for event in super().events(rid, []):
            yield event


class AddsANewline(learner_pieces.MyServer):
    async def events(self, rid, stops):
        async for text, reason, count in super().events(rid, stops):
            yield (text + "\n" if text else text), reason, count


class CountsFromZero(learner_pieces.MyServer):
    """Counts the tokens before the one just made: each piece's count one short."""

    async def events(self, rid, stops):
        async for text, reason, count in super().events(rid, stops):
            yield text, reason, count - 1


class YieldsText(ServerBase):
    async def events(self, rid, stops):
        tokens, _, _ = self.loop.poll(rid)
        yield "text"


class WaitsForever(ServerBase):
    """Never polls again: the stream stays open."""

    async def events(self, rid, stops):
        await asyncio.Event().wait()
        yield "", "stop", 0


class ReturnsAList(ServerBase):
    async def events(self, rid, stops):
        return [("", "stop", 0)]


@pytest.mark.parametrize(
    "wrong, says",
    [
        (StopsWhenNoStopString, "whose text met no stop string"),
        (KeepsGoingAfterTheStop, "goes past"),
        (AddsANewline, "is not"),
        (CountsFromZero, "each piece's count is the tokens made so far"),
        (YieldsText, "yield (new text, finish reason or None, tokens so far)"),
        (WaitsForever, "a stream was still open 1.5 s after its request ended"),
        (ReturnsAList, "events() must yield its events (an async generator), not return them"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_server_events_names_a_stream_of_its_own_mistake(wrong, says):
    assert_says(quiet("server_events", wrong, TOK), says)


def _metrics(sent, chunks, done, tokens):
    ttft = chunks[0] - sent
    return (
        ttft,
        [b - a for a, b in zip(chunks, chunks[1:])],
        (done - sent - ttft) / (tokens - 1) if tokens > 1 else None,
    )


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda s, c, d, n: (d - s, *_metrics(s, c, d, n)[1:]), "the TTFT is wrong (it should be 0.5 s)"),
        (
            lambda s, c, d, n: (c[0] - s, [b - s for b in c[1:]], _metrics(s, c, d, n)[2]),
            "the gaps are wrong",
        ),
        (
            lambda s, c, d, n: (*_metrics(s, c, d, n)[:2], str(_metrics(s, c, d, n)[2])),
            "TPOT should be a number",
        ),
        (lambda s, c, d, n: (*_metrics(s, c, d, n)[:2], (d - s) / n), "stream_metrics: "),
    ],
    ids=["ttft-to-done", "gaps-from-sent", "tpot-a-str", "tpot-of-everything"],
)
def test_stream_metrics_names_each_mistake(wrong, says):
    assert quiet("stream_metrics", _metrics)
    assert_says(quiet("stream_metrics", wrong), says)


def test_parse_sse_names_an_answer_that_is_not_a_list():
    assert_says(
        quiet("parse_sse", lambda lines: "".join(lines)), "return a list of strings, not a str", case="1 of 6"
    )


# --------------------------------------------------------------------------------------
# Lesson 8: kv_slots, cached_prefix, the victim.


@pytest.mark.parametrize(
    "wrong, case, says",
    [
        (
            lambda table, start, stop, size: None,
            "1 of 6",
            "return a list of slot numbers (ints), one per token",
        ),
        (
            lambda table, start, stop, size: [  # a slot a block: where each block starts
                table[b] * size for b in range(start // size, (stop - 1) // size + 1)
            ],
            "1 of 6",
            "1 slots for 4 tokens: one slot per token start..stop-1",
        ),
        (
            lambda table, start, stop, size: list(range(start, stop)),
            "2 of 6",
            "those are the token positions",
        ),
    ],
    ids=["none", "a-slot-a-block", "positions"],
)
def test_kv_slots_names_each_mistake(wrong, case, says):
    assert_says(quiet("kv_slots", wrong), says, case=case)


def test_cached_prefix_names_an_early_stop():
    from batchlab.core.kv import BlockManager

    def first_block_only(token_ids, cached, size):
        """Looks up the first block only."""
        if len(token_ids) <= size:
            return []
        key = BlockManager.block_key(b"", token_ids[:size])
        return [cached[key]] if key in cached else []

    assert_says(
        quiet("cached_prefix", first_block_only),
        "you stopped early: keep going while the next block's key is in the cache",
        case="2 of 7",
    )


class VictimByIndex(learner_pieces.MyVictimPolicy):
    """Returns where the victim sits in the list, not the request."""

    def victim(self, running):
        return running.index(super().victim(running))


def test_memory_scheduler_names_a_victim_that_is_not_a_request():
    assert_says(
        quiet("memory_scheduler", MyMemoryScheduler, VictimByIndex), "return one of the running requests"
    )


# --------------------------------------------------------------------------------------
# Lesson 9: to_shed and the admission policy.


def _late(queue, now, slo, speed):
    return [rid for rid, t, n in queue if (now - t) + n / speed > slo]


@pytest.mark.parametrize(
    "wrong, case, says",
    [
        (
            lambda q, now, slo, speed: set(_late(q, now, slo, speed)),
            "1 of 6",
            "return a list of request ids, not",
        ),
        (
            lambda q, now, slo, speed: sorted(_late(q, now, slo, speed)),
            "6 of 6",
            "the right ids, but keep them in queue order",
        ),
        (
            lambda q, now, slo, speed: [rid for rid, t, n in q if (now - t) + n / speed >= slo],
            "5 of 6",
            "['edge'] can still make it; shed only the late ones",
        ),
    ],
    ids=["a-set", "sorted", "sheds-on-the-dot"],
)
def test_to_shed_names_each_mistake(wrong, case, says):
    assert quiet("to_shed", _late)
    assert_says(quiet("to_shed", wrong), says, case=case)


@dataclass(frozen=True)
class ShedsIds(MyAdmission):
    """Returns the ids to shed, not the requests."""

    def to_shed(self, queue, now):
        return [r.id for r in super().to_shed(queue, now)]


@dataclass(frozen=True)
class NoneForAnEmptyQueue(MyAdmission):
    def to_shed(self, queue, now):
        return None if not queue else super().to_shed(queue, now)


@dataclass(frozen=True)
class NoRoomWithoutABound(MyAdmission):
    """Reads max_queue None as "no room"."""

    def check_room(self, queue_depth):
        from batchlab.core.policies import QueueFull

        if self.max_queue is None or queue_depth() >= self.max_queue:
            raise QueueFull("the queue is full")


@dataclass(frozen=True)
class FullOneEarly(MyAdmission):
    def check_room(self, queue_depth):
        from batchlab.core.policies import QueueFull

        if self.max_queue is not None and queue_depth() >= self.max_queue - 1:
            raise QueueFull("the queue is full")


@dataclass(frozen=True)
class ShedsWithoutALimit(MyAdmission):
    """Treats max_wait_s None as 0: sheds every request that never started."""

    def to_shed(self, queue, now):
        limit = 0.0 if self.max_wait_s is None else self.max_wait_s
        return [
            r for r in queue if r.state is State.QUEUED and not r.output_ids and now - r.arrival_s > limit
        ]


@dataclass(frozen=True)
class ShedsNewestFirst(MyAdmission):
    def to_shed(self, queue, now):
        return list(reversed(super().to_shed(queue, now)))


@pytest.mark.parametrize(
    "wrong, says",
    [
        (ShedsIds, "which is not a queued request"),
        (
            NoneForAnEmptyQueue,
            "NoneForAnEmptyQueue.to_shed returned None (a NoneType), not a list of requests",
        ),
        (NoRoomWithoutABound, "max_queue None means no bound"),
        (FullOneEarly, "fewer than max_queue"),
        (ShedsWithoutALimit, "max_wait_s None means: shed nothing"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_admission_policy_names_each_mistake(wrong, says):
    assert_says(quiet("admission_policy", wrong), says)


def test_admission_policy_names_another_order_as_a_design():
    assert_differs(quiet("admission_policy", ShedsNewestFirst), "the right requests in another order")


# --------------------------------------------------------------------------------------
# Lesson 10: an aging policy that refuses a bad age_s with the wrong exception.


class TypeErrorForAString(MyAgingPolicy):
    def __init__(self, age_s=30.0):
        if isinstance(age_s, str):
            raise TypeError("age_s must be a number")
        super().__init__(age_s)


def test_aging_policy_names_the_wrong_exception():
    assert_says(
        quiet("aging_policy", TypeErrorForAString),
        "TypeErrorForAString(age_s='10') raised TypeError, not ValueError",
    )


# --------------------------------------------------------------------------------------
# Lesson 11: propose and accept returning the wrong kind of thing; a proposer of another rule.


def test_speculative_scheduler_names_a_proposal_that_is_not_a_list():
    def propose_or_none(tokens, k, min_n=1, max_n=4):
        return learner_pieces.propose(tokens, k, min_n, max_n) or None

    assert_says(
        quiet("speculative_scheduler", propose_or_none, learner_pieces.MySpeculativeScheduler),
        "propose returns a list of token ids, not a NoneType",
        case="2 of 24",
    )


class AcceptsATuple(learner_pieces.MySpeculativeScheduler):
    def accept(self, req, drafts, picks):
        return tuple(super().accept(req, drafts, picks))


class SampledRunTooLong(learner_pieces.MySpeculativeScheduler):
    """Right for greedy requests; for sampled ones the drafts and then every draw."""

    def accept(self, req, drafts, picks):
        return super().accept(req, drafts, picks) if req.sampler.params.greedy else [*drafts, *picks]


@pytest.mark.parametrize(
    "wrong, says",
    [
        (AcceptsATuple, "accept returns a list of token ids, not a tuple"),
        (
            SampledRunTooLong,
            "your accept returned [0, 1, 0, 1, 1]: accept returns 1 to len(drafts) + 1 tokens",
        ),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_speculative_scheduler_names_what_accept_returned(wrong, says):
    assert_says(quiet("speculative_scheduler", learner_pieces.propose, wrong), says)


def test_speculative_scheduler_names_a_shorter_pattern_first_as_a_design():
    def shortest_first(tokens, k, min_n=1, max_n=4):
        for n in range(min_n, min(max_n, len(tokens) - 1) + 1):
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tokens[-n:]:
                    return tokens[start + n : start + n + k]
        return []

    verdict = quiet("speculative_scheduler", shortest_first, learner_pieces.MySpeculativeScheduler)
    assert_differs(verdict, "yours proposed [5, 1], what followed the last 1 token(s)")
    assert "the lesson's rule proposes [3, 9]" in verdict.message, verdict.message


def test_the_fake_model_is_deterministic():
    """Two runs of the fake give the same tokens, with or without the cache (the tests above rely on it)."""
    ids = BYTE_LM.tokenizer.encode("Once upon a time")
    assert _greedy(BYTE_LM, ids, 12) == _greedy(BYTE_LM, ids, 12) == _greedy(BYTE_LM, ids, 12, cache=False)
