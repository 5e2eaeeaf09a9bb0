"""Micro-benchmarks of single forward passes on the real model.

Machines are noisy, so every comparison here times its variants interleaved
(A, B, C, A, B, C, ...) in one run and reports medians and their ratios.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ..model import cpu_llama
from ..model.backend import gpu_path
from .driver import capped, interleaved_order
from ..core.kv import BlockManager
from ..model.load import LoadedModel
from ..core.runner import Chunk
from ..model.model_runner import ModelRunner


def pass_runner(lm: LoadedModel, num_blocks: int, block_size: int = 16) -> tuple[BlockManager, ModelRunner]:
    """A block manager of ``num_blocks`` KV blocks and a ``ModelRunner`` on a pool of that
    size: what designed passes are built in and run on."""
    blocks = BlockManager(num_blocks, block_size)
    return blocks, ModelRunner(lm, blocks.num_blocks, blocks.block_size)


def designed_chunk(
    blocks: BlockManager, req_id: str, tokens: list[int], start: int, kv_tokens: int | None = None
) -> Chunk:
    """One row of a designed forward pass: ``tokens`` of request ``req_id`` at position
    ``start`` (``start`` tokens already cached), with the KV blocks of ``kv_tokens`` tokens
    (default ``start + len(tokens)``) reserved and handed out for it. The blocks are not
    filled: attention costs the same whatever numbers sit in the cache. The one builder of
    designed passes: the micro-benchmarks here and ``costfit``'s fitted passes."""
    kv_tokens = start + len(tokens) if kv_tokens is None else kv_tokens
    blocks.reserve(req_id, kv_tokens)
    return Chunk(req_id, list(tokens), start, list(blocks.ensure(req_id, kv_tokens)))


def designed_pass(blocks: BlockManager, shape: list[tuple[int, int]], prefix: str = "fit") -> list[Chunk]:
    """The chunks of one designed pass given as (start, tokens) rows, each a request of its
    own (``prefix-0``, ``prefix-1``, ...) with the KV blocks its context needs."""
    return [
        designed_chunk(blocks, f"{prefix}-{i}", [1 + (i + j) % 1000 for j in range(n)], start)
        for i, (start, n) in enumerate(shape)
    ]


def fused_step_ratio(
    lm: LoadedModel, decodes: int = 16, chunk: int = 128, context: int = 256, repeats: int = 7
) -> dict:
    """Time one hybrid pass (``decodes`` decode rows + a ``chunk``-token prefill chunk)
    against the chunk alone and the decode rows alone.

    Each pass's median seconds (``fused_s``, ...) and its range over the repeats
    (``fused_range_s``: min, max), the noise a comparison of two passes must allow.
    ``fused_over_chunk_alone`` near 1 means the decode rows rode along almost for free
    on the chunk's matrix multiplies (Sarathi-Serve's point); ``fused_over_separate``
    below 1 is what one fused pass saves over two separate passes.
    """
    blocks, runner = pass_runner(lm, BlockManager.blocks_needed(context + chunk, 16) * (decodes + 1))
    filler = [(i * 7919) % 1000 + 100 for i in range(context + chunk)]
    # every row's KV blocks for context + chunk tokens: decode rows at `context`, the chunk after it
    rows = [
        designed_chunk(blocks, f"r{d}", [filler[context]], context, context + chunk) for d in range(decodes)
    ]
    prefill = designed_chunk(blocks, f"r{decodes}", filler[context : context + chunk], context)  # continuing
    for row in rows + [prefill]:  # fill each row's cache with `context` tokens
        runner.forward([replace(row, tokens=filler[:context], start=0)])
    variants = {"chunk_alone": [prefill], "decode_alone": rows, "fused": rows + [prefill]}
    times = _interleaved_times(runner, variants, repeats)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "decodes": decodes,
        "chunk": chunk,
        "context": context,
        "repeats": len(times["fused"]),  # as run (BATCHLAB_REPETITIONS may cap them)
        **{f"{name}_s": v for name, v in med.items()},
        **{f"{name}_range_s": (min(t), max(t)) for name, t in times.items()},  # each pass's own spread
        "fused_over_chunk_alone": med["fused"] / med["chunk_alone"],
        "fused_over_separate": med["fused"] / (med["chunk_alone"] + med["decode_alone"]),
    }


