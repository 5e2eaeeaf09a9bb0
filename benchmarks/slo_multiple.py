"""Which multiple of the decode step should the stall-free engine's TBT target be?

The stall-free engine's token budget is the largest whose step the cost model predicts
within its target (``costmodel.token_budget_for_slo``); the default target is
``costmodel.DEFAULT_SLO_DECODE_STEPS`` predicted decode steps of a full batch. This runs the
bench's interference workload (long prompts arriving while short ones decode, B=8) on the
naive continuous engine and on stall-free engines whose budgets come from several
multiples, interleaved, ``--repetitions`` times, and reports for each multiple its budget,
p99 TBT as a multiple of the naive engine's measured decode step, and tokens/s over the
naive engine's: the two halves of the bench's stall-free goal (<= 2 steps at >= 0.95).

    .venv/bin/python benchmarks/slo_multiple.py --json docs/results/slo_multiple.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import batchlab  # noqa: F401  (OpenBLAS before MLX)
from batchlab.measurement import bench, workloads
from batchlab.core import costmodel, metrics
from batchlab.model.load import load_model

BATCH = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--multiples", type=float, nargs="+", default=[1.25, 1.5, 1.75, 2.0])
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()

    lm = load_model()
    wl = workloads.interference(lm.tokenizer, batch_size=BATCH, num_long=2, long_range=(512, 1024))
    cost = costmodel.CostModel.load()
    step = costmodel.predicted_decode_step_s(cost, BATCH)
    budgets = {m: costmodel.token_budget_for_slo(cost, BATCH, m * step) for m in args.multiples}
    engines = {f"x{m}": dict(kind="stallfree", token_budget=b) for m, b in budgets.items()}
    runs = {name: [] for name in ["continuous", *engines]}
    started, loads = time.time(), [os.getloadavg()[0]]
    for rep in range(args.repetitions):
        for name in runs:  # interleaved: every engine once a repetition
            before = bench.cpu_seconds()
            t0 = time.perf_counter()
            trace = bench.run_engine(lm, wl, BATCH, name, False, extra_engines=engines)
            share = bench.others_share(before, bench.cpu_seconds(), time.perf_counter() - t0)
            runs[name].append((trace, share))
            loads.append(os.getloadavg()[0])
            print(f"repetition {rep + 1}: {name} done", flush=True)

    rows = []
    for m, name in zip(args.multiples, engines):
        p99_steps, tokps = [], []
        for (trace, _), (naive, _) in zip(runs[name], runs["continuous"]):
            naive_step = metrics.decode_step_s(naive, BATCH - 1)
            p99_steps.append(metrics.percentile(metrics.tbt_values(trace), 99) / naive_step)
            tokps.append(metrics.output_tokens_per_s(trace) / metrics.output_tokens_per_s(naive))
        rows.append(
            {
                "multiple": m,
                "token_budget": budgets[m],
                "p99_tbt_over_decode_step": statistics.median(p99_steps),
                "p99_range": [min(p99_steps), max(p99_steps)],
                "tokps_over_naive": statistics.median(tokps),
                "tokps_range": [min(tokps), max(tokps)],
                "meets_goal": statistics.median(p99_steps) <= 2 and statistics.median(tokps) >= 0.95,
            }
        )
    shares = [s for r in runs.values() for _, s in r if s is not None]
    result = {
        "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "seconds": time.time() - started,
        "repetitions": args.repetitions,
        "batch_size": BATCH,
        "default_multiple": costmodel.DEFAULT_SLO_DECODE_STEPS,
        "predicted_decode_step_s": step,
        "load_average_range": [min(loads), max(loads)],
        "max_others_cpu_share": max(shares) if shares else None,
        "rows": rows,
    }
    print(
        f"interference workload, B={BATCH}, median of {args.repetitions} interleaved repetitions "
        f"(min-max); load average {min(loads):.1f}-{max(loads):.1f}, others took at most "
        f"{result['max_others_cpu_share'] or 0:.0%} of the CPUs"
    )
    print(f"{'multiple':>8}  {'budget':>6}  {'p99 TBT / step':>18}  {'tok/s / naive':>20}  goal")
    for r in rows:
        print(
            f"{r['multiple']:>8}  {r['token_budget']:>6}  "
            f"{r['p99_tbt_over_decode_step']:5.2f} ({r['p99_range'][0]:.2f}-{r['p99_range'][1]:.2f})  "
            f"{r['tokps_over_naive']:6.3f} ({r['tokps_range'][0]:.3f}-{r['tokps_range'][1]:.3f})  "
            f"{'met' if r['meets_goal'] else 'missed'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
