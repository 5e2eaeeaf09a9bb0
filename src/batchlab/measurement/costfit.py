"""Fitting the simulator's cost model to the REAL engine (``batchlab fit-cost``).

The real ``ModelRunner`` runs a designed set of forward passes -- decode batches of 1 to
16 rows at several context lengths, prefill chunks of several sizes (at the start of a
prompt and further in), and hybrid passes mixing both -- and each is timed (its fastest
of several runs). A linear
model (``simulator.CostModel``) is fitted by least squares on two thirds of them and its
relative error measured on the other third (held out), so the error it reports is the
error on passes it has not seen.

Attention costs the same whatever numbers sit in the KV cache, so a pass's context is
made by handing its request KV blocks, not by running its prompt first: the passes are
built by ``microbench.designed_pass``, the builder the micro-benchmarks use too.
"""

from __future__ import annotations

import itertools
import platform
import time
from datetime import datetime, timezone

import numpy as np

from .driver import interleaved_order
from ..core.kv import BlockManager
from ..core.runner import Chunk
from ..model.model_runner import ModelRunner
from ..core.costmodel import FEATURES, CostModel, pass_features
from .microbench import designed_pass, pass_runner

DECODE_ROWS = (1, 2, 4, 8, 12, 16)
DECODE_CONTEXTS = (32, 128, 384, 768)
PREFILL = (
    (16, 0),
    (32, 0),
    (64, 0),
    (128, 0),
    (256, 0),
    (384, 0),  # (chunk tokens, start)
    (64, 256),
    (128, 512),
    (256, 256),
    (256, 768),
)
HYBRID = tuple(itertools.product((2, 8, 16), (128, 512), (64, 240)))  # (rows, context, chunk)
POOL_TOKENS = 16 * 769 + 1024  # the largest designed pass fits


def designed_passes(quick: bool = False) -> list[list[tuple[int, int]]]:
    """Each pass as a list of (start, tokens) chunks: start = tokens already cached."""
    passes = []
    for b, ctx in itertools.product(DECODE_ROWS, DECODE_CONTEXTS):
        passes.append([(ctx - 1 - i % 7, 1) for i in range(b)])  # contexts a little ragged
    for n, start in PREFILL:
        passes.append([(start, n)])
    for b, ctx, n in HYBRID:
        passes.append([(ctx - 1 - i % 7, 1) for i in range(b)] + [(0, n)])
    return passes[::3] if quick else passes


def time_pass(
    runner: ModelRunner, blocks: BlockManager, shape: list[tuple[int, int]]
) -> tuple[list[Chunk], float]:
    """The chunks of one designed pass and the seconds one run of it took."""
    chunks = designed_pass(blocks, shape)
    try:
        t = time.perf_counter()
        runner.forward(chunks)
        return chunks, time.perf_counter() - t
    finally:
        for c in chunks:
            blocks.release(c.req_id)


def measure(lm, quick: bool = False, reps: int = 3, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Features and measured seconds of every designed pass on the real model.

    Every pass runs once untimed (MLX's first run of a shape is slow), then ``reps``
    timed rounds go through all passes in turn and each pass keeps its fastest run. On a
    shared machine other programs slow some runs down; the fastest is the one least
    disturbed, and spreading a pass's runs over the whole measurement gives it several
    chances to meet a quiet moment."""
    from tqdm.auto import tqdm

    blocks, runner = pass_runner(lm, -(-POOL_TOKENS // 16))
    shapes = designed_passes(quick)
    best = np.full(len(shapes), np.inf)
    xs = []
    with tqdm(total=(reps + 1) * len(shapes), desc="timing passes", disable=not progress) as bar:
        for round_, i in interleaved_order(range(len(shapes)), reps + 1):
            chunks, seconds = time_pass(runner, blocks, shapes[i])
            if round_ == 0:
                xs.append(pass_features(chunks))
            else:
                best[i] = min(best[i], seconds)
            bar.update()
    return np.array(xs), best


def fit_cost_model(
    lm, quick: bool = False, reps: int = 3, progress: bool = True, command: str = ""
) -> CostModel:
    """Time the designed passes, fit on two thirds, report the error on the held-out third."""
    x, y = measure(lm, quick, reps, progress)
    held_out = np.arange(len(y)) % 3 == 2
    meta = {
        "command": command,
        "fitted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.system()}",
        "model": lm.info.name,
        "dtype": lm.info.dtype,
        "backend": lm.info.backend,
        "passes_fitted": int((~held_out).sum()),
        "passes_held_out": int(held_out.sum()),
        "timed_runs_per_pass (fastest kept)": reps,
        # every timed pass, so a lesson can plot predicted against measured
        "passes": [
            {"features": dict(zip(FEATURES, map(float, f))), "seconds": float(t), "held_out": bool(h)}
            for f, t, h in zip(x, y, held_out)
        ],
    }
    model = CostModel.fit(x[~held_out], y[~held_out], meta)
    err = model.relative_errors(x[held_out], y[held_out])
    model.error = {
        "median": float(np.median(err)),
        "p90": float(np.percentile(err, 90)),
        "max": float(err.max()),
    }
    return model
