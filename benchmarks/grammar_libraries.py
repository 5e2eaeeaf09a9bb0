"""Which grammar library fills structured output's masks: compile time and mask time of
llguidance, xgrammar and outlines-core on the course model's tokenizer (49,152 tokens).

    .venv/bin/python benchmarks/grammar_libraries.py [--extra DIR]

llguidance is batchlab's dependency. The other two are not (xgrammar needs torch,
transformers and triton on Linux); to compare, install them aside, without their
dependencies, and point ``--extra`` there:

    .venv/bin/pip install --target /tmp/gpk --no-deps xgrammar apache-tvm-ffi outlines-core

A library that is not installed is left out of the table. Each pattern's answer (below) is
fed token by token; a mask is timed before each token: the first (entering the grammar), the
median of the rest at B=1, and the median step of 16 matchers filled one after another (B=16).
Results of a run: ``docs/results/grammar_libraries.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CASES = {  # name: (kind, pattern, an answer that matches it)
    "json schema": (
        "json",
        SCHEMA,
        '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}',
    ),
    "regex .{0,200}": (
        "regex",
        r".{0,200}",
        "The quick brown fox jumps over the lazy dog, then runs into the forest and sleeps.",
    ),
}
REPS = 5


def timed(make, fill, advance, ids, batch):
    """(first mask, median mask after it) in seconds, over ``REPS`` runs of ``batch`` matchers."""
    first, rest = [], []
    for _ in range(REPS):
        matchers = [make() for _ in range(batch)]
        for j, token in enumerate(ids):
            start = time.perf_counter()
            fill(matchers)
            (first if j == 0 else rest).append(time.perf_counter() - start)
            for m in matchers:
                advance(m, token)
    return statistics.median(first), statistics.median(rest)


def llguidance_case(tok, kind, pattern):
    import llguidance
    import llguidance.numpy as lln

    ll = llguidance.LLTokenizer(
        tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids)
    )
    m = llguidance.LLMatcher
    grammar = m.grammar_from_json_schema(pattern) if kind == "json" else m.grammar_from_regex(pattern)
    start = time.perf_counter()
    m(ll, grammar)
    compile_s = time.perf_counter() - start
    bits = lln.allocate_token_bitmask(16, tok.vocab_size)

    def fill(ms):
        for i, x in enumerate(ms):
            lln.fill_next_token_bitmask(x, bits, i)

    return compile_s, (lambda: m(ll, grammar)), fill, lambda x, t: x.consume_token(t)


def xgrammar_case(tok, kind, pattern):
    import xgrammar as xgr

    vocab = [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(
        vocab,
        vocab_type=xgr.VocabType.BYTE_LEVEL,
        vocab_size=tok.vocab_size,
        stop_token_ids=sorted(tok.eos_token_ids),
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    compiled = (
        compiler.compile_json_schema(json.dumps(pattern))
        if kind == "json"
        else compiler.compile_regex(pattern)
    )
    compile_s = time.perf_counter() - start
    bits = xgr.allocate_token_bitmask(16, tok.vocab_size)

    def fill(ms):
        for i, x in enumerate(ms):
            x.fill_next_token_bitmask(bits, i)

    return compile_s, (lambda: xgr.GrammarMatcher(compiled)), fill, lambda x, t: x.accept_token(t)


def byte_level_vocabulary(tok) -> dict[bytes, list[int]]:
    """Every token's bytes (GPT-2's byte-to-character table undone), as outlines-core takes them."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = kept[:]
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + len(chars) - 188)
    to_byte = {chr(c): b for b, c in zip(kept, chars)}
    vocab: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i not in tok.eos_token_ids:
            s = tok.backend.id_to_token(i)
            key = bytes(to_byte[c] for c in s) if all(c in to_byte for c in s) else s.encode()
            vocab.setdefault(key, []).append(i)
    return vocab


def outlines_core_case(tok, kind, pattern):
    import outlines_core as oc

    vocab = oc.Vocabulary(min(tok.eos_token_ids), byte_level_vocabulary(tok))
    start = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(pattern)) if kind == "json" else pattern
    index = oc.Index(regex, vocab)
    compile_s = time.perf_counter() - start

    def fill(ms):
        for x in ms:
            x.get_tokens()

    return compile_s, (lambda: oc.Guide(index)), fill, lambda x, t: x.advance(t)


LIBRARIES = {"llguidance": llguidance_case, "xgrammar": xgrammar_case, "outlines-core": outlines_core_case}


def main(argv=None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", help="a folder the other libraries were installed into")
    args = parser.parse_args(argv)
    if args.extra:
        sys.path.insert(0, args.extra)
    from batchlab.model.load import load_tokenizer

    tok = load_tokenizer()
    rows = []
    for lib, case in LIBRARIES.items():
        for name, (kind, pattern, answer) in CASES.items():
            try:
                compile_s, make, fill, advance = case(tok, kind, pattern)
            except ImportError as e:
                print(f"{lib}: not installed ({e})")
                break
            ids = tok.encode(answer)
            b1, b16 = timed(make, fill, advance, ids, 1), timed(make, fill, advance, ids, 16)
            rows.append((lib, name, compile_s, b1[0], b1[1], b16[1]))
    print(
        "| library | pattern | compile (ms) | first mask, B=1 (ms) | a mask after, B=1 (ms) | 16 masks of a step, B=16 (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for lib, name, c, first, after, step in rows:
        print(
            f"| {lib} | {name} | {c * 1e3:.1f} | {first * 1e3:.3f} | {after * 1e3:.3f} | {step * 1e3:.2f} |"
        )
    return rows


if __name__ == "__main__":
    main()
