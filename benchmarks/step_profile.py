"""Where one forward pass's time goes, by operation: a B=1 decode step, a B=16 decode step
(every row at context 256) and a 128-token prefill chunk, on the real model.

The runner's CPU path runs synchronously (numpy, and MLX matmuls evaluated on the spot), so
``ModelRunner.profile`` times each operation exactly, without adding a sync. Each pass is
run ``--reps`` times after a warm-up; each operation's median over those runs is printed.
The same passes on MLX's own layers (``cpu_path=False``: the code Metal runs, here on the
CPU) are timed beside them for comparison, and the roofline of each pass:
max(linear + LM-head FLOPs / sgemm rate, weight bytes / copy rate).

    .venv/bin/python benchmarks/step_profile.py --json docs/results/step_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import batchlab  # noqa: F401  (OpenBLAS before MLX)
from mlx.utils import tree_flatten

from batchlab.measurement import microbench
from batchlab.measurement.bench import linear_flops_per_token
from batchlab.core.kv import BlockManager
from batchlab.model.load import load_model
from batchlab.model.model_runner import ModelRunner
from batchlab.core.runner import Chunk

CONTEXT = 256


def passes(runner: ModelRunner, blocks: BlockManager) -> dict[str, list[Chunk]]:
    filler = [(i * 7919) % 1000 + 100 for i in range(CONTEXT + 200)]
    rows = []
    for d in range(16):
        blocks.reserve(f"r{d}", CONTEXT + 8)
        table = list(blocks.ensure(f"r{d}", CONTEXT + 8))
        runner.forward([Chunk(f"r{d}", filler[:CONTEXT], 0, table)])
        rows.append(Chunk(f"r{d}", [filler[CONTEXT]], CONTEXT, table))
    blocks.reserve("p", 200)
    return {
        "decode B=1": rows[:1],
        "decode B=16": rows,
        "prefill 128": [Chunk("p", filler[:128], 0, list(blocks.ensure("p", 200)))],
    }


def profile(runner: ModelRunner, chunks: list[Chunk], reps: int) -> dict:
    runner.forward(chunks)
    totals, parts = [], []
    for _ in range(reps):
        runner.profile = {}
        start = time.perf_counter()
        runner.forward(chunks)
        totals.append(time.perf_counter() - start)
        parts.append(runner.profile)
    runner.profile = None
    names = list(parts[0])
    return {
        "total_s": statistics.median(totals),
        "ops_s": {n: statistics.median(p.get(n, 0.0) for p in parts) for n in names},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model()
    sgemm, copy = microbench.sgemm_gflops(), microbench.copy_gbps()
    flops = linear_flops_per_token(lm.args)
    head_flops = 2 * lm.args.vocab_size * lm.args.hidden_size
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
    load = os.getloadavg()[0]
    out = {
        "sgemm_gflops": sgemm,
        "copy_gbps": copy,
        "context": CONTEXT,
        "reps": args.reps,
        "load_before": load,
        "passes": {},
    }
    results = {}
    for cpu_path in (True, False):
        blocks = BlockManager(-(-(16 * (CONTEXT + 8) + 400) // 16), 16)
        runner = ModelRunner(lm, blocks.num_blocks, 16, cpu_path=cpu_path)
        if cpu_path:  # the profiled pool's
            kv_per_token = runner.pool.token_bytes
        for name, chunks in passes(runner, blocks).items():
            results.setdefault(name, {})["cpu_path" if cpu_path else "mlx_layers"] = profile(
                runner, chunks, args.reps
            )
    for name, r in results.items():
        tokens = 128 if name.startswith("prefill") else int(name.split("=")[1])
        sampled = 1 if name.startswith("prefill") else tokens
        roofline = max((tokens * flops + sampled * head_flops) / (sgemm * 1e9), weight_bytes / (copy * 1e9))
        # the keys and values the pass reads: every decode row's CONTEXT + 1, a chunk its own
        kv_bytes = (tokens if name.startswith("prefill") else tokens * (CONTEXT + 1)) * kv_per_token
        with_kv = max(roofline, (weight_bytes + kv_bytes) / (copy * 1e9))
        total = r["cpu_path"]["total_s"]
        out["passes"][name] = {
            **r,
            "roofline_s": roofline,
            "over_roofline": total / roofline,
            "kv_bytes_read": kv_bytes,
            "roofline_with_kv_s": with_kv,
        }
        print(
            f"\n{name}: {total * 1e3:.1f} ms = {total / roofline:.1f}x its roofline "
            f"({roofline * 1e3:.1f} ms), {total / with_kv:.1f}x with the {kv_bytes / 1e6:.0f} MB of KV "
            f"it reads ({with_kv * 1e3:.1f} ms); MLX's own layers on the CPU: "
            f"{r['mlx_layers']['total_s'] * 1e3:.1f} ms"
        )
        ops = r["cpu_path"]["ops_s"]
        for op, s in sorted(ops.items(), key=lambda kv: -kv[1]):
            print(f"  {op:32s} {s * 1e3:7.2f} ms  {s / total:5.1%}")
    out["load_after"] = os.getloadavg()[0]
    print(
        f"\nsgemm {sgemm:.0f} GFLOP/s, copy {copy:.1f} GB/s; load average "
        f"{load:.2f} -> {out['load_after']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
