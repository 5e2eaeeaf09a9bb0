"""``batchlab demo`` on the fake model: every screen fits an 80×24 terminal (with wide
characters in the answers), and an answer cut inside a UTF-8 character (the real
tokenizer) never shows "�"."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from batchlab import Tokenizer, demo
from batchlab.core.fake import FakeRunner


class CharTokenizer:
    """Token t is one character: a letter, a space, or a wide one (two columns); 0 is EOS."""

    vocab_size, eos_token_ids = 64, frozenset({0})

    @staticmethod
    def text(t: int) -> str:
        return "件" if t % 9 == 0 else " " if t % 5 == 0 else chr(ord("a") + t % 26)

    def encode_chat(self, messages):
        return [1 + ord(ch) % 63 for m in messages for ch in m["content"]]

    def detokenizer(self):
        return SimpleNamespace(add=self.text)


@pytest.fixture
def fake_lm():
    tok = CharTokenizer()
    return SimpleNamespace(
        tokenizer=tok, vocab_size=tok.vocab_size, max_seq_len=2048, info=SimpleNamespace(name="fake-model")
    )


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "kind,requests,options",
    [
        ("stallfree", 10, {}),
        ("continuous", 26, {"max_batch_size": 8}),
        ("static", 26, {"max_batch_size": 2}),
    ],
)
def test_every_screen_fits_80_by_24_and_names_the_engine(fake_lm, kind, requests, options):
    term = Terminal()
    summary = demo.play(fake_lm, kind, requests, out=term, runner=FakeRunner, **options)
    screens = term.getvalue().split("\x1b[H\x1b[J")[1:]
    assert len(screens) > 10, "redrawn after every step"
    assert "件" in term.getvalue(), "wide characters were on screen"
    last = screens[-1].split("\n\n" + summary)[0]
    for screen in screens[:-1] + [last]:
        lines = screen.rstrip("\n").split("\n")
        assert len(lines) <= demo.HEIGHT, screen
        assert all(sum(map(demo.columns, line)) <= demo.WIDTH for line in lines), screen
        assert lines[0].startswith(f"batchlab demo · {kind} engine")
    slots = options.get("max_batch_size", 4)
    assert f"{slots} slots" in screens[0]
    assert f"of {requests} answered" in last and f"{requests} of {requests} answered" in last
    assert summary.startswith(f"The {kind} engine answered {requests} requests")
    assert len(summary.split("\n")) <= 6 and all(len(line) <= 80 for line in summary.split("\n"))


def test_a_pipe_gets_only_the_last_screen_and_the_summary(fake_lm):
    out = io.StringIO()
    demo.play(fake_lm, "stallfree", 4, out=out, runner=FakeRunner)
    assert "\x1b" not in out.getvalue()
    assert out.getvalue().count("batchlab demo ·") == 1


def test_idle_slots_and_the_queue_are_explained():
    assert demo.explain(False, 2, 0, 4) == "2 slots idle: no request is waiting for one."
    assert "all 4 slots are busy" in demo.explain(False, 0, 3, 4)
    assert "whole batch" in demo.explain(True, 1, 3, 4)


def test_an_answer_cut_inside_a_character_drops_the_half_character(gguf_meta):
    tok = Tokenizer.from_gguf_metadata(gguf_meta)
    ids = tok.encode("Hola! 😊")
    assert tok.decode(ids[:-1]).endswith("\ufffd"), "the emoji spans two tokens"
    r = demo.ShownRequest("A", "Say hello in Spanish.", tok.detokenizer(), tok.eos_token_ids)
    r.add(ids[:-1])  # the token limit cut the emoji in half
    assert r.answer == "Hola!"
    r = demo.ShownRequest("A", "Say hello in Spanish.", tok.detokenizer(), tok.eos_token_ids)
    r.add(ids + sorted(tok.eos_token_ids)[:1])
    assert r.answer == "Hola! 😊" and r.tokens == len(ids) + 1


def test_fit_counts_terminal_columns():
    assert demo.fit("abc", 5, pad=True) == "abc  "
    wide = demo.fit("件件件件件", 7)
    assert wide == "件件件…" and sum(map(demo.columns, wide)) == 7
    assert demo.one_line("a\n\tb\x1bc") == "a b?c"
