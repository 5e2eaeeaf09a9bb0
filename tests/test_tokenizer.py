"""The tokenizer rebuilt from GGUF metadata must agree with an independent reference:
transformers' own conversion of the same GGUF tokenizer (``AutoTokenizer`` with
``gguf_file=``). Also: the chat template, EOS ids, the streaming detokenizer, bad input.

One correction to the reference. The GGUF says ``tokenizer.ggml.pre = "smollm"``, which
llama.cpp defines as two regex splits: every ``\\p{N}`` character alone, then GPT-2's
regex (the original Hugging Face tokenizer.json does the same with a ``Digits``
pre-tokenizer). transformers' GGUF converter (5.x) keeps only the GPT-2 part. For ASCII
digits that happens not to matter (the vocabulary has no token joining a digit to
anything), but for other numerals (``½``, ``²``, ``٣``, ``４``) it changes the ids. So the
reference used for encoding is transformers' converted tokenizer with llama.cpp's
"smollm" regexes as its pre-tokenizer; plain transformers is also compared on every
text without such numerals.
"""

from __future__ import annotations

import unicodedata

import pytest
from tokenizers import Regex
from tokenizers import Tokenizer as HFBackend
from tokenizers import pre_tokenizers

from batchlab import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "",
    "Hello world",
    "Hello, world! It's a test... isn't it? (yes) [no] {maybe}",
    " leading space",
    "trailing space ",
    # unicode: accents (precomposed and combining), CJK, Arabic, Hebrew, Cyrillic, Greek, Devanagari
    "café naïve façade Ångström Øresund",
    "cafe\u0301 nai\u0308ve A\u030angstro\u0308m",  # combining marks
    "日本語のテキストです。中文测试，한국어 텍스트",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם",
    "Привет, мир! Ελληνικά κείμενα",
    "नमस्ते दुनिया",
    "ℝ ∀x ∈ ℕ: x² ≥ 0 → √x, ½ ¾ ™ © ®",
    # emoji: plain, skin tone, ZWJ sequences, flags, keycaps, variation selectors
    "I love 🍕 and 🐍!",
    "👍🏽 👋🏿",
    "👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag",
    "🇫🇷🇯🇵🇺🇸 flags",
    "1️⃣ #️⃣ ❤️ ☺︎",
    "🫠🪿🧌",  # newer emoji
    # code: tabs and indentation
    "def f(x):\n\tif x:\n\t\treturn x ** 2\n\treturn None\n",
    "class A:\n    def __init__(self):\n        self.x = [1, 2, 3]  # comment\n",
    'for (int i = 0; i < n; ++i) {\n  printf("%d\\n", a[i]);\n}',
    '{"key": "value", "list": [1, 2.5, null, true]}',
    "SELECT * FROM t WHERE a <> 'b' AND c >= 10;",
    # whitespace runs: spaces, newlines, tabs, mixed, \r\n, non-breaking and ideographic spaces
    "a  b   c    d     e",
    "          ",
    "\n",
    "\n\n\n\n",
    "line1\n\nline2\n\n\n\nline3",
    " \t \n \t\t\n  \n",
    "x\r\ny\r\n\r\nz",
    "nbsp\u00a0here\u3000and\u2003there",
    # digits
    "0123456789",
    "1234567890123 and 3.14159, -42, 1e-10, 0xFF, 1,000,000",
    "Year 2024: 12/31 at 23:59",
    "x² + y³ = ½ of ¾",  # non-ASCII numerals (Unicode category N)
    "٣ ١٢ ۴۵ and ４２ and ①② Ⅻ",
    "四五六 are letters (Lo), not numerals",
    # special tokens written in text
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|><|im_start|>",
    "<|im_start|> spaced <|im_end|> out",
    "almost special: <|im_star|> <im_end> <|endoftext",
    "<filename>main.py<file_sep><jupyter_code>",
    # odd characters
    "null\x00byte and control \x07\x1b[0m chars",
    "Zero\u200bwidth\u200cjoiners\u200d and \ufeffBOM",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𓀀 𠜎",  # astral plane
]


@pytest.fixture(scope="module")
def tok(gguf_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_meta)


