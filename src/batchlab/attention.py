"""Attention for the runner: on the CPU without MLX's slow exponential, exact to float32
rounding.

MLX's CPU ``mx.fast.scaled_dot_product_attention`` (and ``mx.exp``, which it uses)
spends most of its time in the exponential: measured here, ``mx.exp`` over a 64-token
chunk's scores at context 1k (9 heads x 64 x 1024) costs 3-4x the two matrix
multiplies of attention together (which run at the BLAS rate). So on the CPU we write attention as two batched matmuls per
layer, one per KV head with its group of query heads stacked as rows
(``[KH, G*L, D] @ [KH, D, S]``: GQA without copying keys), an additive float mask, and
a softmax whose exponential is the Cephes polynomial compiled by ``mx.compile`` into
one fused elementwise loop (~4.5x faster than ``mx.exp`` here, and more accurate; still
scalar code, so the exponential remains the largest part of attention).

On Metal, ``mx.fast.scaled_dot_product_attention`` is the fast one: ``decode_rows`` and
``prefill_chunk`` call it whenever the default device is the GPU.

Shapes: queries ``[N, H, D]`` (token-major, as the runner packs them), keys and values
``[S, KH, D]`` (one sequence's context) or ``[R, S, KH, D]`` (decode rows' padded
contexts); query head ``h`` reads KV head ``h // G`` with ``G = H // KH``, as in mlx-lm.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so n * LN2_HI is exact
_ROUND = 12582912.0  # 1.5 * 2^23: float32 addition rounds t + _ROUND to an integer


@partial(mx.compile, shapeless=True)  # one fused loop, traced once for every shape
def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x) = p * 2^n for x <= 0 (Cephes expf: range reduction by ln 2, then a degree-6
    polynomial p); p is 0 where the result underflows (masked keys), and 2^n comes back as
    its float32 bits (a bit view cannot be compiled shapeless). n is rounded by adding and
    subtracting 1.5 * 2^23, not ``mx.floor``: MLX compiles with plain ``-O3``, where floor
    is a library call per element."""
    n = (x * _LOG2E + _ROUND) - _ROUND
    r = x - n * _LN2_HI - n * _LN2_LO
    p = 1.9875691500e-4
    p = p * r + 1.3981999507e-3
    p = p * r + 8.3334519073e-3
    p = p * r + 4.1665795894e-2
    p = p * r + 1.6666665459e-1
    p = p * r + 5.0000001201e-1
    p = p * r * r + r + 1.0
    n = mx.maximum(n, -126.0)  # keeps the exponent bits valid; those results are 0 anyway
    return mx.where(x < -87.0, 0.0, p), (n.astype(mx.int32) + 127) << 23


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis with the fast exponential, in float32 whatever the
    scores' dtype (as ``mx.fast`` does); -inf scores get weight 0."""
    x = scores.astype(mx.float32)
    p, two_n_bits = _exp_parts(x - x.max(axis=-1, keepdims=True))
    e = p * two_n_bits.view(mx.float32)
    return (e / e.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def additive_mask(allowed: np.ndarray) -> mx.array:
    """A boolean mask (True: may attend) as 0 / -inf to add to the scores."""
    return mx.array(np.where(allowed, 0.0, -np.inf).astype(np.float32))


def on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def prefill_chunk(q: mx.array, keys: mx.array, values: mx.array, mask, scale: float) -> mx.array:
    """Attention of one prefill chunk's ``L`` queries ``[L, H, D]`` over its context
    ``[S, KH, D]``; ``mask`` is additive ``[L, S]`` (None: the keys are exactly the chunk's
    own, causal). Returns ``[L, H * D]``."""
    L, H, D = q.shape
    S, KH, _ = keys.shape
    G = H // KH
    if on_gpu():
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(1, 0, 2)[None], keys.transpose(1, 0, 2)[None],
            values.transpose(1, 0, 2)[None], scale=scale,
            mask="causal" if mask is None else mask)
        return out[0].transpose(1, 0, 2).reshape(L, H * D)
    if mask is None:
        mask = additive_mask(np.tril(np.ones((L, S), dtype=bool)))
    # [KH, G*L, D]: each KV head's query heads stacked as rows of one matrix
    qg = (q * scale).reshape(L, KH, G, D).transpose(1, 2, 0, 3).reshape(KH, G * L, D)
    scores = (qg @ keys.transpose(1, 2, 0)).reshape(KH, G, L, S) + mask
    p = softmax(scores).reshape(KH, G * L, S)
    out = p @ values.transpose(1, 0, 2)  # [KH, G*L, D]
    return out.reshape(KH, G, L, D).transpose(2, 0, 1, 3).reshape(L, H * D)


def decode_rows(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array,
                scale: float) -> mx.array:
    """Attention of ``R`` decode rows, one query each ``[R, H, D]``, over their padded
    contexts ``[R, S, KH, D]``; ``mask`` is additive ``[R, S]`` hiding each row's padding.
    Returns ``[R, H * D]``."""
    R, H, D = q.shape
    _, S, KH, _ = keys.shape
    G = H // KH
    if on_gpu():
        out = mx.fast.scaled_dot_product_attention(
            q[:, :, None], keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3),
            scale=scale, mask=mask[:, None, None, :])
        return out.reshape(R, H * D)
    qg = (q * scale).reshape(R, KH, G, D)
    scores = qg @ keys.transpose(0, 2, 3, 1) + mask[:, None, None, :]  # [R, KH, G, S]
    p = softmax(scores)
    return (p @ values.transpose(0, 2, 1, 3)).reshape(R, H * D)  # [R, KH, G, D]
