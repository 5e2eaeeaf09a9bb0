"""Speculative decoding's building blocks against independent references.

``propose_ngram`` against a brute-force search written with plain loops; ``accept_sampled``
against the distribution it must keep (a chi-square test over many seeded trials, which a
wrong acceptance rule is shown to fail); ``accept_greedy`` against hand cases. (The finishing
rules inside an accepted run are the engine's: ``test_speculative_engine.py``.) No model: the whole file runs in about a second.
"""

from __future__ import annotations


import numpy as np
import pytest

from batchlab.core.speculative import accept_greedy, accept_sampled, propose_ngram

# --- propose_ngram ----------------------------------------------------------------------


def brute_force_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Every n, longest first; every start position of an earlier occurrence; the last wins."""
    if k == 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        pattern = tokens[len(tokens) - n :]
        latest = None
        for start in range(len(tokens) - n):  # the occurrence ends at start + n - 1 <= len - 2
            if tokens[start : start + n] == pattern:
                latest = start
        if latest is not None:
            return tokens[latest + n : latest + n + k]
    return []


@pytest.mark.parametrize(
    "k, min_n, max_n", [(1, 1, 1), (3, 1, 4), (5, 2, 3), (4, 3, 5), (0, 1, 4), (8, 1, 2)]
)
def test_propose_ngram_matches_a_brute_force_search(k, min_n, max_n):
    rng = np.random.default_rng(1000 + 100 * k + 10 * min_n + max_n)
    found = 0
    for trial in range(300):
        vocab = (5, 3, 50)[trial % 3]  # mostly small vocabularies, so matches are frequent
        tokens = rng.integers(0, vocab, size=int(rng.integers(0, 40))).tolist()
        want = brute_force_ngram(tokens, k, min_n, max_n)
        got = propose_ngram(tokens, k, min_n, max_n)
        assert got == want, (tokens, k, min_n, max_n)
        assert all(type(t) is int for t in got)
        found += bool(want)
    if k:  # the random lists exercised both outcomes
        assert 30 < found < 290


def test_propose_ngram_hand_cases():
    assert propose_ngram([1, 2, 3, 4], k=3) == []  # 4 never appeared before
    # [7] occurs at 0 and at 4: the most recent (4) is followed by 2, 7
    assert propose_ngram([7, 1, 8, 9, 7, 2, 7], k=2, min_n=1, max_n=1) == [2, 7]
    # [2, 3] occurs at 1 (followed by 9, 5, 3); [3] alone most recently at 5 (followed by 8)
    tokens = [1, 2, 3, 9, 5, 3, 8, 2, 3]
    assert propose_ngram(tokens, k=3, max_n=2) == [9, 5, 3]
    assert propose_ngram(tokens, k=3, max_n=1) == [8, 2, 3]
    assert propose_ngram(tokens, k=3, min_n=3, max_n=4) == []  # no [8, 2, 3] before
    # [1, 2, 1] at 0 is followed by the pattern's own tail; the sequence ends after 2 tokens
    assert propose_ngram([1, 2, 1, 2, 1], k=5) == [2, 1]
    assert propose_ngram([1, 2, 1, 2, 1], k=1) == [2]
    assert propose_ngram([4, 4], k=3) == [4]
    assert propose_ngram([4, 4, 4], k=3, min_n=2, max_n=2) == [4]
    assert propose_ngram(np.array([5, 6, 5]), k=2) == [6, 5]  # numpy input too


def test_propose_ngram_proposes_nothing_when_it_cannot():
    assert propose_ngram([1, 2, 1, 2], k=0) == []
    assert propose_ngram([], k=3) == []
    assert propose_ngram([1], k=3) == []
    assert propose_ngram([1, 1], k=3, min_n=2, max_n=3) == []  # fewer than min_n + 1 tokens


@pytest.mark.parametrize(
    "k, min_n, max_n",
    [(-1, 1, 4), (1.5, 1, 4), (True, 1, 4), (2, 0, 4), (2, 3, 2), (2, 1, "4"), (2, 1.0, 4), (None, 1, 4)],
)
def test_propose_ngram_rejects_bad_arguments(k, min_n, max_n):
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1], k, min_n, max_n)


# --- accept_greedy ----------------------------------------------------------------------


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, 8 is the bonus
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]  # none: the model's own token only
    assert accept_greedy([5, 6, 7], [5, 2, 7, 8]) == [5, 2]  # stops at the first mismatch
    assert accept_greedy([5, 6, 7], [5, 6, 3, 8]) == [5, 6, 3]
    assert accept_greedy([], [9]) == [9]  # no drafts: a plain decode step
    assert accept_greedy(np.array([5, 6]), np.array([5, 6, 4])) == [5, 6, 4]
    assert all(type(t) is int for t in accept_greedy(np.array([5]), np.array([5, 4])))


@pytest.mark.parametrize("drafts, picks", [([5, 6], [5, 6]), ([5, 6], [5, 6, 7, 8]), ([], [])])
def test_accept_greedy_needs_one_pick_per_draft_plus_one(drafts, picks):
    with pytest.raises(ValueError):
        accept_greedy(drafts, picks)
    with pytest.raises(ValueError):
        accept_sampled(drafts, picks)


def test_accept_sampled_hand_cases():
    assert accept_sampled([2, 0], [2, 0, 3]) == [2, 0, 3]
    assert accept_sampled([2, 0], [1, 0, 3]) == [1]
    assert accept_sampled([2, 0], [2, 1, 3]) == [2, 1]


# --- accept_sampled keeps the model's distribution ----------------------------------------

TRIALS = 20_000
P = np.array([0.1, 0.2, 0.3, 0.4])  # the model's distribution at the first position
P2 = np.array([0.45, 0.3, 0.15, 0.1])  # ... and at the next one, given the first draft
DRAFTS = [2, 0]  # fixed drafts: p(2) = 0.3 at the first position, p2(0) = 0.45 at the second
# chi-square critical values at alpha = 0.001 (from tables), by degrees of freedom
CRITICAL = {3: 16.266, 6: 22.458}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def emitted(rule, seed: int = 8, second_from: np.ndarray = P2) -> list[list[int]]:
    """Run ``rule(drafts, draws)`` ``TRIALS`` times. The verify pass samples each position
    from its own distribution: ``P`` for the first, ``second_from`` for the one after the
    first draft, and ``P`` again for the bonus (its value is not tested)."""
    rng = np.random.default_rng(seed)
    firsts = rng.choice(4, size=TRIALS, p=P)
    seconds = rng.choice(4, size=TRIALS, p=second_from)
    bonuses = rng.choice(4, size=TRIALS, p=P)
    return [rule(DRAFTS, [int(a), int(b), int(c)]) for a, b, c in zip(firsts, seconds, bonuses)]


def first_token_chi_square(runs: list[list[int]]) -> float:
    """The first emitted token must follow P (3 degrees of freedom)."""
    return chi_square(np.bincount([run[0] for run in runs], minlength=4), P)


def first_two_chi_square(runs: list[list[int]]) -> float:
    """The outcome of the first two positions, 7 cells: a first token x other than the draft d
    (probability P[x]), or d followed by y (probability P[d] * P2[y]). 6 degrees of freedom."""
    d = DRAFTS[0]
    others = [x for x in range(4) if x != d]
    cells = {(x,): P[x] for x in others} | {(d, y): P[d] * P2[y] for y in range(4)}
    counts = dict.fromkeys(cells, 0)
    for run in runs:
        outcome = tuple(run[:1]) if run[0] != d else tuple(run[:2])
        if outcome not in counts or len(run) > len(DRAFTS) + 1:
            return float("inf")  # a run the model never produces (say the draft, then nothing)
        counts[outcome] += 1
    return chi_square(np.array(list(counts.values())), np.array(list(cells.values())))


def test_accept_sampled_keeps_the_models_distribution():
    runs = emitted(accept_sampled)
    assert first_token_chi_square(runs) < CRITICAL[3]
    assert first_two_chi_square(runs) < CRITICAL[6]
    # the first draft is accepted about P[2] = 30% of the time
    assert abs(np.mean([run[0] == DRAFTS[0] for run in runs]) - P[DRAFTS[0]]) < 0.02


def always_accept(drafts, draws):
    """Wrong: takes every draft, as if the model had agreed."""
    return [int(t) for t in drafts] + [int(draws[-1])]


class RedrawOnRejection:
    """Wrong: on a mismatch it samples again from all of P (the draft included), so the
    draft comes first with probability p(d) + (1 - p(d)) p(d) instead of p(d)."""

    def __init__(self):
        self.rng = np.random.default_rng(99)

    def __call__(self, drafts, draws):
        out = []
        for i, d in enumerate(drafts):
            if draws[i] != d:
                return out + [int(self.rng.choice(4, p=P))]
            out.append(int(d))
        return out + [int(draws[-1])]


@pytest.mark.parametrize("wrong", [always_accept, RedrawOnRejection], ids=["always_accept", "redraw"])
def test_the_check_rejects_a_wrong_acceptance_rule(wrong):
    runs = emitted(wrong if wrong is always_accept else wrong())
    assert first_token_chi_square(runs) > CRITICAL[3]
    assert first_two_chi_square(runs) > CRITICAL[6]


def test_the_joint_check_catches_a_wrong_second_distribution():
    # a verify pass that samples the second position from the first one's distribution
    # (forgetting that it follows the draft): the first token is right, the pair is not
    runs = emitted(accept_sampled, second_from=P)
    assert first_token_chi_square(runs) < CRITICAL[3]
    assert first_two_chi_square(runs) > CRITICAL[6]
