"""The model runner (the mechanism): run one batch of ragged sequences as ONE forward
pass over an mlx-lm Llama-family model, reading and writing paged KV, and sample the
next tokens. It owns the KV pool (the memory) but never decides who gets which block:
each ``Chunk`` arrives with its request's block table, made by the scheduler.

A batch is a list of ``Chunk``s. A decode row is a chunk of one token; a prefill chunk
is several consecutive prompt tokens. All tokens of all chunks are packed into one
``[1, T]`` sequence, so every linear layer (the bulk of the work) runs once over T
rows: decode rows ride along on a prefill chunk's matrix multiplies. Only attention
is per sequence, because each sequence attends to its own keys and values:
- decode rows together: their contexts gathered from the KV pool, padded, masked;
- each prefill chunk: causal attention over its own earlier tokens plus itself.
Both go through ``decode_rows`` and ``prefill_chunk`` at the end of this file: on the GPU path
(``backend.gpu_path``: the GPU, or ``BATCHLAB_GPU_PATH=1`` on the CPU) MLX's fused
``mx.fast.scaled_dot_product_attention``, the graph staying lazy; elsewhere numpy's
(``cpu_llama``), where MLX's CPU attention is slow. The fused kernel's additive mask must have the
queries' dtype (float16 on a Mac): MLX refuses a float32 mask with float16 queries ("Mask type
must promote to output type"), so the mask is cast where it is used. On Linux the CPU path
(``cpu_llama.CpuLlama``) runs the whole pass in numpy instead.

The runner decides nothing: which chunks run is the scheduler's job.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from .backend import gpu_path
from .cpu_llama import CpuLlama, cpu_path_applies, decode_rows_np, prefill_chunk_np, silu_mul
from ..core.request import Sampler
from ..core.runner import Chunk, Model, Runner, sample_rows


class KVPool:
    """The KV memory itself: keys and values of every layer, by flat address
    ``[num_blocks * block_size, kv_heads, head_dim]``. MLX arrays on Metal (and wherever
    the runner keeps MLX's own path); float32 numpy arrays on the CPU path, written in
    place, so a step's writes cost its own tokens, never a copy of the pool."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        numpy: bool = False,
    ):
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.numpy = numpy
        if numpy:
            self.keys = [np.zeros(shape, dtype=np.float32) for _ in range(num_layers)]
            self.values = [np.zeros(shape, dtype=np.float32) for _ in range(num_layers)]
            return
        self.keys = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.keys, self.values)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * dtype.size

    @property
    def token_bytes(self) -> int:
        """What one token's keys and values take in this pool, every layer."""
        return 2 * len(self.keys) * self.keys[0][0].nbytes


def sample(logits, samplers: list[Sampler]) -> list[int]:
    """One token per row of ``logits`` [N, vocab] (MLX or numpy). All greedy: one argmax;
    otherwise the rows go to numpy and each request's own sampler."""
    plain = all(s.params.greedy and not s.restricted for s in samplers)
    if isinstance(logits, np.ndarray):
        return np.argmax(logits, axis=-1).tolist() if plain else sample_rows(logits, samplers)
    if plain:
        return greedy_mx(logits).tolist()
    return sample_rows(np.array(logits.astype(mx.float32)), samplers)


def greedy_mx(logits: mx.array) -> mx.array:
    """The most likely token of each row of MLX ``logits`` [N, vocab], the lowest id among
    equal maxima, as ``np.argmax`` picks. ``mx.argmax`` promises no tie rule, and ties are
    common in float16 logits (their spacing is 1/64 between 16 and 32)."""
    ids = mx.arange(logits.shape[-1])
    best = logits == mx.max(logits, axis=-1, keepdims=True)
    return mx.min(mx.where(best, ids, logits.shape[-1]), axis=-1)


