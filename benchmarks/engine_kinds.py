"""Every engine kind on the lessons' fixed mixed workload at batch 8 and 16, in one run.

    .venv/bin/python benchmarks/engine_kinds.py [--json OUT]

Prints throughput, TTFT and TBT (p50, p99) per kind; same configurations as
``batchlab bench`` (``batchlab.measurement.bench.engines``), sequential as the baseline.
"""

from __future__ import annotations

import argparse
import json
import sys

import batchlab  # first: makes MLX use OpenBLAS on Linux
from batchlab.measurement import driver, workloads
from batchlab.core import metrics
from batchlab.measurement.bench import engines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    lm = batchlab.load_model()
    wl = workloads.mixed(lm.tokenizer)
    print(f"workload: {wl.description}")
    configs = [("sequential", 1, dict(kind="sequential"))]
    configs += [(name, b, cfg) for b in (8, 16) for name, cfg in engines(b).items()]
    rows = []
    print(
        f"{'engine':>11} {'B':>3} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TBT p50':>8} {'TBT p99':>8}"
    )
    for name, b, cfg in configs:
        cfg = dict(cfg)
        trace = driver.run_workload(batchlab.make_engine(cfg.pop("kind"), lm, **cfg), wl, progress=False)
        s = metrics.summarize(trace)
        rows.append({"engine": name, "batch_size": b, **s})
        print(
            f"{name:>11} {b:>3} {s['output_tokens_per_s']:>7.1f} {s['ttft_p50_s']:>9.2f} "
            f"{s['ttft_p99_s']:>9.2f} {s['tbt_p50_s']:>8.3f} {s['tbt_p99_s']:>8.3f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": wl.summary(), "runs": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
