"""The CPU path: the model's forward pass in numpy around matrix multiplies, float32.

On the CPU, MLX's own layers are slow everywhere but in their matrix multiplies: its
element-wise kernels are scalar loops off Apple, and its attention runs at a few GFLOP/s.
So on Linux the runner (``model_runner.ModelRunner``) hands each pass to ``CpuLlama``: a
Llama written in numpy (RMSNorm, rotary embeddings, SwiGLU, attention) whose weight matrices
multiply in MLX with OpenBLAS, or in numpy's GEMV for a single row. Same inputs, same outputs
as MLX's own layers, to float32 rounding (``tests/test_model.py``).

Attention, at the end of this file, is exact to float32 rounding: two batched matmuls, one per
KV head with its group of query heads stacked as rows (``[KH, G*L, D] @ [KH, D, S]``: GQA
without copying keys), an additive float mask, and a softmax done in place, on one thread,
with numpy's own OpenBLAS held to one thread beside MLX's. The measurements behind each choice
are in ``docs/results/cpu_path_measurements.md``.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from threadpoolctl import ThreadpoolController

from .backend import gpu_path
from ..core.runner import Chunk, Model

# numpy's wheel bundles its own OpenBLAS (symbols prefixed scipy_openblas); MLX's is another
_NUMPY_BLAS = ThreadpoolController().select(prefix="libscipy_openblas")
_NUMPY_BLAS.limit(limits=1)
CORES = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8)
NUMPY_MATMUL_MAX_ROWS = 1  # at most this many rows, a weight matrix multiplies in numpy's GEMV


def cpu_path_applies(lm: Model) -> bool:
    """The numpy CPU path runs float32 models with plain RoPE and SwiGLU on the CPU; Metal,
    float16 and anything else run MLX's own layers (``mx.fast`` attention on Metal)."""
    if gpu_path():
        return False
    model = lm.model.model
    layer = model.layers[0]
    return (
        model.embed_tokens.weight.dtype == mx.float32
        and type(layer.self_attn.rope) is nn.RoPE
        and layer.self_attn.rope.dims == layer.self_attn.q_proj.weight.shape[0] // layer.self_attn.n_heads
        and all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        and all(type(n) is nn.RMSNorm for n in (layer.input_layernorm, model.norm))
        and not any(
            getattr(m, "bias", None) is not None
            for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj)
        )
    )


