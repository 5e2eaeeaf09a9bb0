"""The runner's attention (``model_runner.prefill_chunk`` / ``decode_rows``, the CPU path's
numpy ``cpu_llama.softmax_`` / ``decode_rows_views``) against float64 numpy
references written independently: plain per-head softmax attention with GQA by
``h // G`` and explicit causal / padding rules, and ``mx.fast``'s own attention."""

import mlx.core as mx
import numpy as np
import pytest

from batchlab.model.cpu_llama import decode_rows_views, softmax_
from batchlab.model.model_runner import additive_mask, decode_rows, prefill_chunk

H, KH, D = 9, 3, 64
SCALE = D**-0.5


def reference(q, k, v, allowed):
    """float64: q [L, H, D], k and v [S, KH, D], allowed [L, S] -> [L, H * D]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    L, S = allowed.shape
    out = np.zeros((L, H, D))
    for h in range(H):
        kv = h // (H // KH)
        scores = q[:, h] @ k[:, kv].T * SCALE
        scores[~allowed] = -np.inf
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (w / w.sum(axis=1, keepdims=True)) @ v[:, kv]
    return out.reshape(L, H * D)


def test_softmax_matches_float64_and_gives_masked_keys_exactly_zero():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 3, 257)) * 30).astype(np.float32)  # wide range: underflows too
    x[..., 100:] = -np.inf
    got = softmax_(x.copy())
    x64 = x.astype(np.float64)
    want = np.exp(x64 - x64.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    assert np.all(got[..., 100:] == 0)
    assert np.max(np.abs(got - want)) < 1e-6
    assert np.max(np.abs(got - want)[want > 1e-30] / want[want > 1e-30]) < 1e-5


@pytest.mark.parametrize("start,L", [(0, 64), (960, 64), (17, 5), (0, 1)])
def test_prefill_chunk(start, L):
    rng = np.random.default_rng(start + L)
    S = start + L
    q = rng.standard_normal((L, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((S, KH, D)).astype(np.float32) for _ in range(2))
    allowed = np.arange(S)[None, :] <= (start + np.arange(L))[:, None]
    want = reference(q, k, v, allowed)
    mask = None if start == 0 else additive_mask(allowed)  # None: the causal case
    got = np.array(prefill_chunk(mx.array(q), mx.array(k), mx.array(v), mask, SCALE))
    assert got.shape == (L, H * D)
    assert np.max(np.abs(got - want)) < 2e-6
    fast = mx.fast.scaled_dot_product_attention(
        mx.array(q).transpose(1, 0, 2)[None],
        mx.array(k).transpose(1, 0, 2)[None],
        mx.array(v).transpose(1, 0, 2)[None],
        scale=SCALE,
        mask=mx.array(allowed),
    )
    assert np.max(np.abs(got - np.array(fast[0].transpose(1, 0, 2).reshape(L, H * D)))) < 2e-6


def test_decode_rows_each_row_sees_only_its_own_context():
    rng = np.random.default_rng(1)
    lengths = [1, 5, 300, 64]
    S = max(lengths)
    q = rng.standard_normal((len(lengths), H, D)).astype(np.float32)
    k, v = (rng.standard_normal((len(lengths), S, KH, D)).astype(np.float32) for _ in range(2))
    allowed = np.arange(S)[None, :] < np.array(lengths)[:, None]
    k[~allowed] = 1e4  # padding holds garbage: a mask that leaked would show
    got = np.array(decode_rows(mx.array(q), mx.array(k), mx.array(v), additive_mask(allowed), SCALE))
    for r, n in enumerate(lengths):
        want = reference(q[r : r + 1], k[r, :n], v[r, :n], np.ones((1, n), bool))
        assert np.max(np.abs(got[r] - want[0])) < 2e-6, r


def test_decode_rows_views_each_row_over_its_own_keys_of_its_own_length():
    """The runner's CPU decode attention: rows of different lengths share one padded
    softmax, so a row whose padding leaked into it, or a row read with another's length,
    would show."""
    rng = np.random.default_rng(2)
    lengths = [1, 300, 5, 64, 257]
    pool_k, pool_v = (rng.standard_normal((1000, KH, D)).astype(np.float32) for _ in range(2))
    starts = [0, 10, 400, 500, 700]
    q = rng.standard_normal((len(lengths), H, D)).astype(np.float32)
    contexts = [(pool_k[s : s + n], pool_v[s : s + n]) for s, n in zip(starts, lengths)]
    got = decode_rows_views(q, contexts, SCALE)
    assert got.shape == (len(lengths), H * D)
    for r, (s, n) in enumerate(zip(starts, lengths)):
        want = reference(q[r : r + 1], pool_k[s : s + n], pool_v[s : s + n], np.ones((1, n), bool))
        assert np.max(np.abs(got[r] - want[0])) < 2e-6, r
