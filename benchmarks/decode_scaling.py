"""Decode throughput against batch size on the real model (not a test: timings vary by machine).

For each batch size B (``batchlab.measurement.microbench.decode_scaling``): B prompts of the same
length with differing rows, one prefill pass over all of them with mlx-lm's own model and
KV cache, a few warm-up decode steps, then ``--steps`` timed decode steps of one token per
row. A decode step reads every weight once whatever B is, so while it is
memory-bound, B rows cost little more than one: tokens/s = B / step time grows with B.

    .venv/bin/python benchmarks/decode_scaling.py                 # batches 1 8 16 64
    .venv/bin/python benchmarks/decode_scaling.py --json out.json --batches 1 2 4 8 16 32 64

The issue's target: batch 16 reaches at least 8x the tokens/s of batch 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import batchlab  # first: makes MLX use OpenBLAS on Linux

import mlx.core as mx

from batchlab.measurement.microbench import decode_scaling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args(argv)

    lm = batchlab.load_model()
    info = lm.info
    print(f"model  {info.name}, {info.dtype}, on {info.backend} ({mx.default_device()})")
    print(f"BLAS   {batchlab._blas.STATUS.name}")
    print(
        f"host   {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
    )
    print(
        f"run    prompts of {args.prompt_len} tokens, {args.warmup} warm-up + {args.steps} timed "
        f"decode steps, median step time\n"
    )
    print(f"{'batch':>5} {'step ms':>9} {'min..max ms':>15} {'tokens/s':>9} {'x batch 1':>9}")
    rows = []
    for batch in args.batches:
        row = decode_scaling(lm, [batch], args.prompt_len, args.warmup, args.steps)[batch]
        rows.append(row)
        base = rows[0]["tokens_per_s"] if rows[0]["batch"] == 1 else float("nan")
        row["speedup_vs_batch_1"] = row["tokens_per_s"] / base
        print(
            f"{batch:>5} {1000 * row['step_s']:>9.1f} {1000 * row['step_min_s']:>7.1f}.."
            f"{1000 * row['step_max_s']:<7.1f} {row['tokens_per_s']:>9.1f} "
            f"{row['speedup_vs_batch_1']:>8.1f}x",
            flush=True,
        )
    by_batch = {r["batch"]: r for r in rows}
    ratio = None
    if 1 in by_batch and 16 in by_batch:
        ratio = by_batch[16]["tokens_per_s"] / by_batch[1]["tokens_per_s"]
        verdict = "meets" if ratio >= 8 else "MISSES"
        print(f"\nbatch 16 / batch 1 tokens/s = {ratio:.1f}x ({verdict} the >= 8x target)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": info.name,
                    "dtype": info.dtype,
                    "backend": info.backend,
                    "blas": batchlab._blas.STATUS.name,
                    "prompt_len": args.prompt_len,
                    "warmup": args.warmup,
                    "steps": args.steps,
                    "cpus": os.cpu_count(),
                    "results": rows,
                    "ratio_16_to_1": ratio,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
