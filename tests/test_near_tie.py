"""The near-tie rule itself (``near_tie.py``) rejects what it must: a token that is not the
reference's runner-up, however generous the margin, and a wrong token after a legitimate
near-tie. Answers are built from the reference's own logits, so each case is what it says."""

import mlx.core as mx
import numpy as np
import pytest
from near_tie import parting_problem

from batchlab import generate

pytestmark = pytest.mark.slow
N = 10
GENEROUS = 100.0  # so only the runner-up and continuation clauses can reject


@pytest.fixture(scope="module")
def case(lm):
    prompt = lm.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])
    ref = generate(lm, prompt, N, ignore_eos=True).token_ids

    def ranked(prefix):  # the reference's tokens after ``prefix``, best first
        return np.argsort(-np.array(lm.model(mx.array([prompt + prefix]))[0, -1])).tolist()

    return prompt, ref, ranked


def test_the_reference_itself_and_a_runner_up_parting_pass(lm, case):
    prompt, ref, ranked = case
    assert parting_problem(lm, prompt, ref, N, GENEROUS, ignore_eos=True) is None
    second = ranked(ref[:3])[1]
    parted = ref[:3] + [second] + generate(lm, prompt + ref[:3] + [second], N - 4, ignore_eos=True).token_ids
    assert parting_problem(lm, prompt, parted, N, GENEROUS, ignore_eos=True) is None
    assert "no near-tie" in parting_problem(lm, prompt, parted, N, 1e-9, ignore_eos=True)


def test_a_token_that_is_not_the_runner_up_is_rejected(lm, case):
    prompt, ref, ranked = case
    third = ranked(ref[:3])[2]
    wrong = ref[:3] + [third] + generate(lm, prompt + ref[:3] + [third], N - 4, ignore_eos=True).token_ids
    assert "not the reference's runner-up" in parting_problem(lm, prompt, wrong, N, GENEROUS, ignore_eos=True)


def test_a_wrong_token_after_a_legitimate_near_tie_is_rejected(lm, case):
    prompt, ref, ranked = case
    second = ranked(ref[:3])[1]
    parted = ref[:3] + [second] + generate(lm, prompt + ref[:3] + [second], N - 4, ignore_eos=True).token_ids
    parted[7] = ranked(parted[:7])[-1]  # the least likely token there
    said = parting_problem(lm, prompt, parted, N, GENEROUS, ignore_eos=True)
    assert said is not None and "token 7" in said
