"""The same load against ``batchlab serve`` and ``mlx_lm.server``, one after the other.

    .venv/bin/python benchmarks/serving_side_by_side.py [--workload mixed] [--size quick]
        [--requests N] [--concurrency C] [--rate R] [--batch-size 8] [--model-dir DIR] [--json OUT]

Both servers serve the same weights (``batchlab export-mlx`` writes them as an mlx-lm
folder, float32) on free 127.0.0.1 ports, started as subprocesses by
``batchlab.serverprocs`` (which also explains how ``mlx_lm.server`` gets OpenBLAS and which
batching flags it gets), warmed up with one short request, measured by
``batchlab.loadgen`` with the same workload and settings, and always stopped. They run in
turn, so each has both cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import batchlab  # first: makes MLX use OpenBLAS on Linux
from batchlab.cli import loadgen_workload
from batchlab.export import export_mlx
from batchlab.loadgen import LoadgenResult, run_loadgen
from batchlab.serverprocs import batchlab_spec, mlx_lm_spec, running

ROWS = [
    ("completed", "completed requests", "d"),
    ("failed", "failed requests", "d"),
    ("duration_s", "duration (s)", ".1f"),
    ("output_tokens", "output tokens", "d"),
    ("request_throughput", "requests/s", ".2f"),
    ("output_throughput", "output tokens/s", ".1f"),
    ("ttft_ms_mean", "TTFT mean (ms)", ".0f"),
    ("ttft_ms_p50", "TTFT p50 (ms)", ".0f"),
    ("ttft_ms_p99", "TTFT p99 (ms)", ".0f"),
    ("tpot_ms_mean", "TPOT mean (ms)", ".0f"),
    ("tpot_ms_p50", "TPOT p50 (ms)", ".0f"),
    ("tpot_ms_p99", "TPOT p99 (ms)", ".0f"),
    ("itl_ms_mean", "ITL mean (ms)", ".0f"),
    ("itl_ms_p50", "ITL p50 (ms)", ".0f"),
    ("itl_ms_p99", "ITL p99 (ms)", ".0f"),
    ("goodput", "goodput (req/s)", ".2f"),
]


def side_by_side(results: dict[str, LoadgenResult]) -> str:
    names = list(results)
    summaries = {n: r.summary() for n, r in results.items()}
    lines = [f"{'':<20}" + "".join(f"{n:>17}" for n in names)]
    for key, label, fmt in ROWS:
        cells = ["-" if summaries[n][key] is None else format(summaries[n][key], fmt) for n in names]
        lines.append(f"{label:<20}" + "".join(f"{c:>17}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload", default="mixed", choices=["mixed", "high_variance", "sharegpt", "interference"]
    )
    parser.add_argument("--size", default="quick", choices=["quick", "full"])
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--slo-ttft", type=float, default=5.0)
    parser.add_argument("--slo-tpot", type=float, default=0.5)
    parser.add_argument("--model-dir", help="an existing `batchlab export-mlx` folder to reuse")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)

    lm = batchlab.load_model()
    workload = loadgen_workload(args.workload, lm.tokenizer, args.size, args.requests, args.seed)
    warmup = workload.head(1).capped(4)
    print(
        f"workload: {workload.description}; concurrency {args.concurrency or 'unlimited'}, "
        f"rate {args.rate or 'all at once'}",
        flush=True,
    )
    results, infos = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "smollm2-mlx"
        if not (model_dir / "config.json").exists():
            export_mlx(lm, model_dir)
        del lm  # the servers load their own copies
        for spec in (batchlab_spec(args.batch_size), mlx_lm_spec(model_dir, args.batch_size)):
            with running(spec) as server:
                infos[spec.name] = {"command": " ".join(spec.command), "env": spec.env, "blas": server.blas}
                print(f"{spec.name}: ready; OpenBLAS in the server: {server.blas}", flush=True)
                run_loadgen(server.base_url, warmup, model=spec.model, progress=False)
                results[spec.name] = run_loadgen(
                    server.base_url,
                    workload,
                    model=spec.model,
                    concurrency=args.concurrency,
                    rate=args.rate,
                    seed=args.seed,
                    slo_ttft_s=args.slo_ttft,
                    slo_tpot_s=args.slo_tpot,
                )
    table = side_by_side(results)
    print(f"\n{table}\n(goodput: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(["benchmarks/serving_side_by_side.py"] + sys.argv[1:]),
                    "workload": workload.description,
                    "batch_size": args.batch_size,
                    "table": table,
                    "servers": {n: {**infos[n], **results[n].to_json()} for n in results},
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
