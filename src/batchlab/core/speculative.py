"""Speculative decoding by prompt lookup: guess a few tokens cheaply, let the model check them.

A decode step makes one token per request. If we could *guess* the next few tokens, one
forward pass over ``[last token, guess 1, ..., guess k]`` (a small prefill chunk) gives the
model's own pick at every one of those k + 1 positions, and every guess the model agrees
with is a token we got without a step of its own. Here the guesses come from the request
itself, as vLLM's "ngram" method does: find where the sequence's last few tokens appeared
before and propose what followed them there (answers quote their prompts, code repeats
names, lists repeat their shape). No second model, no training: just a search.

Three building blocks, pure numpy (the scheduler and the lessons import this without MLX):

- ``propose_ngram``: the guesses (the *drafts*) for one request;
- ``accept_greedy`` / ``accept_sampled``: which drafts the model's verify pass keeps, plus
  the one token the model always contributes.

Where an accepted run must stop (EOS, a stop token, max_new_tokens, max_seq_len) is not
decided here: the engine hands the run's tokens out one at a time through the scheduler's own
``finish_reason`` and stops at the first that finishes (``Scheduler.postprocess``), so every
finishing rule, a learner's included, applies inside a run as it does to one token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .request import is_int


def _check_int(name: str, value, lowest: int) -> None:
    if not (is_int(value) or isinstance(value, np.integer)) or value < lowest:
        raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")


def propose_ngram(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to ``k`` draft tokens for a request whose prompt plus output so far is ``tokens``.

    For n from ``max_n`` down to ``min_n`` (the longest pattern first, since a longer match
    is better evidence): the pattern is the last n tokens; look for its most recent earlier
    occurrence (one that ends before the last position, so not the pattern itself) and
    propose the up to k tokens that followed it there. They may run into the pattern itself
    (in ``a b a b a`` the pattern ``a b a`` appeared at the start, so the proposal is
    ``b a``, the pattern's own tail), and there are fewer than k when the sequence ends first. The first n that matches wins; no match
    (or ``k == 0``, or fewer than ``min_n + 1`` tokens) proposes nothing.

    Each n is one numpy comparison of every window of n tokens with the pattern, about
    ``len(tokens) * n`` element checks: a fraction of a millisecond for 2,000 tokens.
    """
    _check_int("k", k, 0)
    _check_int("min_n", min_n, 1)
    _check_int("max_n", max_n, 1)
    if min_n > max_n:
        raise ValueError(f"min_n must be <= max_n, got min_n={min_n} and max_n={max_n}")
    seq = np.asarray(tokens, dtype=np.int64)
    if k == 0 or seq.size < min_n + 1:
        return []
    # an occurrence of n tokens must end before the last position: n <= len - 1
    for n in range(min(max_n, seq.size - 1), min_n - 1, -1):
        pattern = seq[-n:]
        windows = sliding_window_view(seq[:-1], n)  # windows[s] = seq[s : s + n], ending before the last
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n  # the most recent occurrence; what came after it
            return seq[follow : follow + k].tolist()
    return []


def _accept(drafts: Sequence[int], model_tokens: Sequence[int]) -> list[int]:
    """The drafts up to the first one the model disagrees with, then the model's own token."""
    if len(model_tokens) != len(drafts) + 1:
        raise ValueError(
            f"the verify pass gives one model token per draft plus one: expected "
            f"{len(drafts) + 1}, got {len(model_tokens)}"
        )
    kept: list[int] = []
    for draft, mine in zip(drafts, model_tokens):
        if draft != mine:
            break
        kept.append(int(draft))
    # the model's token at the first mismatch (a correction), or after the last draft (a bonus)
    kept.append(int(model_tokens[len(kept)]))
    return kept


def accept_greedy(drafts: Sequence[int], picks: Sequence[int]) -> list[int]:
    """The tokens one verify pass adds to a greedy request.

    ``picks[i]`` is the model's greedy (argmax) token after the context plus ``drafts[:i]``;
    there are ``len(drafts) + 1`` of them. A draft counts only if the model would have
    picked it itself, and everything after a wrong draft was computed on a wrong context,
    so we keep the longest prefix with ``drafts[i] == picks[i]``, then the model's token at
    the first mismatch (its correction), or ``picks[-1]`` if every draft matched (a bonus).
    The output is exactly what plain greedy decoding would produce, 1 to ``len(drafts) + 1``
    tokens at a time.
    """
    return _accept(drafts, picks)


def accept_sampled(drafts: Sequence[int], draws: Sequence[int]) -> list[int]:
    """The tokens one verify pass adds to a sampled (temperature > 0) request.

    ``draws[i]`` is a token the model *sampled* at position i, from its distribution p_i
    given the context plus ``drafts[:i]``, with the request's own sampler. Keep drafts
    while ``draws[i] == drafts[i]``; at the first mismatch j emit ``draws[j]`` and stop (or
    emit the bonus ``draws[-1]`` if every draft matched). The same rule as
    ``accept_greedy``, with samples in place of argmaxes.

    Why the output still follows the model's distribution exactly: standard speculative
    sampling accepts a draft d proposed with probability q(d) with probability
    min(1, p(d) / q(d)), and on rejection samples from norm(max(0, p - q)). Our draft is one
    fixed token, a point mass q = δ_d, so d is accepted with probability min(1, p(d)) = p(d),
    and on rejection the residual max(0, p - δ_d) is p with d's share removed: p restricted
    to the tokens other than d, renormalised. Drawing x ~ p and keeping d when x == d, else
    emitting x, does the same: P(emit d) = p(d), and given x != d, x follows p restricted to
    the other tokens. So every emitted token has exactly the distribution p_i plain decoding
    would have used, and the next position's draw is conditioned on the right context.
    """
    return _accept(drafts, draws)
