"""A fake model for instant tests and exercise checkers of scheduling logic.

It is NOT a language model: the next token is a fixed hash of the whole sequence so
far, so the right output of any request is known without MLX. The fake runner also
checks the engine's bookkeeping: it reads each request's context through its block
table from a pool of slots, like the real runner, so the answer is right only if the
block tables, chunks and shared (prefix-cached) blocks are right.
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
    """Drop-in for ``ModelRunner``: ``make_engine(..., executor=FakeRunner)``.

    Like the real runner it keeps its "KV cache" in a pool of slots, here the token each
    slot holds, and reads a request's context only through its block table. So a chunk
    that skips positions, a block table that points at someone else's tokens, or a
    write into a block shared with another request gives a wrong answer or an error.
    """

    def __init__(self, lm: FakeModel, blocks: BlockManager):
        self.lm, self.blocks = lm, blocks
        self.kv = np.full(blocks.num_blocks * blocks.block_size, -1, dtype=np.int64)  # -1: never written
        self.passes: list[list[Chunk]] = []

    def forward(self, chunks: list[Chunk]) -> mx.array:
        self.passes.append(chunks)
        logits = np.full((len(chunks), self.lm.vocab_size), -1e9, dtype=np.float32)
        for row, chunk in enumerate(chunks):
            end = chunk.start + len(chunk.tokens)
            writes = self.blocks.slots(chunk.req_id, chunk.start, end)  # raises if blocks are missing
            shared = [b for b in set((writes // self.blocks.block_size).tolist())
                      if self.blocks.ref_counts[b] > 1]
            if shared and (self.kv[writes] != chunk.tokens).any():
                raise AssertionError(f"{chunk.req_id}: chunk at {chunk.start} overwrites shared "
                                     f"KV block(s) {shared}")
            context = self.kv[self.blocks.slots(chunk.req_id, 0, chunk.start)]
            if (context < 0).any():
                raise AssertionError(f"{chunk.req_id}: chunk starts at {chunk.start} but the "
                                     f"cache has never-written positions before it (a gap)")
            self.kv[writes] = chunk.tokens
            logits[row, next_token(context.tolist() + list(chunk.tokens), self.lm.vocab_size)] = 0.0
        return mx.array(logits)


class TickClock:
    """A clock for fake runs, which take no time: every reading is one "second" later, so
    timestamps still come out in order."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t
