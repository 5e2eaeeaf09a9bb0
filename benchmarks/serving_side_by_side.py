"""The same load against ``batchlab serve`` and ``mlx_lm.server``, interleaved repetitions.

    .venv/bin/python benchmarks/serving_side_by_side.py [--workload chat|mixed|...] [--size quick]
        [--requests N] [--concurrency C] [--rate R] [--batch-size 16] [--repetitions 3]
        [--model-dir DIR] [--json OUT]

Both servers serve the same weights (``batchlab export-mlx`` writes them as an mlx-lm
folder, float32) on free 127.0.0.1 ports, started as subprocesses by
``batchlab.serving.serverprocs`` (which also explains how ``mlx_lm.server`` gets OpenBLAS and which
batching flags it gets), warmed up with one short request, measured by
``batchlab.serving.loadgen`` with the same workload and settings, and always stopped. They run in
turn, so each has both cores.

Each of the ``--repetitions`` rounds (3 by default) starts and measures each server in turn
(batchlab, mlx-lm, batchlab, mlx-lm, ...), so a slow minute of a shared machine lands on
both instead of one. The table reports each figure's median over the rounds and its range
(min-max); the JSON has the medians, the ranges and every round's full result.
The defaults are the standard bench's chat experiment: its 32 chat requests (``--workload
chat --size quick``), all sent at once, and 16 decode slots (``--batch-size 16``), so this
table and the README's bench can be read side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import batchlab  # first: makes MLX use OpenBLAS on Linux
from batchlab.cli import loadgen_workload
from batchlab.model.export import export_mlx
from batchlab.serving.loadgen import LoadgenResult, run_loadgen
from batchlab.serving.serverprocs import batchlab_spec, mlx_lm_spec, running
from batchlab.measurement.workloads import WORKLOADS

CHOICES = [w for w in ("mixed", "chat", "high_variance", "sharegpt", "interference") if w in WORKLOADS]

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


def medians_and_ranges(results: dict[str, list[LoadgenResult]]) -> tuple[dict, dict]:
    """Each server's median of every table figure over its rounds, and its [min, max]
    (None where no round has the figure)."""
    medians, ranges = {}, {}
    for name, runs in results.items():
        summaries = [r.summary() for r in runs]
        medians[name], ranges[name] = {}, {}
        for key, _, _ in ROWS:
            values = [s[key] for s in summaries if s[key] is not None]
            medians[name][key] = statistics.median(values) if values else None
            ranges[name][key] = [min(values), max(values)] if values else None
    return medians, ranges


def side_by_side(medians: dict[str, dict], ranges: dict[str, dict], repetitions: int) -> str:
    """The table: a row per figure, a column per server; the median, and with more than
    one round its range in brackets."""
    names = list(medians)
    width = 26 if repetitions > 1 else 17

    def number(value, fmt):  # a count's median may fall between two counts
        if fmt == "d":
            return str(int(value)) if value == int(value) else f"{value:.1f}"
        return format(value, fmt)

    def cell(name, key, fmt):
        value, span = medians[name][key], ranges[name][key]
        if value is None:
            return "-"
        if repetitions == 1:
            return number(value, fmt)
        return f"{number(value, fmt)} ({number(span[0], fmt)}-{number(span[1], fmt)})"

    head = f"median of {repetitions} interleaved rounds (min-max)" if repetitions > 1 else "one round"
    lines = [head, f"{'':<20}" + "".join(f"{n:>{width}}" for n in names)]
    for key, label, fmt in ROWS:
        lines.append(f"{label:<20}" + "".join(f"{cell(n, key, fmt):>{width}}" for n in names))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="chat", choices=CHOICES)
    parser.add_argument("--size", default="quick", choices=["quick", "full"])
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--slo-ttft", type=float, default=5.0)
    parser.add_argument("--slo-tpot", type=float, default=0.5)
    parser.add_argument("--repetitions", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--model-dir", help="an existing `batchlab export-mlx` folder to reuse")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    if args.repetitions < 1:
        parser.error("--repetitions must be at least 1")

    lm = batchlab.load_model()
    workload = loadgen_workload(args.workload, lm.tokenizer, args.size, args.requests, args.seed)
    warmup = workload.head(1).capped(4)
    print(
        f"workload: {workload.description}; concurrency {args.concurrency or 'unlimited'}, "
        f"rate {args.rate or 'all at once'}",
        flush=True,
    )
    results: dict[str, list[LoadgenResult]] = {}
    infos: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "smollm2-mlx"
        if not (model_dir / "config.json").exists():
            export_mlx(lm, model_dir)
        del lm  # the servers load their own copies
        specs = (batchlab_spec(args.batch_size), mlx_lm_spec(model_dir, args.batch_size))
        for rep in range(args.repetitions):
            for spec in specs:  # a fresh server every round
                with running(spec) as server:
                    infos[spec.name] = {
                        "command": " ".join(spec.command),
                        "env": spec.env,
                        "blas": server.blas,
                    }
                    print(
                        f"round {rep + 1}/{args.repetitions}, {spec.name}: ready; "
                        f"OpenBLAS in the server: {server.blas}",
                        flush=True,
                    )
                    run_loadgen(server.base_url, warmup, model=spec.model, progress=False)
                    results.setdefault(spec.name, []).append(
                        run_loadgen(
                            server.base_url,
                            workload,
                            model=spec.model,
                            concurrency=args.concurrency,
                            rate=args.rate,
                            seed=args.seed,
                            slo_ttft_s=args.slo_ttft,
                            slo_tpot_s=args.slo_tpot,
                        )
                    )
    medians, ranges = medians_and_ranges(results)
    table = side_by_side(medians, ranges, args.repetitions)
    print(f"\n{table}\n(goodput: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(["benchmarks/serving_side_by_side.py"] + sys.argv[1:]),
                    "workload": workload.description,
                    "batch_size": args.batch_size,
                    "repetitions": args.repetitions,
                    "table": table,
                    "labels": {key: label for key, label, _ in ROWS},
                    "medians": medians,
                    "ranges": ranges,
                    "servers": {
                        n: {
                            **infos[n],
                            "rounds": [r.summary() for r in results[n]],
                            "runs": [r.to_json() for r in results[n]],
                        }
                        for n in results
                    },
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
