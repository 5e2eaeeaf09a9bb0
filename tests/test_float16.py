"""The Mac's numbers on this machine: the weights loaded in float16 exactly as on Metal
(``load_model(dtype=mx.float16)``, what ``BATCHLAB_DTYPE=float16`` makes the default), run
on the CPU, against the float32 model on the greedy prompts of test_model.py.

Float16 rounds every weight (relative error up to 2^-11), which moves logits a little; a
greedy answer may then take the other branch where two tokens are nearly tied in float32.
So the answers must be equal token for token, except at near-ties (``near_tie.py``: the
float32 runner-up, a margin below ``NEAR_TIE_F16``, and float32's own continuation after it).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from near_tie import NEAR_TIE_F16, parting_problem
from test_model import PROMPTS, _ids

import batchlab
from batchlab import generate

pytestmark = pytest.mark.slow  # the real model, twice

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def lm16():
    return batchlab.load_model(dtype=mx.float16)


def test_float16_is_loaded_as_on_a_mac(lm16):
    assert lm16.info.dtype == "float16"
    assert lm16.model.model.embed_tokens.weight.dtype == mx.float16


@pytest.mark.parametrize("name", PROMPTS)
def test_float16_greedy_answers_equal_float32_except_near_ties(lm, lm16, name):
    ids = _ids(lm, PROMPTS[name])
    ours32 = generate(lm, ids, NEW_TOKENS, ignore_eos=True).token_ids
    ours16 = generate(lm16, ids, NEW_TOKENS, ignore_eos=True).token_ids
    assert len(ours16) == NEW_TOKENS
    wrong = parting_problem(lm, ids, ours16, NEW_TOKENS, NEAR_TIE_F16, ignore_eos=True)
    assert wrong is None, f"{name}: float16 left float32's answer: {wrong}"
    print(f"{name}: {'equal' if ours16 == ours32 else 'equal up to near-ties'}")