class ModelRunner(Runner):
    """``profile``: set it to a dict and every forward pass adds its seconds by operation
    (``benchmarks/step_profile.py``); None (the default) costs nothing. ``cpu_path``:
    None chooses (``cpu_path_applies``); False forces MLX's own layers, as Metal runs them."""

    def __init__(self, lm: Model, num_blocks: int, block_size: int, cpu_path: bool | None = None):
        self.lm, self.block_size = lm, block_size
        model = lm.model
        self.layers = model.model.layers
        attn = self.layers[0].self_attn
        self.n_heads, self.n_kv_heads = attn.n_heads, attn.n_kv_heads
        self.head_dim = (
            model.model.embed_tokens.weight.shape[1] // self.n_heads
            if getattr(lm.args, "head_dim", None) is None
            else lm.args.head_dim
        )
        self.scale = attn.scale
        self.dtype = model.model.embed_tokens.weight.dtype
        if self.dtype not in (mx.float32, mx.float16, mx.bfloat16):  # quantized models
            self.dtype = mx.float16
        self.cpu_path = cpu_path_applies(lm) if cpu_path is None else cpu_path and cpu_path_applies(lm)
        self.pool = KVPool(
            len(self.layers),
            num_blocks,
            block_size,
            self.n_kv_heads,
            self.head_dim,
            self.dtype,
            numpy=self.cpu_path,
        )
        self.profile: dict[str, float] | None = None
        if self.cpu_path:
            self._cpu = CpuLlama(lm, max(lm.max_seq_len, num_blocks * block_size), block_size)

    def sample(self, logits, rows: list[int], samplers: list[Sampler]) -> list[int]:
        if isinstance(logits, np.ndarray):
            return sample(logits[rows], samplers)
        return sample(logits[mx.array(rows)], samplers)

    def _tick(self, name: str) -> None:
        if self.profile is not None:
            now = time.perf_counter()
            self.profile[name] = self.profile.get(name, 0.0) + now - self._t
            self._t = now

    def forward(self, chunks: list[Chunk], head_rows: list[int] | None = None):
        """Run all ``chunks`` in one pass; return logits for the last ``chunk.head`` tokens of
        each chunk in ``head_rows`` (default: every chunk), in that order, ``[sum of their
        heads, vocab]``: the distribution of the token that comes next after each (one position
        for a plain chunk, 1 + k for a verify row). ``run`` asks only for the rows that sample."""
        self._t = time.perf_counter()
        head = list(range(len(chunks))) if head_rows is None else head_rows
        # Decode rows first, then prefill chunks: one attention call for the decode rows, one per chunk.
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].tokens) > 1)
        where = np.argsort(order)  # caller's chunk i sits at where[i] in the packed order
        chunks = [chunks[i] for i in order]
        rows = [c for c in chunks if len(c.tokens) == 1]
        prefills = [c for c in chunks if len(c.tokens) > 1]
        ends = np.cumsum([len(c.tokens) for c in chunks]) - 1
        last = np.zeros(0, dtype=np.int64)
        if head:  # each head chunk's last `head` packed positions, in the caller's order
            last = np.concatenate(
                [np.arange(ends[where[i]] - chunks[where[i]].num_drafts, ends[where[i]] + 1) for i in head]
            )
        if self.cpu_path:
            return self._cpu.forward(chunks, rows, prefills, last, self.pool, self._tick)

        tokens = mx.array([t for c in chunks for t in c.tokens])
        positions = mx.array(
            np.concatenate([np.arange(c.start, c.start + len(c.tokens)) for c in chunks]).astype(np.int32)
        )
        writes = mx.array(np.concatenate([c.kv_addresses(c.start, c.end, self.block_size) for c in chunks]))
        row_context = self._row_context(rows) if rows else None
        prefill_context = [self._prefill_context(c) for c in prefills]

        h = self.lm.model.model.embed_tokens(tokens[None])  # [1, T, hidden]
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            h = h + layer.self_attn.o_proj(
                self._attention(
                    i,
                    layer.self_attn,
                    x,
                    positions,
                    writes,
                    len(rows),
                    row_context,
                    prefills,
                    prefill_context,
                )
            )
            h = h + mlp(layer.mlp, layer.post_attention_layernorm(h))

        if len(last) == 0:
            logits = mx.zeros((0, self.lm.args.vocab_size), dtype=h.dtype)
        else:
            logits = self._lm_head(self.lm.model.model.norm(h[0, mx.array(last)]))
        mx.eval(logits, self.pool.keys, self.pool.values)
        self._tick("mlx graph (all of it)")
        return logits

    def _attention(
        self, i, attn, x, positions, writes, num_rows, row_context, prefills, prefill_context
    ) -> mx.array:
        """Self-attention of layer ``i`` for the packed tokens ``x`` [1, T, hidden] (MLX's path)."""
        T, H, KH, D = x.shape[1], self.n_heads, self.n_kv_heads, self.head_dim
        # Rotary embeddings per token at its own position: treat each token as a batch item.
        q = attn.rope(attn.q_proj(x).reshape(T, H, 1, D), offset=positions).reshape(T, H, D)
        k = attn.rope(attn.k_proj(x).reshape(T, KH, 1, D), offset=positions).reshape(T, KH, D)
        v = attn.v_proj(x).reshape(T, KH, D)
        # Store this step's keys and values in the pool (a scatter into their slots).
        self.pool.keys[i][writes] = k
        self.pool.values[i][writes] = v
        keys, values = self.pool.keys[i], self.pool.values[i]

        outputs = []
        if num_rows:  # decode rows: one query each, over its gathered, padded context
            gather, mask = row_context
            outputs.append(decode_rows(q[:num_rows], keys[gather], values[gather], mask, self.scale))
        offset = num_rows
        for chunk, (gather, mask) in zip(prefills, prefill_context):
            L = len(chunk.tokens)
            if gather is None:  # first chunk of a prompt: its own keys are the whole context
                kc, vc = k[offset : offset + L], v[offset : offset + L]
            else:
                kc, vc = keys[gather], values[gather]
            outputs.append(prefill_chunk(q[offset : offset + L], kc, vc, mask, self.scale))
            offset += L
        return mx.concatenate(outputs)[None] if len(outputs) > 1 else outputs[0][None]

    def _row_context(self, rows: list[Chunk]):
        """Gather indices [rows, longest context] and the additive mask hiding each row's padding."""
        lengths = [c.start + 1 for c in rows]
        longest = max(lengths)
        gather = np.zeros((len(rows), longest), dtype=np.int32)
        for r, c in enumerate(rows):
            gather[r, : lengths[r]] = c.kv_addresses(0, lengths[r], self.block_size)
        allowed = np.arange(longest)[None, :] < np.array(lengths)[:, None]
        return mx.array(gather), additive_mask(allowed)

    def _prefill_context(self, chunk: Chunk):
        """Gather indices of the chunk's whole context and its additive causal mask (query i,
        at position start+i, sees keys 0..start+i); both None if it starts the prompt."""
        L = len(chunk.tokens)
        if chunk.start == 0:
            return None, None
        total = chunk.start + L
        gather = mx.array(chunk.kv_addresses(0, total, self.block_size))
        allowed = np.arange(total)[None, :] <= (chunk.start + np.arange(L))[:, None]
        return gather, additive_mask(allowed)

    def _lm_head(self, h: mx.array) -> mx.array:
        model = self.lm.model
        if hasattr(model, "lm_head"):
            return model.lm_head(h)
        return model.model.embed_tokens.as_linear(h)


def mlp(block, x: mx.array) -> mx.array:
    """mlx-lm's SwiGLU MLP, ``down(silu(gate(x)) * up(x))``. On the CPU the SiLU runs in
    numpy, where MLX's sigmoid is a scalar ``exp`` loop (``docs/results/cpu_path_measurements.md``)."""
    if gpu_path():
        return block(x)
    gate, up = to_numpy(block.gate_proj(x), block.up_proj(x))
    return block.down_proj(mx.array(silu_mul(gate, up)).astype(x.dtype))


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
