"""The CPU runner's decode attention two ways, interleaved in one process on the real model:
today's ``cpu_llama.decode_rows_views`` (every row's scores in one padded array, one softmax
for all rows, two matrix products a row) against a softmax per row (five numpy calls more a
row, the version before 2026-12-03). B=16 decode rows at context 256, as in
``step_profile.py``; each round runs both, ``--reps`` timed steps each; medians.

    .venv/bin/python benchmarks/decode_attention_ab.py [--rounds 7] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import step_profile  # noqa: E402  (imports batchlab first: OpenBLAS before MLX)

from batchlab.model import cpu_llama  # noqa: E402
from batchlab.core.kv import BlockManager  # noqa: E402
from batchlab.model.load import load_model  # noqa: E402
from batchlab.model.model_runner import ModelRunner  # noqa: E402


def softmax_per_row(q, contexts, scale):
    """The earlier ``decode_rows_views``: one row at a time, scores, softmax and values."""
    R, H, D = q.shape
    KH = contexts[0][0].shape[1]
    qg = (q * np.float32(scale)).reshape(R, KH, H // KH, D)
    out = np.empty_like(qg)
    for r, (keys, values) in enumerate(contexts):
        out[r] = cpu_llama.softmax_(qg[r] @ keys.transpose(1, 2, 0)) @ values.transpose(1, 0, 2)
    return out.reshape(R, H * D)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    lm = load_model()
    blocks = BlockManager(-(-(16 * (step_profile.CONTEXT + 8) + 400) // 16), 16)
    runner = ModelRunner(lm, blocks.num_blocks, 16)
    rows = step_profile.passes(runner, blocks)["decode B=16"]
    ways = {"padded softmax (today)": cpu_llama.decode_rows_views, "softmax per row": softmax_per_row}
    logits = {}
    for name, way in ways.items():
        cpu_llama.decode_rows_views = way
        logits[name] = np.asarray(runner.forward(rows))
    a, b = logits.values()
    print(
        f"logits: max |difference| {float(np.abs(a - b).max()):.2e}; same argmax: {(a.argmax(-1) == b.argmax(-1)).all()}"
    )
    load = os.getloadavg()[0]
    steps = {name: [] for name in ways}
    attn = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            cpu_llama.decode_rows_views = way
            runner.forward(rows)  # warm-up
            for _ in range(args.reps):
                runner.profile = {}
                start = time.perf_counter()
                runner.forward(rows)
                steps[name].append(time.perf_counter() - start)
                attn[name].append(runner.profile["attention"])
            runner.profile = None
    cpu_llama.decode_rows_views = ways["padded softmax (today)"]
    for name in ways:
        print(
            f"{name:24s} step {statistics.median(steps[name]) * 1e3:6.1f} ms   "
            f"attention {statistics.median(attn[name]) * 1e3:5.1f} ms"
        )
    new, old = (statistics.median(attn[n]) for n in ways)
    print(f"attention today / per row: {new / old:.2f}; load average {load:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
