"""The sampler against an independent reference: a few lines of numpy that write down what
temperature, top-k and top-p mean, and a chi-square test over many seeded draws. An
off-by-one in the top-k or top-p cut moves a token in or out of the support, which either
draws a token the reference never would or starves one it needs: both fail by far. At the
end, ``SamplingParams``' own checks of every per-request parameter."""

from __future__ import annotations

import re

import numpy as np
import pytest

from batchlab.core.request import Sampler, SamplingParams
from batchlab.core.runner import sample_rows

DRAWS = 20_000
LOGITS = np.array([2.0, 1.2, 3.1, -0.5, 0.7, 2.6, 0.1, 1.9, -2.0, 1.5], dtype=np.float32)


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Softmax of logits / temperature; keep the k most likely; then the smallest set of the
    most likely whose probability reaches top_p; renormalise."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[:top_k] if top_k else order
    q = np.zeros_like(p)
    q[keep] = p[keep] / p[keep].sum()
    cumulative = np.cumsum(q[keep])
    kept = keep[: int(np.argmax(cumulative >= top_p - 1e-12)) + 1]
    out = np.zeros_like(p)
    out[kept] = q[kept] / q[kept].sum()
    return out


def disagreement(draw, logits, temperature, top_k, top_p) -> str | None:
    """None if ``DRAWS`` samples of ``draw()`` follow the reference distribution, else what
    is wrong: a token outside its support, or a chi-square far beyond chance (p < 1e-6)."""
    want = reference_distribution(logits.astype(np.float64), temperature, top_k, top_p)
    counts = np.bincount([draw() for _ in range(DRAWS)], minlength=logits.size)
    outside = [int(t) for t in np.flatnonzero((want == 0) & (counts > 0))]
    if outside:
        return f"drew tokens {outside}, which the reference gives no probability"
    support = want > 0
    expected = want[support] * DRAWS
    chi2 = float((((counts[support] - expected) ** 2) / expected).sum())
    dof = int(support.sum()) - 1
    if dof and chi2 > dof + 12 * np.sqrt(2 * dof) + 30:  # far beyond chance (about p < 1e-6 here)
        return f"chi-square {chi2:.1f} over {dof} degrees of freedom: not the reference's distribution"
    return None


CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.8), (0.9, 6, 0.7), (1.0, 3, 0.95)]


@pytest.mark.parametrize("temperature, top_k, top_p", CASES)
def test_the_sampler_draws_the_reference_distribution(temperature, top_k, top_p):
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=11))
    assert disagreement(lambda: sampler.sample(LOGITS), LOGITS, temperature, top_k, top_p) is None


class OffByOneTopP(Sampler):
    """Keeps one token fewer than the top-p set: the mistake the reference must catch."""

    def sample(self, logits):
        p = self.params
        scaled = logits.astype(np.float64) / p.temperature
        order = np.argsort(-scaled, kind="stable")
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        keep = max(1, int(np.searchsorted(np.cumsum(probs), p.top_p)))  # should be + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(order.size, p=probs)])


class OffByOneTopK(Sampler):
    """Keeps k + 1 tokens."""

    def sample(self, logits):
        inner = Sampler(SamplingParams(self.params.temperature, self.params.top_p, self.params.top_k + 1))
        inner.rng = self.rng
        return inner.sample(logits)


@pytest.mark.parametrize("wrong, case", [(OffByOneTopP, (1.0, 0, 0.8)), (OffByOneTopK, (1.3, 4, 1.0))])
def test_the_reference_catches_an_off_by_one_cut(wrong, case):
    temperature, top_k, top_p = case
    sampler = wrong(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=11))
    assert disagreement(lambda: sampler.sample(LOGITS), LOGITS, *case) is not None


# Structured output: a row's mask rules tokens out *before* temperature, top-k and top-p (as
# vLLM applies its grammar bitmask to the logits first), so top-k keeps the k most likely
# *allowed* tokens. The reference writes that down: the masked-out logits are -inf.
MASK = np.array([True, False, False, True, True, False, True, True, False, True])


def masked_draw(sampler):
    sampler.allowed = MASK
    return lambda: sample_rows(LOGITS[None], [sampler])[0]


@pytest.mark.parametrize("temperature, top_k, top_p", CASES)
def test_a_masked_row_draws_the_reference_distribution_over_its_allowed_tokens(temperature, top_k, top_p):
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=5))
    masked = np.where(MASK, LOGITS, -np.inf)
    assert disagreement(masked_draw(sampler), masked, temperature, top_k, top_p) is None


def test_a_greedy_masked_row_takes_the_best_allowed_token():
    sampler = Sampler(SamplingParams())
    best_allowed = int(np.argmax(np.where(MASK, LOGITS, -np.inf)))
    assert best_allowed != int(np.argmax(LOGITS))  # the case means something
    assert masked_draw(sampler)() == best_allowed


class MaskAfterTopK(Sampler):
    """Cuts to the top k first and masks afterwards: the mistake the reference must catch."""

    def restrict(self, logits):  # leaves the mask to ``sample``
        return logits.astype(np.float32, copy=True)

    def sample(self, logits):
        keep = np.argsort(-logits)[: self.params.top_k]
        cut = np.full_like(logits, -np.inf)
        cut[keep] = logits[keep]
        cut[~MASK] = -np.inf
        if not np.isfinite(cut).any():
            cut = np.where(MASK, logits, -np.inf)
        return Sampler.sample(self, cut)


def test_the_reference_catches_a_mask_applied_after_the_top_k_cut():
    sampler = MaskAfterTopK(SamplingParams(temperature=1.0, top_k=4, seed=5))
    masked = np.where(MASK, LOGITS, -np.inf)
    assert disagreement(masked_draw(sampler), masked, 1.0, 4, 1.0) is not None


# -- SamplingParams: every per-request generation parameter, checked where it is made ----------


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"max_new_tokens": 2.0}, "max_new_tokens must be an integer >= 1"),
        ({"min_new_tokens": -1}, "min_new_tokens must be an integer >= 0"),
        ({"min_new_tokens": True}, "min_new_tokens must be an integer >= 0"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be token ids >= 0"),
        ({"stop_token_ids": [3, "4"]}, "stop_token_ids must be token ids >= 0"),
        ({"stop_token_ids": 7}, "stop_token_ids must be a list of token ids"),
        (
            {"structured_outputs": {"regex": "[0-9]+"}, "ignore_eos": True},
            "a constrained request ends at EOS once its answer is complete: it cannot ignore_eos",
        ),
        ({"structured_outputs": {"grammar": "x"}}, "structured_outputs takes json, regex, choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"structured_outputs": "[0-9]+"}, "structured_outputs must be a StructuredOutputs or a dict"),
        ({"temperature": -0.5}, "temperature must be a number >= 0"),
    ],
)
def test_sampling_params_refuse_each_bad_value_with_a_value_error(bad, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        SamplingParams(**bad)


def test_sampling_params_keep_their_first_four_fields_in_place_and_store_tuples():
    from batchlab.core.structured import StructuredOutputs

    params = SamplingParams(0.7, 0.9, 5, 11, stop_token_ids=[3, 4], structured_outputs={"regex": "a+"})
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 5, 11)
    assert (params.max_new_tokens, params.min_new_tokens, params.ignore_eos) == (32, 0, False)
    assert params.stop_token_ids == (3, 4), "any sequence in, a tuple kept (the params are frozen)"
    assert (
        isinstance(params.structured_outputs, StructuredOutputs) and params.structured_outputs.regex == "a+"
    )
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams(ignore_eos=True, stop_token_ids=(2,)).ignore_eos  # stop ids still end it