@pytest.fixture(scope="module")
def ref_encode(hf_tokenizer):
    """transformers' converted GGUF tokenizer with llama.cpp's "smollm" pre-tokenization."""
    backend = HFBackend.from_str(hf_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),  # llama.cpp: "\\p{N}"
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),  # GPT-2's regex
        ]
    )
    return lambda text: backend.encode(text, add_special_tokens=False).ids


def _has_non_ascii_numeral(text: str) -> bool:
    return any(not c.isascii() and unicodedata.category(c).startswith("N") for c in text)


def test_gguf_declares_smollm_pretokenizer(gguf_meta):
    assert gguf_meta["tokenizer.ggml.pre"] == "smollm"  # the premise of ref_encode


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches_reference(tok, ref_encode, text):
    assert tok.encode(text) == ref_encode(text)


@pytest.mark.parametrize("text", [t for t in TEXTS if not _has_non_ascii_numeral(t)])
def test_encode_matches_plain_transformers(tok, hf_tokenizer, text):
    assert tok.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_numerals_are_split_one_per_piece(tok):
    """Every Unicode numeral is a piece of its own (llama.cpp's first "smollm" regex), so a
    run of numerals, or a space before one, tokenizes as the pieces do separately."""
    for pieces in [
        ["½", "¾"],
        ["x", "²", "³"],
        ["١", "٢", "٣"],
        ["４", "２"],
        [" ", "½"],
        ["a", " ", "٣"],
        ["1", "2", "3"],
        [" ", "7"],
    ]:
        assert tok.encode("".join(pieces)) == [i for p in pieces for i in tok.encode(p)], pieces


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_decode_matches_reference(tok, hf_tokenizer, text):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    ours = tok.decode(ids)
    assert ours == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    # byte-level BPE is lossless: decoding gives back the text exactly
    assert ours == text


def test_loaded_model_tokenizer_is_the_same(lm, tok):
    """``load_model().tokenizer`` is the tokenizer tested here."""
    for text in TEXTS:
        assert lm.tokenizer.encode(text) == tok.encode(text)


def test_decode_of_arbitrary_ids_matches_reference(tok, hf_tokenizer):
    """Id sequences no text would produce (random tokens, lone byte tokens, specials)."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 20))]
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=False), ids
        assert tok.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_long_text_matches_reference(tok, ref_encode):
    text = "\n".join(TEXTS) * 5
    ids = tok.encode(text)
    assert ids == ref_encode(text)
    assert tok.decode(ids) == text


def test_vocabulary_and_special_tokens(tok, hf_tokenizer):
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        (i,) = tok.encode(text)  # one token each
        assert tok.special_tokens[text] == i == hf_tokenizer.convert_tokens_to_ids(text)
    assert set(tok.special_tokens) == set(hf_tokenizer.all_special_tokens) | set(
        t.content for t in hf_tokenizer.added_tokens_decoder.values() if t.special
    )


def test_eos_ids(tok, hf_tokenizer):
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2
    assert 2 in tok.eos_token_ids
    assert hf_tokenizer.eos_token_id in tok.eos_token_ids
    assert tok.eos_token == hf_tokenizer.eos_token == "<|im_end|>"
    # every EOS id is a special token (never a piece of ordinary text)
    assert tok.eos_token_ids <= set(tok.special_tokens.values())


# ---------------------------------------------------------------- chat template

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🐍 and 日本."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?\n\nThanks"},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "  code:\n\tx = 1\n  "}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_chat_template_matches_reference(tok, hf_tokenizer, ref_encode, messages):
    ours = tok.apply_chat_template(messages)
    ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == ref
    assert tok.encode_chat(messages) == ref_encode(ref)


@pytest.mark.parametrize("messages", CONVERSATIONS[:3], ids=range(3))
def test_chat_template_without_generation_prompt(tok, hf_tokenizer, messages):
    ours = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not ours.endswith("<|im_start|>assistant\n")


def test_default_system_prompt(tok, hf_tokenizer):
    """Without a system message the template adds the model's default one; with one, it does not."""
    user = [{"role": "user", "content": "Hello"}]
    rendered = tok.apply_chat_template(user)
    assert rendered.startswith("<|im_start|>system\n")
    system_block = rendered.split("<|im_end|>")[0].removeprefix("<|im_start|>system\n")
    assert system_block.strip()  # a non-empty default system prompt ...
    assert rendered.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    # ... the same one the reference renders, and the model is told it is SmolLM
    assert rendered == hf_tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert "SmolLM" in system_block
    given = tok.apply_chat_template([{"role": "system", "content": "Be terse."}] + user)
    assert system_block not in given
    assert given.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")