class CpuLlama:
    """The model's weights as numpy views (the same memory as MLX's arrays), the rotary tables
    of every position, and one forward pass over packed chunks reading and writing a numpy
    KV pool."""

    def __init__(self, lm: Model, positions: int, block_size: int):
        attn = lm.model.model.layers[0].self_attn
        self.n_heads, self.n_kv_heads, self.scale = attn.n_heads, attn.n_kv_heads, attn.scale
        self.head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
        self.block_size = block_size
        model = lm.model
        self.layers = [_LayerWeights(layer) for layer in model.model.layers]
        self.embed = np.asarray(model.model.embed_tokens.weight)
        head = model.lm_head.weight if hasattr(model, "lm_head") else model.model.embed_tokens.weight
        self.head = (np.asarray(head), head)
        self.final_norm = np.asarray(model.model.norm.weight)
        self.eps = np.float32(model.model.norm.eps)
        rope = model.model.layers[0].self_attn.rope
        # nn.RoPE(traditional=True): pairs (2i, 2i+1) turn by position * scale * base^(-2i/dims)
        dims = rope.dims
        inv = rope.base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
        angles = np.arange(positions, dtype=np.float64)[:, None] * rope.scale * inv[None, :]
        self.cos, self.sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        self.traditional = rope.traditional

    def forward(self, chunks: list[Chunk], rows, prefills, last, pool, tick) -> np.ndarray:
        """Logits ``[len(last), vocab]`` at the packed positions ``last`` of ``chunks`` (decode
        rows first, then prefill chunks); ``pool`` is the runner's numpy KV pool; ``tick(name)``
        adds the time since the last tick to the runner's profile."""
        w, bs = self, self.block_size
        H, KH, D = self.n_heads, self.n_kv_heads, self.head_dim
        tokens = np.fromiter((t for c in chunks for t in c.tokens), dtype=np.int64)
        T = tokens.size
        positions = np.concatenate([np.arange(c.start, c.end) for c in chunks])
        writes = np.concatenate([c.kv_addresses(c.start, c.end, bs) for c in chunks])
        cos, sin = w.cos[positions][:, None, :], w.sin[positions][:, None, :]  # [T, 1, D/2]
        R = len(rows)
        row_spans = [self._span(c.block_table, c.start + 1) for c in rows]
        spans = []  # each prefill chunk's context: a slice of the pool or its blocks
        for c in prefills:
            if c.start == 0:
                spans.append(None)
                continue
            allowed = np.arange(c.end)[None, :] <= (c.start + np.arange(len(c.tokens)))[:, None]
            spans.append(
                (self._span(c.block_table, c.end), np.where(allowed, np.float32(0), np.float32(-np.inf)))
            )
        tick("prepare (numpy indices, masks)")

        h = w.embed[tokens]  # [T, hidden], float32
        tick("embedding")
        for i, lw in enumerate(w.layers):
            x = rms_norm(h, lw.attn_norm, w.eps)
            tick("norms")
            q, k, v = self._matmuls(x, lw.q, lw.k, lw.v)
            tick("linears: q k v")
            q = rope(q.reshape(T, H, D), cos, sin, w.traditional)
            k = rope(k.reshape(T, KH, D), cos, sin, w.traditional)
            v = v.reshape(T, KH, D)
            tick("rope")
            pk, pv = pool.keys[i], pool.values[i]
            pk[writes], pv[writes] = k, v
            tick("kv write")
            out = np.empty((T, H * D), dtype=np.float32)
            if R:  # each row over its own context: a view of the pool where its blocks are consecutive
                contexts = [self._context(pk, pv, span) for span in row_spans]
                tick("context gather")
                out[:R] = decode_rows_views(q[:R], contexts, self.scale)
                tick("attention")
            offset = R
            for c, span in zip(prefills, spans):
                L = len(c.tokens)
                if span is None:  # first chunk of a prompt: its own keys are the whole context
                    kc, vc, mask = k[offset : offset + L], v[offset : offset + L], None
                else:
                    kc, vc = self._context(pk, pv, span[0])
                    mask = span[1]
                tick("context gather")
                out[offset : offset + L] = prefill_chunk_np(q[offset : offset + L], kc, vc, mask, self.scale)
                tick("attention")
                offset += L
            (o,) = self._matmuls(out, lw.o)
            tick("linears: o")
            h += o
            tick("residuals")
            x = rms_norm(h, lw.mlp_norm, w.eps)
            tick("norms")
            gate, up = self._matmuls(x, lw.gate, lw.up)
            tick("linears: gate up")
            act = silu_mul(gate, up)
            tick("silu")
            (down,) = self._matmuls(act, lw.down)
            tick("linears: down")
            h += down
            tick("residuals")
        x = rms_norm(h[last], w.final_norm, w.eps)
        (logits,) = self._matmuls(x, w.head)
        tick("lm head")
        return logits

    def _span(self, block_table: list[int], length: int):
        """Where a context of ``length`` tokens lives: ("slice", first address) when its
        blocks are consecutive in the pool (the usual case), else ("blocks", their ids)."""
        bs = self.block_size
        blocks = np.asarray(block_table[: -(-length // bs)])
        if blocks.size == 1 or bool(np.all(np.diff(blocks) == 1)):
            return "slice", int(blocks[0]) * bs, length
        return "blocks", blocks, length

    def _context(self, pk: np.ndarray, pv: np.ndarray, span) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values ``[length, KH, D]`` of one context: views of the pool for a slice,
        copies of the blocks (one copy a block) otherwise."""
        layout, where, length = span
        if layout == "slice":
            return pk[where : where + length], pv[where : where + length]
        shape = (-1, self.block_size) + pk.shape[1:]
        return (
            pk.reshape(shape)[where].reshape((-1,) + pk.shape[1:])[:length],
            pv.reshape(shape)[where].reshape((-1,) + pv.shape[1:])[:length],
        )

    def _matmuls(self, x: np.ndarray, *weights) -> list[np.ndarray]:
        """``x @ W.T`` for each weight (float32 numpy results): numpy for a few rows (GEMV
        reads the weight once), MLX with both cores' OpenBLAS for more, evaluated together."""
        if x.shape[0] <= NUMPY_MATMUL_MAX_ROWS:
            return [x @ wn.T for wn, _ in weights]
        xm = mx.array(x)
        outs = [xm @ wm.T for _, wm in weights]
        mx.eval(*outs)
        return [np.asarray(o) for o in outs]


class _LayerWeights:
    """One layer's weights for the CPU path: each matrix as (numpy view, MLX array), the
    same memory (no copy)."""

    def __init__(self, layer):
        def pair(linear):
            return np.asarray(linear.weight), linear.weight

        a, m = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = pair(a.q_proj), pair(a.k_proj), pair(a.v_proj), pair(a.o_proj)
        self.gate, self.up, self.down = pair(m.gate_proj), pair(m.up_proj), pair(m.down_proj)
        self.attn_norm = np.asarray(layer.input_layernorm.weight)
        self.mlp_norm = np.asarray(layer.post_attention_layernorm.weight)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    ms = np.einsum("ij,ij->i", x, x) / np.float32(x.shape[1])
    return x * (1 / np.sqrt(ms + eps))[:, None] * weight


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, traditional: bool = True) -> np.ndarray:
    """Rotary embedding of ``x`` [T, heads, D] over all D dims: pairs (2i, 2i+1) when
    ``traditional`` (interleaved, as GGUF's permuted q/k need), else (i, i + D/2)."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if traditional else (x[..., :half], x[..., half:])
    out = np.empty_like(x)
    oa, ob = (out[..., 0::2], out[..., 1::2]) if traditional else (out[..., :half], out[..., half:])
    np.subtract(a * cos, b * sin, out=oa)
    np.add(a * sin, b * cos, out=ob)
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` in numpy, in place on ``gate``'s own buffer when it is ours."""
    with np.errstate(over="ignore"):  # exp(-gate) -> inf where silu(gate) is -0: fine
        act = np.exp(-gate)
    act += 1.0
    np.divide(gate, act, out=act)
    act *= up
    return act


# Attention on the CPU path, in numpy (shapes: queries ``[N, H, D]``, token-major as the runner packs
# them; keys and values ``[S, KH, D]``, or ``[R, S, KH, D]`` for padded decode rows; query head ``h`` reads
# KV head ``h // G`` with ``G = H // KH``, as in mlx-lm).


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
