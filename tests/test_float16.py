"""The Mac's numbers on this machine: the weights loaded in float16 exactly as on Metal
(``load_model(dtype=mx.float16)``, what ``BATCHLAB_DTYPE=float16`` makes the default), run
on the CPU, against the float32 model on the greedy prompts of test_model.py.

Float16 rounds every weight (relative error up to 2^-11), which moves logits a little; a
greedy answer may then take the other branch where two tokens are nearly tied in float32.
So the answers must be equal token for token, except at a documented near-tie: where they
part, float32's margin between its token and float16's must be below ``NEAR_TIE``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_model import PROMPTS, _ids

import batchlab
from batchlab import generate

pytestmark = pytest.mark.slow  # the real model, twice

NEW_TOKENS = 30
NEAR_TIE = 0.1  # logits; float16 weights moved SmolLM2's logits by ~0.01-0.05 in our runs


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
    part = next((i for i, (a, b) in enumerate(zip(ours32, ours16)) if a != b), None)
    if part is None:
        print(f"{name}: {NEW_TOKENS} tokens equal")
        return
    logits = np.array(lm.model(mx.array([ids + ours32[:part]]))[0, -1])
    margin = float(logits[ours32[part]] - logits[ours16[part]])
    print(f"{name}: part at token {part}, float32 margin {margin:.4f}")
    assert 0 <= margin < NEAR_TIE, (
        f"float16 left float32's answer at token {part} where float32 "
        f"was sure by {margin:.3f}: not a near-tie"
    )
