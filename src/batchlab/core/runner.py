"""The runner's interface (pure Python, no MLX): what the engine asks of whatever runs
the forward passes, the ``Chunk`` it hands over, and the picking of one token a row that
the real and fake runners share (``sample_rows``).

``Model`` is what the engine needs to know of a model (its vocabulary, EOS ids, context
length, and what runs it): a ``model.load.LoadedModel`` or a ``fake.FakeModel``.

``Chunk`` is the runner's word for a pass: which *tokens* run, at which positions, and
where their keys and values live (the request's block table). ``Runner`` is what every
runner provides: the real one (``model_runner.ModelRunner``, MLX), the fake model's
(``fake.FakeRunner``) and the simulator's (``simulator.SimRunner``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from .request import Sampler


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
    yields the sequence's next token (a decode row, or the chunk that ends a prefill).

    A *verify row* (speculative decoding) is a decode row with drafts: ``[last, d1..dk]``
    at ``start = num_computed``, its last ``num_drafts`` tokens guesses. The runner then
    samples at each of its last ``1 + num_drafts`` positions (``head``): the model's own
    pick after the context, after ``d1``, ..., after ``dk``."""

    req_id: str
    tokens: list[int]
    start: int  # position of tokens[0] in its sequence (= tokens already in the KV cache)
    block_table: list[int] = field(default_factory=list)  # KV blocks of positions 0, bs, 2bs, ...
    sampler: Sampler | None = None
    num_drafts: int = 0  # the last num_drafts tokens are drafts to verify

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def head(self) -> int:
        """Positions (the chunk's last ones) whose next-token distribution the pass needs."""
        return 1 + self.num_drafts

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
    """Runs chunks as one forward pass. Subclasses give ``forward`` and ``sample``.

    ``forward(chunks, head_rows)`` runs every chunk (each writes its keys and values) and
    returns the logits of the last ``chunk.head`` positions of the chunks listed in
    ``head_rows`` (indices into ``chunks``; None: all of them), in that order, stacked:
    ``[sum of their heads, vocab]``. A prefill chunk in the middle of its prompt needs no
    logits, so ``run`` lists only the chunks that sample and the LM head skips the rest.
    ``sample(logits, rows, samplers)`` draws one token from each of ``rows`` of those logits."""

    def forward(self, chunks: list[Chunk], head_rows: list[int] | None = None):
        raise NotImplementedError

    def sample(self, logits, rows: list[int], samplers: list[Sampler]) -> list[int]:
        raise NotImplementedError

    def run(self, chunks: list[Chunk], meanwhile=None) -> list[int | list[int] | None]:
        """One pass; the next token of every chunk that has a sampler (for a verify row, the
        list of its ``1 + num_drafts`` picks), None for the others. ``meanwhile`` (a function of
        no arguments) runs in a second thread while the model computes, and is done before any
        row samples: structured output's masks can be filled there (``EngineBase.constrain``)."""
        heads = [i for i, c in enumerate(chunks) if c.sampler is not None]
        if meanwhile is None:
            logits = self.forward(chunks, head_rows=heads)  # [sum of their heads, vocab]
        else:
            if getattr(self, "_beside", None) is None:
                self._beside = ThreadPoolExecutor(1, thread_name_prefix="beside-the-pass")
            job = self._beside.submit(meanwhile)
            try:
                logits = self.forward(chunks, head_rows=heads)
            finally:
                job.result()  # its error, if it raised, is the pass's
        sampling = [chunks[i] for i in heads]
        firsts = np.cumsum([0] + [c.head for c in sampling])[:-1].tolist()  # each one's first logits row
        rows, samplers = rows_to_sample(sampling, firsts)
        picks = picks_by_chunk(sampling, self.sample(logits, rows, samplers) if rows else [])
        tokens: list[int | list[int] | None] = [None] * len(chunks)
        for i, pick in zip(heads, picks):
            tokens[i] = pick
        return tokens


def rows_to_sample(chunks: list[Chunk], firsts: list[int]) -> tuple[list[int], list[Sampler]]:
    """The logits rows to sample (chunk i's heads start at row ``firsts[i]``) and the sampler
    of each: every head position of every chunk that samples, in order. A verify row's
    positions follow each other, so its own sampler draws them in position order."""
    rows: list[int] = []
    samplers: list[Sampler] = []
    for c, first in zip(chunks, firsts):
        if c.sampler is not None:
            rows += range(first, first + c.head)
            samplers += [c.sampler] * c.head
    return rows, samplers


def picks_by_chunk(chunks: list[Chunk], picks: list[int]) -> list[int | list[int] | None]:
    """The sampled ``picks`` (in ``rows_to_sample`` order) handed back per chunk: an int for a
    plain sampling chunk, a list of ``1 + num_drafts`` for a verify row, None if it samples not."""
    out: list[int | list[int] | None] = []
    at = 0
    for c in chunks:
        if c.sampler is None:
            out.append(None)
            continue
        mine = [int(t) for t in picks[at : at + c.head]]
        at += c.head
        out.append(mine if c.num_drafts else mine[0])
    return out


def sample_rows(logits: np.ndarray, samplers: list[Sampler]) -> list[int]:
    """One token per row of ``logits`` [N, vocab]: argmax for greedy rows, the row's own
    sampler for the others; a row's ruled-out ids (``Sampler.restrict``) get no weight."""
    picks = np.argmax(logits, axis=-1).tolist()
    for i, s in enumerate(samplers):
        row = logits[i]
        if s.restricted:
            row = s.restrict(row)
            picks[i] = int(np.argmax(row))
        if not s.params.greedy:
            picks[i] = s.sample(row)
    return picks