def chunk_context_ratio(lm: LoadedModel, chunk: int = 64, context: int = 960, repeats: int = 5) -> dict:
    """Time a ``chunk``-token prefill chunk at the start of a prompt against the same-size
    chunk after ``context`` tokens, interleaved. Attention is the only part that grows with
    the context (~25 % of the FLOPs at 1k here), so near-BLAS attention keeps
    ``chunk_1k_over_chunk_0`` near 1.3 or below."""
    blocks, runner = pass_runner(lm, BlockManager.blocks_needed(context + chunk, 16) * 2)
    filler = [(i * 7919) % 1000 + 100 for i in range(context + chunk)]
    first = designed_chunk(blocks, "first", filler[:chunk], 0, context + chunk)
    late = designed_chunk(blocks, "late", filler[context:], context)
    runner.forward([replace(late, tokens=filler[:context], start=0)])
    variants = {"chunk_at_0": [first], "chunk_at_context": [late]}
    med = _interleaved_medians(runner, variants, repeats)
    return {
        "chunk": chunk,
        "context": context,
        "repeats": repeats,
        **{f"{name}_s": v for name, v in med.items()},
        "chunk_1k_over_chunk_0": med["chunk_at_context"] / med["chunk_at_0"],
    }


def verify_row_cost(
    lm: LoadedModel,
    batch_sizes: tuple[int, ...] = (1, 8),
    drafts: int = 3,
    context: int = 256,
    repeats: int = 5,
) -> dict[int, dict]:
    """What ``drafts`` draft tokens add to a decode pass (lesson 11): at each batch size B,
    B plain decode rows (one token each, as a decode step) against B verify rows of
    1 + ``drafts`` tokens (the model's logits at every one of them), every row at ``context``
    tokens of cache, timed interleaved. Per B: the medians, each variant's lowest and highest
    time, and the pass's cost for 1 + drafts tokens a row against 1, paired round by round (a
    round's two passes ran back to back): ``verify_over_decode``, the median of the rounds' own
    ratios, and ``verify_over_decode_range``, their lowest and highest."""
    most = max(batch_sizes)
    blocks, runner = pass_runner(lm, BlockManager.blocks_needed(context + 1 + drafts, 16) * most)
    rows = [
        designed_chunk(blocks, f"r{d}", [(d * 7919 + j) % 20000 + 100 for j in range(1 + drafts)], context)
        for d in range(most)
    ]
    verify = [replace(row, num_drafts=drafts) for row in rows]
    decode = [replace(row, tokens=row.tokens[:1]) for row in rows]
    out = {}
    for b in batch_sizes:
        times = _interleaved_times(runner, {"decode": decode[:b], "verify": verify[:b]}, repeats)
        med = {name: statistics.median(t) for name, t in times.items()}
        ratios = [v / d for v, d in zip(times["verify"], times["decode"])]
        out[b] = {
            "batch": b,
            "drafts": drafts,
            "context": context,
            "repeats": len(times["decode"]),
            **{f"{name}_s": v for name, v in med.items()},
            **{f"{name}_range_s": (min(t), max(t)) for name, t in times.items()},
            "verify_over_decode": statistics.median(ratios),
            "verify_over_decode_range": (min(ratios), max(ratios)),
        }
    return out


def _interleaved_times(
    runner: ModelRunner, variants: dict[str, list[Chunk]], repeats: int
) -> dict[str, list[float]]:
    """Seconds of ``runner.forward`` on each variant, every time, timed A, B, C, A, B, C, ...
    after one untimed warm-up each."""
    times = {name: [] for name in variants}
    for chunks in variants.values():
        runner.forward(chunks)
    for _, name in interleaved_order(variants, capped(repeats)):
        start = time.perf_counter()
        runner.forward(variants[name])
        times[name].append(time.perf_counter() - start)
    return times


def _interleaved_medians(
    runner: ModelRunner, variants: dict[str, list[Chunk]], repeats: int
) -> dict[str, float]:
    """Median seconds of ``runner.forward`` on each variant (``_interleaved_times``)."""
    return {name: statistics.median(t) for name, t in _interleaved_times(runner, variants, repeats).items()}


