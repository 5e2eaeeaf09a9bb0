"""Every batched engine kind on the real model gives the sequential engine's greedy tokens.

The comparisons between engines run the model's first two layers (``lm_two_layers``: the same
weights, tokenizer and code, a quarter of a decode step's work): what they check is the engine
(which rows run together, where their keys and values live), not what the model says, which is
checked on all thirty layers here (the sequential engine against ``generate``) and in
``test_model.py`` (against mlx-lm and Hugging Face).

Batching changes the shapes of the matrix multiplies (and so the order of float
additions), so a token can flip where the top two logits are within float error of
each other. Where that happens the test accepts it only under the one near-tie rule
(``near_tie.py``): the reference's runner-up, a tiny margin, and the reference's own
continuation after it.
"""

import argparse
import textwrap

import pytest
from kinds import kind_configs
from near_tie import near_tie_for, parting_problem

from batchlab import generate, make_engine
from batchlab.model.backend import gpu_path


@pytest.fixture(scope="module")
def mixed(lm):
    """Prompts of 5-300 tokens (real English), outputs of 1-64, some ending on EOS."""
    text = " ".join(textwrap.dedent(argparse.__doc__).split())
    words = lm.tokenizer.encode(text * 3)
    lengths_and_outputs = [(5, 24), (300, 16), (40, 1), (150, 9), (12, 64), (80, 5)]
    requests = [(words[i * 7 : i * 7 + n], m) for i, (n, m) in enumerate(lengths_and_outputs)]
    for question in ["What is the capital of France?", "Say hello."]:  # these end on EOS
        requests.append((lm.tokenizer.encode_chat([{"role": "user", "content": question}]), 40))
    return requests


def run_sequential(lm, requests):
    """Each (prompt, max_new_tokens) through the sequential engine: its greedy tokens, in order."""
    engine = make_engine("sequential", lm)
    ids = [engine.submit(p, max_new_tokens=m) for p, m in requests]
    engine.run_until_idle()
    return [engine.poll(i)[0] for i in ids]


@pytest.fixture(scope="module")
def sequential(lm, mixed):
    return run_sequential(lm, mixed)


@pytest.fixture(scope="module")
def sequential_two_layers(lm_two_layers, mixed):
    """The reference of the comparisons between engines: the sequential engine, two layers."""
    return run_sequential(lm_two_layers, mixed)


def test_sequential_engine_equals_generate(lm, mixed, sequential):
    for (prompt, max_new), tokens in zip(mixed, sequential):
        assert generate(lm, prompt, max_new).token_ids == tokens
    assert any(t[-1] in lm.tokenizer.eos_token_ids for t in sequential), "some end on EOS"


# The reference below is sequential. Three configurations a kind; run under BATCHLAB_GPU_PATH=1
# (MLX's CPU backend, slowly) the last of them, each kind once: the path's own lines are
# test_gpu_path.py's to cover and check, in CI.
CONFIGS = kind_configs(exclude=("sequential",), per_kind=1 if gpu_path() else 3)


@pytest.mark.parametrize("kind,options", CONFIGS, ids=[f"{k}-{o}" for k, o in CONFIGS])
def test_batched_kinds_equal_sequential(lm_two_layers, mixed, sequential_two_layers, kind, options):
    lm = lm_two_layers
    cases = [
        (req, ref)
        for req, ref in zip(mixed, sequential_two_layers)
        if options.get("prefill_step") != 1 or len(req[0]) <= 40
    ]  # one pass per token: slow
    engine = make_engine(kind, lm, **options)
    ids = [engine.submit(p, max_new_tokens=m) for (p, m), _ in cases]
    engine.run_until_idle()
    for rid, ((prompt, max_new), expected) in zip(ids, cases):
        tokens, status, _ = engine.poll(rid)
        assert status == "done"
        if tokens != expected:
            wrong = parting_problem(lm, prompt, tokens, max_new, near_tie_for(lm))
            assert wrong is None, f"{kind} {options} {rid}: {wrong}"
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


def test_sampling_is_per_request_and_independent_of_the_batch(lm_two_layers, mixed):
    """A seeded request samples the same tokens alone or among other requests."""
    lm = lm_two_layers
    prompt = mixed[0][0]
    alone = make_engine("continuous", lm, max_batch_size=4)
    rid = alone.submit(prompt, max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=7)
    alone.run_until_idle()
    crowd = make_engine("stallfree", lm, max_batch_size=4, token_budget=64)
    others = [
        crowd.submit(p, max_new_tokens=8, temperature=1.0, seed=i) for i, (p, _) in enumerate(mixed[2:5])
    ]
    rid2 = crowd.submit(prompt, max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=7)
    crowd.run_until_idle()
    assert alone.poll(rid)[0] == crowd.poll(rid2)[0]
    assert all(crowd.poll(o)[1] == "done" for o in others)
