"""Attention for the runner: on the CPU in numpy, exact to float32 rounding; on Metal,
MLX's fused kernel.

MLX's CPU backend is slow at attention, and not in its matrix multiplies (its element-wise
kernels are scalar loops off Apple). So on the CPU the runner hands this layer's queries, keys
and values to numpy (``np.asarray`` evaluates them and shares their memory) and gets the
``[N, H * D]`` result back as one small MLX array. Attention is then two batched matmuls, one
per KV head with its group of query heads stacked as rows (``[KH, G*L, D] @ [KH, D, S]``: GQA
without copying keys), an additive float mask, and a softmax done in place, on one thread,
with numpy's own OpenBLAS held to one thread beside MLX's. Why each of these, with the
measurements: ``docs/results/cpu_path_measurements.md``.

On Metal, ``mx.fast.scaled_dot_product_attention`` is the fast one: ``decode_rows`` and
``prefill_chunk`` call it on the GPU path (``backend.gpu_path``: the GPU, or
``BATCHLAB_GPU_PATH=1`` on the CPU), and the graph stays lazy. Its additive mask must have
the queries' dtype (float16 on a Mac): MLX refuses a float32 mask with float16 queries
("Mask type must promote to output type"), so the mask is cast where it is used.

Shapes: queries ``[N, H, D]`` (token-major, as the runner packs them), keys and values
``[S, KH, D]`` (one sequence's context) or ``[R, S, KH, D]`` (decode rows' padded
contexts); query head ``h`` reads KV head ``h // G`` with ``G = H // KH``, as in mlx-lm.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
from threadpoolctl import ThreadpoolController

from .backend import gpu_path

# numpy's wheel bundles its own OpenBLAS (symbols prefixed scipy_openblas); MLX's is another
_NUMPY_BLAS = ThreadpoolController().select(prefix="libscipy_openblas")
_NUMPY_BLAS.limit(limits=1)
CORES = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8)


def numpy_blas_threads(threads: int):
    """A context in which numpy's own BLAS uses ``threads`` threads (one outside it)."""
    return _NUMPY_BLAS.limit(limits=threads)