@pytest.mark.parametrize(
    "messages",
    [
        [],
        None,
        "What is the capital of France?",
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 42}],
        [{"role": 1, "content": "hi"}],
        ["user: hi"],
        [{"role": "user", "content": "ok"}, None],
    ],
    ids=range(10),
)
def test_malformed_messages_raise(tok, messages):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)


@pytest.mark.parametrize("bad", [None, 3.5, 42, b"bytes", ["a", "b"], {"text": "x"}])
def test_encode_rejects_non_text(tok, bad):
    with pytest.raises(ValueError, match="str"):
        tok.encode(bad)


# ---------------------------------------------------------------- streaming detokenizer

STREAM_TEXTS = [
    "I love 🍕 and 🐍! 👨‍👩‍👧‍👦 🇫🇷🇯🇵 👍🏽",
    "日本語のテキストです。中文测试，한국어 텍스트 𠜎𓀀",
    "mixed: café 🫠 naïve 😀😃😄 مرحبا\n\tcode() # ✓ done",
    "<|im_start|>assistant\nSure! 🎉 Here: 你好<|im_end|>",
]


def _stream(tok, ids):
    detok = tok.detokenizer()
    assert isinstance(detok, IncrementalDetokenizer)
    pieces = [detok.add(i) for i in ids]
    return pieces, detok.flush()


@pytest.mark.parametrize("text", STREAM_TEXTS, ids=range(len(STREAM_TEXTS)))
def test_streaming_never_emits_broken_characters(tok, text):
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces + [tail]), pieces
    assert "".join(pieces) + tail == tok.decode(ids) == text
    # the stream really was held back somewhere (these texts have characters split over tokens)
    assert "" in pieces


def test_streaming_model_output(lm):
    """Stream real generated tokens: same guarantees."""
    import batchlab

    g = batchlab.generate(
        lm, [{"role": "user", "content": "Reply with three emoji and a Chinese word."}], max_new_tokens=24
    )
    pieces, tail = _stream(lm.tokenizer, g.token_ids)
    assert all("\ufffd" not in p for p in pieces + [tail])
    assert "".join(pieces) + tail == lm.tokenizer.decode(g.token_ids)


def _bytes_of_token(tok, token_id: int) -> bytes:
    """The raw bytes a byte-level BPE token stands for, via GPT-2's byte<->unicode table
    (independent of the tokenizer's decoder)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    to_byte = {chr(c): b for b, c in zip(bs, cs)}
    return bytes(to_byte[ch] for ch in tok.backend.id_to_token(token_id))


def test_split_character_is_held_back(tok):
    """A character whose UTF-8 bytes are spread over several tokens comes out whole."""
    found = 0
    for char in ["🐍", "😀", "𠜎", "𓀀", "🫠", "🦜"]:
        ids = tok.encode(char)
        if len(ids) < 2:
            continue
        first = _bytes_of_token(tok, ids[0])
        with pytest.raises(UnicodeDecodeError):
            first.decode("utf-8")  # the first token alone is an incomplete character
        assert b"".join(_bytes_of_token(tok, i) for i in ids) == char.encode("utf-8")
        detok = tok.detokenizer()
        pieces = [detok.add(i) for i in ids]
        assert pieces[:-1] == [""] * (len(ids) - 1)  # held back while incomplete
        assert pieces[-1] == char  # then the full character at once
        assert detok.flush() == ""
        found += 1
    assert found >= 3  # the premise holds: these characters really are split


def test_flush_returns_an_incomplete_tail(tok):
    """A stream that stops mid-character: the held-back bytes come out on flush (as U+FFFD)."""
    ids = tok.encode("ok 🐍")
    assert len(ids) >= 3
    detok = tok.detokenizer()
    shown = "".join(detok.add(i) for i in ids[:-1])
    assert shown == "ok"
    tail = detok.flush()
    assert shown + tail == tok.decode(ids[:-1])
    assert tail.startswith(" ") and tail.endswith("\ufffd")
