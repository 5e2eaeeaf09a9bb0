"""``batchlab bench``: every engine of ours and mlx-lm's BatchGenerator on the same
workloads, in one run, so the ratios between them are fair on a noisy machine.

Prints a table, writes a JSON with every run's metrics plus the headline ``figures``,
and saves plots next to the JSON.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from . import metrics, microbench, workloads
from .engine import make_engine
from .model import LoadedModel
from .peers import run_mlxlm_workload
from .trace import Trace

CHUNK = 128  # the chunked continuous engine's prefill_step


def stallfree_budget(batch_size: int) -> int:
    """Decodes plus a prefill chunk of ~2 decode steps' worth of tokens: on a 2-core CPU a
    prefill token costs about what a decode row does, so a step stays near 2x a decode step."""
    return batch_size + 2 * batch_size


def engines(batch_size: int) -> dict[str, dict]:
    """Our engine configurations at one batch size (name -> make_engine arguments)."""
    return {
        "static": dict(kind="static", max_batch_size=batch_size),
        "continuous": dict(kind="continuous", max_batch_size=batch_size),
        "chunked": dict(kind="continuous", max_batch_size=batch_size, prefill_step=CHUNK),
        "stallfree": dict(kind="stallfree", max_batch_size=batch_size,
                          token_budget=stallfree_budget(batch_size)),
    }


def plan(lm: LoadedModel, quick: bool) -> list[tuple[str, workloads.Workload, list[int]]]:
    """(name, workload, batch sizes) of every experiment."""
    tok = lm.tokenizer
    if quick:
        return [
            ("high_variance", workloads.high_variance(tok, num_requests=12, mean_output=16,
                                                       max_output=64), [8, 16]),
            ("interference", workloads.interference(tok, batch_size=8, num_long=1,
                                                     long_range=(512, 640)), [8]),
        ]
    return [
        ("high_variance", workloads.high_variance(tok, size="quick"), [8, 16]),
        ("sharegpt", workloads.sharegpt(tok, size="quick"), [8, 16]),
        ("interference", workloads.interference(tok, batch_size=8), [8]),
        ("interference_b16", workloads.interference(tok, batch_size=16), [16]),
    ]


def run_bench(lm: LoadedModel, quick: bool = False, json_out: str | None = None,
              progress: bool = True) -> dict:
    started = time.time()
    runs: list[dict] = []
    traces: dict[tuple[str, int, str], Trace] = {}
    experiments = plan(lm, quick)
    for name, wl, batch_sizes in experiments:
        if name == "high_variance":  # the baseline, once: it has no batch size
            trace = workloads.run_workload(make_engine("sequential", lm), wl, progress=progress)
            traces[(name, 1, "sequential")] = trace
        for b in batch_sizes:
            for engine_name, args in engines(b).items():
                args = dict(args)
                trace = workloads.run_workload(make_engine(args.pop("kind"), lm, **args), wl,
                                               progress=progress)
                traces[(name, b, engine_name)] = trace
            traces[(name, b, "mlx-lm")] = run_mlxlm_workload(lm, wl, b, progress=progress)
    for (name, b, engine_name), trace in traces.items():
        runs.append({"workload": name, "batch_size": b, "engine": engine_name,
                     **metrics.summarize(trace)})
    fused = microbench.fused_step_ratio(lm)
    scaling = microbench.decode_scaling(lm, [1, 16])
    figures = headline_figures(traces, experiments, fused, scaling)
    result = {
        "machine": f"{platform.system()} {platform.machine()}", "quick": quick,
        "model": lm.info.name, "dtype": lm.info.dtype, "backend": lm.info.backend,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": time.time() - started,
        "workloads": {name: wl.summary() for name, wl, _ in experiments},
        "runs": runs, "fused_step": fused, "decode_scaling": scaling, "figures": figures,
    }
    if json_out:
        out = Path(json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        save_plots(traces, out.with_suffix(""))
    return result


def headline_figures(traces, experiments, fused: dict, scaling: dict) -> dict:
    """The ratios the README quotes, each computed from runs of this same invocation."""
    def tokps(key):
        return metrics.output_tokens_per_s(traces[key]) if key in traces else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    hv_b = max(b for name, _, bs in experiments if name == "high_variance" for b in bs)
    ours = {e: tokps(("high_variance", hv_b, e)) for e in engines(hv_b)}
    best = max(ours, key=lambda e: ours[e] or 0)
    name_if, _, (b_if, *_) = next(x for x in experiments if x[0].startswith("interference"))
    naive = traces[(name_if, b_if, "continuous")]
    # decode step: median decode-only step of the naive engine with every short request decoding
    step = metrics.decode_step_s(naive, b_if - 1)

    def p99_over_step(engine):
        return ratio(metrics.percentile(metrics.tbt_values(traces[(name_if, b_if, engine)]), 99), step)

    return {
        "continuous_over_static_tokps": ratio(ours["continuous"], ours["static"]),
        "ours_over_mlxlm_tokps": ratio(ours[best], tokps(("high_variance", hv_b, "mlx-lm"))),
        "ours_best_engine": best,
        "stallfree_p99_tbt_over_decode_step": p99_over_step("stallfree"),
        "naive_p99_tbt_over_decode_step": p99_over_step("continuous"),
        "mlxlm_p99_tbt_over_decode_step": p99_over_step("mlx-lm"),
        "stallfree_tokps_over_naive": ratio(tokps((name_if, b_if, "stallfree")),
                                            tokps((name_if, b_if, "continuous"))),
        "fused_over_chunk_alone": fused["fused_over_chunk_alone"],
        "b16_over_b1_decode": ratio(scaling[16]["tokens_per_s"], scaling[1]["tokens_per_s"]),
        "scheduler_overhead_share": metrics.scheduler_share(traces[("high_variance", hv_b, "stallfree")]),
        "decode_step_s": step,
        "batch_sizes": {"high_variance": hv_b, "interference": b_if},
    }


def format_table(result: dict) -> str:
    cols = [("workload", "workload", "{}"), ("B", "batch_size", "{}"), ("engine", "engine", "{}"),
            ("tok/s", "output_tokens_per_s", "{:.1f}"), ("TTFT p50", "ttft_p50_s", "{:.2f}"),
            ("TTFT p99", "ttft_p99_s", "{:.2f}"), ("TBT p50", "tbt_p50_s", "{:.3f}"),
            ("TBT p99", "tbt_p99_s", "{:.3f}"), ("TBT max", "tbt_max_s", "{:.3f}"),
            ("occupancy", "slot_occupancy", "{:.0%}")]
    rows = [[h for h, _, _ in cols]]
    for run in result["runs"]:
        rows.append([fmt.format(run[k]) if run.get(k) is not None else "-" for _, k, fmt in cols])
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    figs = result["figures"]
    lines.append("")
    lines += [f"{k:38s} {v:.3f}" if isinstance(v, float) else f"{k:38s} {v}" for k, v in figs.items()]
    return "\n".join(lines) + "\n(times in seconds)"


def save_plots(traces, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import viz

    paths = []
    fig, ax = plt.subplots(figsize=(10, 4))
    labels, values = [], []
    for (name, b, engine), trace in traces.items():
        labels.append(f"{name}\nB={b} {engine}")
        values.append(metrics.output_tokens_per_s(trace) or 0)
    ax.bar(range(len(values)), values, color=[viz.request_color(f"req-{i % 8}") for i in range(len(values))])
    ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput of every run")
    fig.tight_layout()
    paths.append(stem.parent / f"{stem.name}_throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    inter = {f"B={b} {e}": t for (n, b, e), t in traces.items() if n.startswith("interference")}
    if inter:
        fig = viz.plot_latency_cdfs(inter)
        paths.append(stem.parent / f"{stem.name}_interference_latency.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