def softmax_(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of float32 ``scores``, in place; -inf scores get
    weight 0."""
    np.subtract(scores, scores.max(axis=-1, keepdims=True), out=scores)
    np.exp(scores, out=scores)
    scores *= 1.0 / scores.sum(axis=-1, keepdims=True, dtype=np.float32)
    return scores


def additive_mask(allowed: np.ndarray) -> mx.array:
    """A boolean mask (True: may attend) as 0 / -inf to add to the scores."""
    return mx.array(np.where(allowed, 0.0, -np.inf).astype(np.float32))


def to_numpy(*arrays: mx.array) -> list[np.ndarray]:
    """float32 numpy views of MLX arrays, evaluated together (copies only to convert a dtype)."""
    arrays = [a if a.dtype == mx.float32 else a.astype(mx.float32) for a in arrays]
    mx.eval(*arrays)
    return [np.asarray(a) for a in arrays]


def prefill_chunk(q: mx.array, keys: mx.array, values: mx.array, mask, scale: float) -> mx.array:
    """Attention of one prefill chunk's ``L`` queries ``[L, H, D]`` over its context
    ``[S, KH, D]``; ``mask`` is additive ``[L, S]`` (None: the keys are exactly the chunk's
    own, causal). Returns ``[L, H * D]``."""
    L, H, D = q.shape
    if gpu_path():
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(1, 0, 2)[None],
            keys.transpose(1, 0, 2)[None],
            values.transpose(1, 0, 2)[None],
            scale=scale,
            mask="causal" if mask is None else mask.astype(q.dtype),
        )
        return out[0].transpose(1, 0, 2).reshape(L, H * D)
    qn, kn, vn = to_numpy(q, keys, values)
    out = prefill_chunk_np(qn, kn, vn, None if mask is None else to_numpy(mask)[0], scale)
    return mx.array(out).astype(q.dtype)


def prefill_chunk_np(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray | None, scale: float
) -> np.ndarray:
    """``prefill_chunk`` on float32 numpy arrays (the CPU runner's own call): queries
    ``[L, H, D]``, keys and values ``[S, KH, D]``, additive ``mask`` ``[L, S]`` or None
    (causal over the chunk's own keys). Returns ``[L, H * D]``."""
    L, H, D = q.shape
    S, KH, _ = keys.shape
    G = H // KH
    if mask is None:  # the keys are the chunk's own: causal
        mask = np.where(np.tril(np.ones((L, S), dtype=bool)), np.float32(0), np.float32(-np.inf))
    # [KH, G*L, D]: each KV head's query heads stacked as rows of one matrix; row m is
    # the query at chunk position m % L
    qg = (q * np.float32(scale)).reshape(L, KH, G, D).transpose(1, 2, 0, 3).reshape(KH, G * L, D)
    keys_t, values_h = keys.transpose(1, 2, 0), values.transpose(1, 0, 2)  # [KH, D, S], [KH, S, D]

    scores = qg @ keys_t  # [KH, G*L, S]
    scores += mask[np.arange(G * L) % L]
    out = softmax_(scores) @ values_h  # [KH, G*L, D]
    return out.reshape(KH, G, L, D).transpose(2, 0, 1, 3).reshape(L, H * D)


def decode_rows(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float) -> mx.array:
    """Attention of ``R`` decode rows, one query each ``[R, H, D]``, over their padded
    contexts ``[R, S, KH, D]``; ``mask`` is additive ``[R, S]`` hiding each row's padding.
    Returns ``[R, H * D]``."""
    R, H, D = q.shape
    if gpu_path():
        out = mx.fast.scaled_dot_product_attention(
            q[:, :, None],
            keys.transpose(0, 2, 1, 3),
            values.transpose(0, 2, 1, 3),
            scale=scale,
            mask=mask[:, None, None, :].astype(q.dtype),
        )
        return out.reshape(R, H * D)
    qn, kn, vn, mn = to_numpy(q, keys, values, mask)
    return mx.array(decode_rows_np(qn, kn, vn, mn, scale)).astype(q.dtype)


def decode_rows_np(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray, scale: float
) -> np.ndarray:
    """``decode_rows`` on float32 numpy arrays (the CPU runner's own call): queries
    ``[R, H, D]``, padded contexts ``[R, S, KH, D]``, additive ``mask`` ``[R, S]``.
    Returns ``[R, H * D]``."""
    R, H, D = q.shape
    _, S, KH, _ = keys.shape
    G = H // KH
    qg = (q * np.float32(scale)).reshape(R, KH, G, D)
    keys_t, values_h = keys.transpose(0, 2, 3, 1), values.transpose(0, 2, 1, 3)  # [R, KH, D|S, S|D]

    scores = qg @ keys_t  # [R, KH, G, S]
    scores += mask[:, None, None, :]
    out = softmax_(scores) @ values_h  # [R, KH, G, D]
    return out.reshape(R, H * D)


def decode_rows_views(
    q: np.ndarray, contexts: list[tuple[np.ndarray, np.ndarray]], scale: float
) -> np.ndarray:
    """Attention of ``R`` decode rows ``[R, H, D]`` (float32 numpy), row ``r`` over its own
    keys and values ``contexts[r]`` (each ``[S_r, KH, D]``, typically views of the KV pool:
    nothing gathered, no mask). Each row's scores go into one ``[R, KH, G, max S_r]``
    array whose unused tail stays -inf, so the softmax is one pass over all rows, and each
    row costs two matrix multiplies (measured against a softmax per row and against
    ``decode_rows_np``: ``docs/results/cpu_path_measurements.md``)."""
    R, H, D = q.shape
    KH = contexts[0][0].shape[1] if R else 1
    G = H // KH
    qg = (q * np.float32(scale)).reshape(R, KH, G, D)
    lengths = [keys.shape[0] for keys, _ in contexts]
    scores = np.full((R, KH, G, max(lengths, default=0)), -np.inf, dtype=np.float32)
    for r, (keys, _) in enumerate(contexts):
        np.matmul(qg[r], keys.transpose(1, 2, 0), out=scores[r, :, :, : lengths[r]])
    softmax_(scores)
    out = np.empty((R, KH, G, D), dtype=np.float32)
    for r, (_, values) in enumerate(contexts):
        np.matmul(scores[r, :, :, : lengths[r]], values.transpose(1, 0, 2), out=out[r])
    return out.reshape(R, H * D)
