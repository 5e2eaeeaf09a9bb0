"""A fake model for instant tests and exercise checkers of scheduling logic.

It is NOT a language model: the next token is a fixed hash of the whole sequence so
far, so the right output of any request is known without MLX. The fake runner also
checks the engine's bookkeeping: every chunk must continue its sequence exactly where
the KV cache ends (or rewrite identical tokens, as a static padding row does), and
only KV slots the block manager handed out may be written.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from .kv import BlockManager
from .runner import Chunk


def next_token(sequence: list[int], vocab_size: int) -> int:
    """The fake model's deterministic choice after ``sequence`` (prompt + outputs)."""
    return zlib.crc32(np.asarray(sequence, dtype=np.int64).tobytes()) % vocab_size


def reference_output(prompt: list[int], max_new_tokens: int, vocab_size: int,
                     eos_ids: frozenset[int]) -> list[int]:
    """What a correct engine must produce for one greedy request on the fake model."""
    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        token = next_token(seq, vocab_size)
        out.append(token)
        seq.append(token)
        if token in eos_ids:
            break
    return out


@dataclass
class FakeModel:
    """Stands where a ``LoadedModel`` goes (tokenizer facts and limits only)."""

    vocab_size: int = 64
    eos_id: int = 0
    max_seq_len: int = 4096

    @property
    def tokenizer(self):
        return SimpleNamespace(vocab_size=self.vocab_size, eos_token_ids=frozenset({self.eos_id}))


class FakeRunner:
    """Drop-in for ``ModelRunner``: ``make_engine(..., executor=FakeRunner)``."""

    def __init__(self, lm: FakeModel, blocks: BlockManager):
        self.lm, self.blocks = lm, blocks
        self.sequences: dict[str, list[int]] = {}  # what each request's "KV cache" holds
        self.passes: list[list[Chunk]] = []

    def forward(self, chunks: list[Chunk]) -> mx.array:
        self.passes.append(chunks)
        logits = np.full((len(chunks), self.lm.vocab_size), -1e9, dtype=np.float32)
        for row, chunk in enumerate(chunks):
            seq = self.sequences.setdefault(chunk.req_id, [])
            end = chunk.start + len(chunk.tokens)
            self.blocks.slots(chunk.req_id, chunk.start, end)  # raises if blocks are missing
            if chunk.start < len(seq):  # rewriting positions already cached
                if end > len(seq) or seq[chunk.start:end] != list(chunk.tokens):
                    raise AssertionError(f"{chunk.req_id}: chunk at {chunk.start} rewrites "
                                         f"different tokens")
            elif chunk.start == len(seq):
                seq.extend(chunk.tokens)
            else:
                raise AssertionError(f"{chunk.req_id}: chunk starts at {chunk.start} but the "
                                     f"cache holds {len(seq)} tokens (a gap)")
            logits[row, next_token(seq[:end], self.lm.vocab_size)] = 0.0
        return mx.array(logits)
