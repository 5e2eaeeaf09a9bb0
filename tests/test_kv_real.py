"""Paged KV on the real model: a pool too small for the batch forces preemptions, and
every request still gets the sequential engine's greedy tokens (and a seeded sampled
request its tokens); a prefix cache gives the same tokens as no cache.

On the model's first two layers (``lm_two_layers``): these compare engines with each other (who
gives way, which blocks are shared), not what the model says (``test_model.py``, thirty layers).
"""

import pytest

from batchlab import make_engine
from batchlab.measurement.workloads import corpus_paragraphs, shared_prefix
from near_tie import near_tie_for, parting_problem


@pytest.fixture(scope="module")
def lm(lm_two_layers):
    return lm_two_layers


@pytest.fixture(scope="module")
def small_pool_requests(lm):
    """Six prompts of 30-90 tokens of real text, 12 new tokens each (EOS ignored)."""
    words = lm.tokenizer.encode(" ".join(corpus_paragraphs()[:12]))
    return [(words[i * 50 : i * 50 + n], 12) for i, n in enumerate([30, 90, 45, 70, 60, 36])]


def run(engine, requests, **sampling):
    ids = [engine.submit(p, max_new_tokens=m, ignore_eos=True, **sampling) for p, m in requests]
    engine.run_until_idle()
    return [engine.poll(i)[0] for i in ids]


def assert_same_or_near_tie(lm, requests, expected, got, label):
    for (prompt, max_new), want, have in zip(requests, expected, got):
        if have != want:
            wrong = parting_problem(lm, prompt, have, max_new, near_tie_for(lm), ignore_eos=True)
            assert wrong is None, f"{label}: {wrong}"


@pytest.fixture(scope="module")
def sequential_tokens(lm, small_pool_requests):
    return run(make_engine("sequential", lm), small_pool_requests)


@pytest.mark.parametrize(
    "kind,options",
    [
        ("continuous", {"max_batch_size": 4, "prefill_step": 32}),
        ("stallfree", {"max_batch_size": 4, "token_budget": 48}),
    ],
)
def test_preemption_keeps_greedy_outputs(lm, small_pool_requests, sequential_tokens, kind, options):
    # 8 blocks of 16 tokens: any one request fits, four at once (~5 blocks each) do not.
    engine = make_engine(kind, lm, kv_block_size=16, num_kv_blocks=8, **options)
    got = run(engine, small_pool_requests)
    stats = engine.stats()
    assert stats["preemptions"] > 0, "the pool is too small for the batch: somebody must give way"
    assert_same_or_near_tie(lm, small_pool_requests, sequential_tokens, got, kind)
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"] == 8


def test_preemption_keeps_seeded_sampled_outputs(lm, small_pool_requests):
    sampling = dict(temperature=0.8, top_p=0.95, seed=5)
    alone = run(make_engine("sequential", lm), small_pool_requests[:4], **sampling)
    engine = make_engine(
        "stallfree", lm, max_batch_size=4, token_budget=48, kv_block_size=16, num_kv_blocks=8
    )
    crowded = run(engine, small_pool_requests[:4], **sampling)
    assert engine.stats()["preemptions"] > 0
    assert crowded == alone


@pytest.mark.parametrize(
    "kind,options",
    [
        ("continuous", {"max_batch_size": 4, "prefill_step": 64}),
        ("stallfree", {"max_batch_size": 4, "token_budget": 96}),
    ],
)
def test_prefix_cache_hits_give_the_same_tokens(lm, kind, options):
    workload = shared_prefix(lm, num_requests=4, output_len=6)
    requests = [(r.prompt_ids, r.max_new_tokens) for r in workload]
    first, rest = requests[:1], requests[1:]
    outputs = {}
    for cache in (False, True):
        engine = make_engine(kind, lm, enable_prefix_cache=cache, **options)
        outputs[cache] = run(engine, first) + run(engine, rest)  # the first fills the cache
        stats = engine.stats()
        common = [next(i for i, (a, b) in enumerate(zip(requests[0][0], p)) if a != b) for p, _ in rest]
        shared = sum(n // 16 for n in common)  # full blocks each later prompt shares with the first
        if cache:
            assert stats["prefix_cache_hits"] == shared > 0
            assert stats["prefix_cache_hit_tokens"] == 16 * stats["prefix_cache_hits"]
            computed = sum(n for s in engine.trace.steps for _, _, n in s.prefill)
            assert computed == sum(len(p) for p, _ in requests) - stats["prefix_cache_hit_tokens"]
        else:
            assert stats["prefix_cache_hits"] == stats["prefix_cache_hit_tokens"] == 0
        assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
        assert stats["preemptions"] == 0
    assert_same_or_near_tie(lm, requests, outputs[False], outputs[True], f"{kind} cache")