def decode_scaling(
    lm: LoadedModel, batch_sizes: list[int], context: int = 256, warmup: int = 3, steps: int = 15
) -> dict[int, dict]:
    """Decode step time and tokens/s at each batch size, on our runner (the engine's own
    forward pass, paged KV): B decode rows, each at ``context`` tokens of cache, ``warmup``
    untimed steps, then the median of ``steps`` timed ones. The rows' KV blocks are handed
    out, not filled by a prefill first: attention costs the same whatever the cache holds."""
    blocks, runner = pass_runner(lm, BlockManager.blocks_needed(context + 1, 16) * max(batch_sizes))
    rows = [
        designed_chunk(blocks, f"r{d}", [(d * 7919) % 20000 + 100], context) for d in range(max(batch_sizes))
    ]
    out = {}
    for batch in batch_sizes:
        times = []
        for step in range(warmup + steps):
            start = time.perf_counter()
            runner.forward(rows[:batch])
            if step >= warmup:
                times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        out[batch] = {
            "batch": batch,
            "context": context,
            # what the step reads of its rows' keys and values (every layer, context + 1 each)
            "kv_bytes_read": batch * (context + 1) * runner.pool.token_bytes,
            "step_s": step_s,
            "tokens_per_s": batch / step_s,
            "step_min_s": min(times),
            "step_max_s": max(times),
        }
    return out


def one_row_linears(lm: LoadedModel, repeats: int = 5) -> dict:
    """Every weight matrix of the model (each layer's linear maps and the LM head) times
    one row, as a B=1 decode step needs: in MLX (one graph) and in numpy on the same
    memory, interleaved, medians. Each pass streams all the weights once, as a real step
    does. MLX's CPU backend runs every matmul as a GEMM, which repacks the weight even for
    one row; numpy hands a row vector to GEMV, which reads it once. Their ratio shows how
    much of a B=1 step's distance from the bandwidth bound is the matmul path, not ours.
    Both use every core."""
    weights = [
        m.weight
        for layer in lm.model.model.layers
        for m in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        )
    ]
    head = lm.model.lm_head.weight if hasattr(lm.model, "lm_head") else lm.model.model.embed_tokens.weight
    weights.append(head)
    rows = {w.shape[1]: mx.random.normal((1, w.shape[1])) for w in weights}
    mx.eval(list(rows.values()))
    arrays = [np.asarray(w) for w in weights]  # shares MLX's memory
    np_rows = {k: np.asarray(v) for k, v in rows.items()}
    times = {"mlx": [], "numpy": []}
    for rep in range(repeats + 1):  # the first round is a warm-up
        # each library's BLAS threads spin for a while after their work: let them stop
        # before the other library's pass, or the two fight over the cores
        time.sleep(0.3)
        start = time.perf_counter()
        mx.eval([rows[w.shape[1]] @ w.T for w in weights])
        mlx_s = time.perf_counter() - start
        time.sleep(0.3)
        with cpu_llama.numpy_blas_threads(cpu_llama.CORES):
            start = time.perf_counter()
            for w in arrays:
                np_rows[w.shape[1]] @ w.T
            numpy_s = time.perf_counter() - start
        if rep:
            times["mlx"].append(mlx_s)
            times["numpy"].append(numpy_s)
    mlx_s, numpy_s = statistics.median(times["mlx"]), statistics.median(times["numpy"])
    return {
        "matrices": len(weights),
        "repeats": repeats,
        "mlx_s": mlx_s,
        "numpy_s": numpy_s,
        "mlx_over_numpy": mlx_s / numpy_s,
    }


def sgemm_gflops(repeats: int = 50) -> float:
    """float32 GFLOP/s of the matmul shape MLX runs most here (64 rows by a 576x1536
    weight): what the BLAS gives. ``batchlab info`` and ``batchlab bench`` both print it."""
    a, b = mx.random.normal((576, 1536)), mx.random.normal((64, 576))
    mx.eval(b @ a)
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(b @ a)
    return repeats * 2 * 576 * 1536 * 64 / (time.perf_counter() - start) / 1e9


def copy_gbps(megabytes: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth as GB/s moved (read plus written) by a large copy, best of
    ``repeats``: the rate a memory-bound decode step reads its weights at, at best. On the
    GPU path the copy is MLX's, on its device: a Mac's unified memory feeds the GPU faster
    than one CPU core's numpy copy could show."""
    if gpu_path():
        x = mx.ones((megabytes * 2**20 // 4,), dtype=mx.float32)
        mx.eval(x)
        best = float("inf")
        for _ in range(repeats + 1):
            start = time.perf_counter()
            mx.eval(x + 0)  # reads x, writes a new array of its size
            best = min(best, time.perf_counter() - start)
        return 2 * x.nbytes / best / 1e9
    src = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy also faults the pages in
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9
