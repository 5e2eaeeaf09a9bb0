"""The runner's interface (pure Python, no MLX): what the engine asks of whatever runs
the forward passes, and the ``Chunk`` it hands over.

``Model`` is what the engine needs to know of a model (its vocabulary, EOS ids, context
length, and what runs it): a ``model.load.LoadedModel`` or a ``fake.FakeModel``.

``Chunk`` is the runner's word for a pass: which *tokens* run, at which positions, and
where their keys and values live (the request's block table). ``Runner`` is what every
runner provides: the real one (``model_runner.ModelRunner``, MLX), the fake model's
(``fake.FakeRunner``) and the simulator's (``simulator.SimRunner``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from .sampling import Sampler


class Model(Protocol):
    """What the engine reads of a model. ``tokenizer`` has ``vocab_size`` and
    ``eos_token_ids``; ``default_runner(model, num_blocks, block_size)`` builds the runner
    used when ``make_engine`` is given none (so the core never imports the MLX side)."""

    tokenizer: object
    max_seq_len: int
    default_runner: type


@dataclass(frozen=True)
class Chunk:
    """Consecutive tokens of one sequence for the runner: one token for a decode row,
    several for a prefill chunk. ``sampler`` is set when the chunk's last position
    yields the sequence's next token (a decode row, or the chunk that ends a prefill)."""

    req_id: str
    tokens: list[int]
    start: int  # position of tokens[0] in its sequence (= tokens already in the KV cache)
    block_table: list[int] = field(default_factory=list)  # KV blocks of positions 0, bs, 2bs, ...
    sampler: Sampler | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def kv_addresses(self, start: int, stop: int, block_size: int) -> np.ndarray:
        """Flat KV-pool addresses of positions ``start..stop-1`` (vLLM calls this the slot mapping):
        position ``i`` lives in block ``block_table[i // block_size]`` at ``i % block_size``."""
        if stop > len(self.block_table) * block_size:
            raise IndexError(
                f"{self.req_id}: positions up to {stop} need more KV blocks than "
                f"its table holds ({len(self.block_table)} of {block_size} tokens)"
            )
        table = np.asarray(self.block_table, dtype=np.int32)
        positions = np.arange(start, stop, dtype=np.int32)
        return table[positions // block_size] * block_size + positions % block_size


class Runner:
    """Runs chunks as one forward pass. Subclasses give ``forward`` (logits of each chunk's
    last position, [len(chunks), vocab]) and ``sample`` (tokens from some of those rows)."""

    def forward(self, chunks: list[Chunk]):
        raise NotImplementedError

    def sample(self, logits, rows: list[int], samplers: list[Sampler]) -> list[int]:
        raise NotImplementedError

    def run(self, chunks: list[Chunk]) -> list[int | None]:
        """One pass; the next token of every chunk that has a sampler, None for the others."""
        logits = self.forward(chunks)
        rows = [i for i, c in enumerate(chunks) if c.sampler is not None]
        tokens: list[int | None] = [None] * len(chunks)
        if rows:
            for i, token in zip(rows, self.sample(logits, rows, [chunks[i].sampler for i in rows])):
                tokens[i] = token
        return tokens
