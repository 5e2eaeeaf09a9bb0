"""Lesson 7's piece checker rejects known-wrong streams (``MyServer.events``), one per contract
clause, and names the mistake. Each wrong server is the lesson's own with one mistake switched on."""

from __future__ import annotations

import asyncio
import time

import pytest

from batchlab.course import checks
from batchlab.serving.server import HEARTBEAT_S, Server, ServerBase, StopMatcher, StreamEnded
from learner_pieces import MyServer


@pytest.fixture(scope="module")
def tok(gguf_meta):
    from batchlab.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(gguf_meta)


def mistaken(**wrong):
    """The lesson's ``events`` with the mistakes named in ``wrong`` made."""

    async def events(self, rid, stops):
        detok = self.lm.tokenizer.detokenizer()
        if wrong.get("shared_detokenizer"):  # one detokenizer for every stream of the server
            detok = self.__dict__.setdefault("detok", detok)
        stopper, eos, count, ended = StopMatcher(stops), self.lm.tokenizer.eos_token_ids, 0, False
        try:
            while True:
                progress = self.next_progress()
                tokens, status, reason = self.loop.poll(rid)
                if wrong.get("status_first") and status != "running":
                    ended = True
                    yield "", reason, count
                    return
                texts = []
                for token in tokens:
                    count += 1 if not wrong.get("counts_text_only") or token not in eos else 0
                    if wrong.get("decodes_alone"):
                        piece = self.lm.tokenizer.decode([token])
                    else:
                        piece = detok.add(token) if wrong.get("shows_eos") or token not in eos else ""
                    text, hit = stopper.feed(piece)
                    if hit:
                        if wrong.get("stop_as_cancel"):
                            self.loop.cancel(rid)
                        elif not wrong.get("stop_without_cancel"):
                            self.loop.stop_string_met(rid)
                        ended = True
                        yield text, "stop", count
                        return
                    if text and wrong.get("one_piece_a_poll"):
                        texts.append(text)
                    elif text:
                        yield text, None, count
                if texts:
                    yield "".join(texts), None, count
                if reason == "error" and not wrong.get("error_as_stop"):
                    ended = True
                    raise StreamEnded("the engine failed while running this request", 500)
                if status != "running":
                    ended = True
                    text, hit = stopper.feed("" if wrong.get("no_flush") else detok.flush())
                    if reason == "cancelled" and not wrong.get("says_cancelled"):
                        reason = "stop"
                    yield text + ("" if hit else stopper.flush()), "stop" if hit else reason, count
                    return
                if self.unavailable() and not wrong.get("ignores_closing"):
                    raise StreamEnded(self.unavailable(), 503)
                if wrong.get("busy"):
                    await asyncio.sleep(0)
                elif wrong.get("blocks"):
                    time.sleep(0.005)
                else:
                    try:
                        await asyncio.wait_for(progress.wait(), HEARTBEAT_S)
                    except asyncio.TimeoutError:
                        pass
        finally:
            if wrong.get("always_cancels") or (not ended and not wrong.get("no_finally")):
                self.loop.cancel(rid)

    return type("Wrong", (ServerBase,), {"events": events})


def test_the_lessons_server_passes(tok):
    assert checks.server_events(MyServer, tok)
    assert checks.server_events(mistaken(), tok), "the switchboard with no mistake must pass"


def test_ours_fails_only_the_lineage(tok, capsys):
    verdict = checks.server_events(Server, tok)
    assert verdict.passed == verdict.total - 1 and "pass your own class" in capsys.readouterr().out


def test_the_base_is_not_written_yet(tok):
    verdict = checks.server_events(ServerBase, tok)
    assert not verdict and verdict.not_written


@pytest.mark.parametrize(
    "mistake, says",
    [
        ("one_piece_a_poll", "not one per token"),
        ("decodes_alone", "half a character"),
        ("shows_eos", "special token"),
        ("no_flush", "stops short"),
        ("status_first", "with the final status too"),
        ("counts_text_only", "EOS and those"),
        ("stop_without_cancel", "tell the engine with self.loop.stop_string_met"),
        ("stop_as_cancel", "call self.loop.stop_string_met(rid) instead"),
        ("no_finally", "never cancelled"),
        ("always_cancels", "had ended by themselves"),
        ("error_as_stop", "raised StreamEnded(..., 500)"),
        ("ignores_closing", "raised StreamEnded(..., 503)"),
        ("says_cancelled", "not ['stop']"),
        ("shared_detokenizer", "not on self"),
        ("busy", "wait for the next step"),
        ("blocks", "blocking in time.sleep"),
    ],
)
def test_a_wrong_stream_is_refused_with_its_mistake_named(tok, capsys, mistake, says):
    verdict = checks.server_events(mistaken(**{mistake: True}), tok)
    out = capsys.readouterr().out
    assert not verdict, f"{mistake} passed"
    assert says in out, out


def test_a_stream_that_yields_the_wrong_thing_is_named(tok, capsys):
    class YieldsText(ServerBase):
        async def events(self, rid, stops):
            tokens, _, _ = self.loop.poll(rid)
            yield "text"

    assert not checks.server_events(YieldsText, tok)
    assert "yield (new text, finish reason or None, tokens so far)" in capsys.readouterr().out


def test_a_stream_that_never_ends_is_stopped_and_named(tok, capsys):
    class WaitsForever(ServerBase):
        async def events(self, rid, stops):
            await asyncio.Event().wait()
            yield "", "stop", 0

    assert not checks.server_events(WaitsForever, tok)
    assert "still open" in capsys.readouterr().out
