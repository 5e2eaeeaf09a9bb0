"""A fake model for instant tests and exercise checkers of scheduling logic.

It is NOT a language model: the next token is a fixed hash of the whole sequence so
far, so the right output of any request is known without MLX (this module imports
none). The fake runner also checks the engine's bookkeeping: it reads each request's
context through the block table its chunk carries, from a pool of KV positions, like
the real runner, so the answer is right only if the block tables, chunks and shared
(prefix-cached) blocks are right.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from .runner import Chunk, Runner, sample_rows


def sequence_hash(sequence: list[int]) -> int:
    """A fixed hash of a token sequence (the fake model's, before it is cut to the vocabulary)."""
    return zlib.crc32(np.asarray(sequence, dtype=np.int64).tobytes())


def next_token(sequence: list[int], vocab_size: int) -> int:
    """The fake model's deterministic choice after ``sequence`` (prompt + outputs)."""
    return sequence_hash(sequence) % vocab_size


def reference_output(
    prompt: list[int], max_new_tokens: int, vocab_size: int, eos_ids: frozenset[int]
) -> list[int]:
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
    # a real tokenizer (structured output needs token strings): its vocabulary and EOS ids
    # replace the two above
    text: object = None

    def __post_init__(self):
        if self.text is not None:
            self.vocab_size, self.eos_id = self.text.vocab_size, min(self.text.eos_token_ids)

    @property
    def tokenizer(self):
        if self.text is not None:
            return self.text
        return SimpleNamespace(vocab_size=self.vocab_size, eos_token_ids=frozenset({self.eos_id}))

    @property
    def default_runner(self) -> type:
        """``make_engine`` with no ``runner`` runs a fake model on ``FakeRunner``."""
        return FakeRunner


class FakeRunner(Runner):
    """Drop-in for ``ModelRunner``: ``make_engine(..., runner=FakeRunner)``.

    Like the real runner it keeps its "KV cache" in a pool of positions, here the token
    each one holds, and reads a request's context only through its chunk's block table.
    So a chunk that skips positions, or a block table that points at someone else's
    tokens, gives a wrong answer or an error.
    """

    def __init__(self, lm: FakeModel, num_blocks: int, block_size: int):
        self.lm, self.block_size = lm, block_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)  # -1: never written
        self.passes: list[list[Chunk]] = []

    def forward(self, chunks: list[Chunk], head_rows: list[int] | None = None) -> np.ndarray:
        """Write every chunk's tokens into the pool; return the logits after the last
        ``chunk.head`` positions (one, or 1 + k for a verify row) of the chunks in
        ``head_rows`` (None: all), stacked: ``logits_row`` of each prefix, in that order."""
        self.passes.append(chunks)
        seqs = [self._write(chunk) for chunk in chunks]
        heads = range(len(chunks)) if head_rows is None else head_rows
        prefixes = [
            seqs[i][:cut] for i in heads for cut in range(len(seqs[i]) - chunks[i].head + 1, len(seqs[i]) + 1)
        ]
        return np.array([self.logits_row(p) for p in prefixes], dtype=np.float32).reshape(
            len(prefixes), self.lm.vocab_size
        )

    def _write(self, chunk: Chunk) -> list[int]:
        """Store ``chunk``'s tokens at its KV addresses; return its whole sequence so far, read
        through its block table (a gap before it is an error)."""
        context = self.kv[chunk.kv_addresses(0, chunk.start, self.block_size)]
        if (context < 0).any():
            raise AssertionError(
                f"{chunk.req_id}: chunk starts at {chunk.start} but the "
                f"cache has never-written positions before it (a gap)"
            )
        self.kv[chunk.kv_addresses(chunk.start, chunk.end, self.block_size)] = chunk.tokens
        return context.tolist() + list(chunk.tokens)

    def logits_row(self, sequence: list[int]) -> np.ndarray:
        """The logits after ``sequence``: all weight on ``choose(sequence)``."""
        row = np.full(self.lm.vocab_size, -1e9, dtype=np.float32)
        row[self.choose(sequence)] = 0.0
        return row

    def choose(self, sequence: list[int]) -> int:
        """The fake model's token after ``sequence`` (a test's runner may choose otherwise)."""
        return next_token(sequence, self.lm.vocab_size)

    def sample(self, logits: np.ndarray, rows: list[int], samplers) -> list[int]:
        return sample_rows(logits[rows], samplers)


# Models for speculative decoding: the fake model is a hash, so it never repeats its prompt and
# prompt lookup's drafts are rejected. These repeat it (drafts accepted) or contradict it (every
# draft rejected); ``greedy_output`` is the right answer on any of them, with no engine.

PERIOD = 5  # the echo runners repeat the token this many places back


class EchoRunner(FakeRunner):
    """A model that echoes: the token ``PERIOD`` places back, except after one sequence in
    four (by a hash of it), where it takes the fake model's own token."""

    def choose(self, sequence):
        if len(sequence) >= PERIOD and sequence_hash(sequence) % 4:
            return sequence[-PERIOD]
        return next_token(sequence, self.lm.vocab_size)


class PureEchoRunner(FakeRunner):
    """A model that always repeats the token ``PERIOD`` places back: on a prompt whose every
    ``PERIOD`` consecutive tokens differ, prompt lookup always proposes what it will say."""

    def choose(self, sequence):
        return sequence[-PERIOD] if len(sequence) >= PERIOD else next_token(sequence, self.lm.vocab_size)


class ContrarianRunner(FakeRunner):
    """A model that never says a token prompt lookup could propose first: none of the tokens
    that followed an earlier occurrence of the last token (any n-gram's occurrence ends with
    one of those), so every draft of any proposer is rejected. Otherwise the fake model's token
    (the next one up while that is such a follower)."""

    def choose(self, sequence):
        last = sequence[-1]
        followers = {sequence[i] for i in range(1, len(sequence)) if sequence[i - 1] == last}
        token = next_token(sequence, self.lm.vocab_size)
        while token in followers:
            token = (token + 1) % self.lm.vocab_size
        return token


class AdversarialRunner(FakeRunner):
    """For structured output: a model that wants to break every pattern. Its logits are random
    (fixed by a hash of the sequence), so its favourite token is almost never one a constraint
    allows, and every EOS id is its favourite of all (an answer ends as soon as its mask lets
    it). Greedy, it says ``choose``: the argmax."""

    def logits_row(self, sequence: list[int]) -> np.ndarray:
        row = (
            np.random.default_rng(sequence_hash(sequence))
            .standard_normal(self.lm.vocab_size)
            .astype(np.float32)
        )
        row[list(self.lm.tokenizer.eos_token_ids)] = 10.0
        return row

    def choose(self, sequence: list[int]) -> int:
        return int(np.argmax(self.logits_row(sequence)))


def greedy_output(
    runner: type[FakeRunner], prompt: list[int], max_new_tokens: int, eos_ids: frozenset[int], lm=None
) -> list[int]:
    """``reference_output`` on the model of a test runner (its ``choose``): one greedy request,
    one token at a time, no engine."""
    choose = runner(lm or FakeModel(), 1, 1).choose
    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        token = choose(seq)
        out.append(token)
        seq.append(token)
        if token in eos_ids:
            break
    return out


class TickClock:
    """A clock for fake runs, which take no time: every reading is one "second" later, so
    timestamps still come out in order."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t
