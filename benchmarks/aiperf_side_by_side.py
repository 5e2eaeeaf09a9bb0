"""An independent client beside ours: NVIDIA's aiperf and ``batchlab loadgen`` on the same
servers, with the same prompts and settings.

    .venv/bin/python benchmarks/aiperf_side_by_side.py [--requests 48] [--concurrency 8]
        [--isl 128] [--osl 32] [--seed 0] [--rounds 3] [--batch-size 8] [--model-dir DIR]
        [--json OUT.json] [--md OUT.md]

(``scripts/setup.sh --test`` installs aiperf in ``.venv-aiperf``, apart from the course's
environment: it brings Dash, whose JupyterLab extension would break the lessons' JupyterLab.)

Both servers serve the same weights: ``batchlab serve`` (stall-free, ``--batch-size`` slots)
and ``mlx_lm.server`` on the folder ``batchlab export-mlx`` writes (the same number of
decode and prefill slots, OpenBLAS preloaded: see ``batchlab.serving.serverprocs``), on free
127.0.0.1 ports. aiperf makes ``--requests`` synthetic chat prompts of exactly ``--isl``
tokens (its tokenizer is the exported folder, so it runs offline) from ``--seed`` and asks
for exactly ``--osl`` tokens each, ``--concurrency`` in flight, streamed, greedy
(``temperature`` 0). Our load generator then sends the very same messages (read from
aiperf's ``inputs.json``) with the same ``max_tokens``, concurrency and body.

Fixed output lengths: ``batchlab serve`` honours vLLM's ``ignore_eos``, which both clients
send. ``mlx_lm.server`` ignores it (and every unknown field), so it also gets
``logit_bias`` banning the EOS tokens, which it does honour. Every answer's length is
checked, by the server's usage count, to be exactly ``--osl``; the table says if not.

Each round starts a fresh server for each client (so mlx_lm.server's prompt cache cannot
carry one client's prompts over to the other), warms it with one short request, and runs
the clients in turn: batchlab then mlx-lm, aiperf first in even rounds and ours first in
odd ones, so a slow minute of a shared machine does not land on one side. A figure's noise
is its range (min-max) over the rounds; the two clients *agree* on a figure when their
ranges overlap (``metrics.ranges_overlap``: the rounds cannot tell them apart).

The figures, matched by definition (aiperf's names in brackets):
TTFT [time_to_first_token], TPOT = (latency - TTFT) / (tokens - 1) [inter_token_latency],
ITL = every gap between text chunks [inter_chunk_latency], output tokens/s over the run
[output_token_throughput], requests/s [request_throughput].
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import batchlab  # first: makes MLX use OpenBLAS on Linux
from batchlab.model.export import export_mlx
from batchlab.serving.loadgen import LoadgenResult, first_model, run_loadgen
from batchlab.core.metrics import median_range, ranges_overlap
from batchlab.serving.serverprocs import ServerSpec, batchlab_spec, mlx_lm_spec, running
from batchlab.measurement.workloads import Workload, WorkloadRequest

# (our summary key, aiperf's metric and statistic, label, format)
FIGURES = [
    ("output_throughput", "output_token_throughput", "avg", "output tokens/s", ".1f"),
    ("request_throughput", "request_throughput", "avg", "requests/s", ".3f"),
    ("ttft_ms_mean", "time_to_first_token", "avg", "TTFT mean (ms)", ".0f"),
    ("ttft_ms_p50", "time_to_first_token", "p50", "TTFT p50 (ms)", ".0f"),
    ("ttft_ms_p99", "time_to_first_token", "p99", "TTFT p99 (ms)", ".0f"),
    ("tpot_ms_mean", "inter_token_latency", "avg", "TPOT mean (ms)", ".1f"),
    ("tpot_ms_p50", "inter_token_latency", "p50", "TPOT p50 (ms)", ".1f"),
    ("tpot_ms_p99", "inter_token_latency", "p99", "TPOT p99 (ms)", ".1f"),
    ("itl_ms_mean", "inter_chunk_latency", "avg", "ITL mean (ms)", ".1f"),
    ("itl_ms_p50", "inter_chunk_latency", "p50", "ITL p50 (ms)", ".1f"),
    ("itl_ms_p99", "inter_chunk_latency", "p99", "ITL p99 (ms)", ".1f"),
]


# --pin: where the servers and the clients run (taskset; the load generator pins itself)
SERVER_CPU = ["taskset", "-c", "0"]
CLIENT_CPU = ["taskset", "-c", "1"]


AIPERF_HOME = Path(__file__).resolve().parents[1] / ".venv-aiperf" / "bin" / "aiperf"


def aiperf_command() -> str:
    """The aiperf of ``.venv-aiperf`` (``scripts/setup.sh --test``), else the one on PATH."""
    found = str(AIPERF_HOME) if AIPERF_HOME.exists() else shutil.which("aiperf")
    if found is None:
        raise SystemExit("aiperf is not installed: bash scripts/setup.sh --test puts it in .venv-aiperf")
    return found


def aiperf_args(
    base_url: str, model: str, tokenizer_dir: Path, out: Path, body: dict, args, endpoint: str = "chat"
) -> list[str]:
    """One aiperf run: fixed ISL and OSL, one seed, server-side token counts, no UI, no
    GPU or server-metrics scraping (nothing but the requests reaches the server)."""
    command = [
        aiperf_command(),
        "profile",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer_dir),
        "--url",
        base_url,
        "--endpoint-type",
        endpoint,
        "--isl",
        str(args.isl),
        "--isl-stddev",
        "0",
        "--osl",
        str(args.osl),
        "--osl-stddev",
        "0",
        "--extra-inputs",
        json.dumps(body),
        "--request-count",
        str(args.requests),
        "--concurrency",
        str(args.concurrency),
        "--random-seed",
        str(args.seed),
        "--use-server-token-count",
        "--workers-max",
        "1",
        "--record-processors",
        "1",
        "--ui-type",
        "none",
        "--no-gpu-telemetry",
        "--no-server-metrics",
        "--artifact-dir",
        str(out),
    ]
    return command + (["--streaming"] if args.streaming else [])


def aiperf_env() -> dict:
    """aiperf reads the tokenizer from the folder it is given; HF_HUB_OFFLINE would make it
    look in a hub cache instead, so it is taken out."""
    return {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}


def run_aiperf(command: list[str], out: Path, timeout_s: float) -> dict:
    """Run aiperf; return its summary (``profile_export_aiperf.json``) with every request's
    record (``profile_export.jsonl``) under ``"records"`` and the payloads it sent
    (``inputs.json``) under ``"inputs"``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, env=aiperf_env(), capture_output=True, text=True, timeout=timeout_s)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    lines = (out / "profile_export.jsonl").read_text().splitlines()
    summary["records"] = [json.loads(line) for line in lines if line.strip()]
    summary["inputs"] = json.loads((out / "inputs.json").read_text())["data"]
    # aiperf's processes (it waits for its own), all of their CPU time
    summary["client_cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return summary


def record_value(record: dict, metric: str):
    value = record.get("metrics", {}).get(metric)
    return None if value is None else value["value"]


BURST_GAP_S = 0.05  # sends closer than this to the one before belong to one burst


def send_pattern(starts: list[float]) -> dict:
    """When a client sent its requests: seconds from its first send, and how many bursts
    (sends within ``BURST_GAP_S`` of the previous one) they came in. A closed loop whose
    answers all have one length sends in waves; a client slow to notice an answer spreads
    its sends out, and a server that batches prompts only as they come sees more, smaller
    prefills."""
    offsets = sorted(t - min(starts) for t in starts) if starts else []
    bursts = 1 + sum(b - a > BURST_GAP_S for a, b in zip(offsets, offsets[1:])) if offsets else 0
    return {"send_offsets_s": [round(t, 4) for t in offsets], "send_bursts": bursts}


def aiperf_figures(summary: dict, osl: int) -> dict:
    """aiperf's figures under our summary's keys, plus what the run's requests came to."""
    out = {}
    for ours, metric, stat, _, _ in FIGURES:
        out[ours] = (summary.get(metric) or {}).get(stat)
    lengths = [record_value(r, "output_sequence_length") for r in summary["records"]]
    errors = [r for r in summary["records"] if r.get("error")]
    out.update(
        completed=len(summary["records"]) - len(errors),
        failed=len(errors),
        duration_s=(summary.get("benchmark_duration") or {}).get("avg"),
        output_tokens=sum(n for n in lengths if n is not None),
        output_lengths=sorted({n for n in lengths if n is not None}),
        fixed_lengths=bool(lengths) and all(n == osl for n in lengths) and not errors,
        prompt_tokens=sorted({record_value(r, "input_sequence_length") for r in summary["records"]}),
        client_cpu_s=summary["client_cpu_s"],
        **send_pattern([r["metadata"]["request_start_ns"] / 1e9 for r in summary["records"]]),
    )
    return out


def loadgen_figures(result: LoadgenResult, osl: int) -> dict:
    s = result.summary()
    out = {ours: s[ours] for ours, *_ in FIGURES}
    lengths = [r.output_tokens for r in result.requests if r.ok]
    out.update(
        completed=s["completed"],
        failed=s["failed"],
        duration_s=s["duration_s"],
        output_tokens=s["output_tokens"],
        output_lengths=sorted(set(lengths)),
        fixed_lengths=s["failed"] == 0
        and all(n == osl for n in lengths)
        and all(r.tokens_from == "usage" for r in result.requests),
        prompt_tokens=None,
        **send_pattern([r.sent_s for r in result.requests]),
    )
    return out


def workload_from_inputs(inputs: list[dict], osl: int) -> Workload:
    """The messages aiperf sent, as a workload for our load generator (one request each)."""
    requests = []
    for i, session in enumerate(inputs):
        (payload,) = session["payloads"]
        requests.append(WorkloadRequest(f"aiperf-{i:03d}", [], osl, messages=payload["messages"]))
    return Workload("aiperf-prompts", f"{len(requests)} aiperf synthetic chat prompts", requests)


def warm_up(base_url: str, model: str) -> None:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()


def bodies(lm) -> dict[str, dict]:
    """What each server is sent besides the prompt: greedy, and EOS out of the way."""
    common = {"temperature": 0, "ignore_eos": True}
    ban_eos = {str(t): -1e9 for t in sorted(lm.tokenizer.eos_token_ids)}
    return {"batchlab serve": common, "mlx_lm.server": {**common, "logit_bias": ban_eos}}


def compare(figures: dict[str, dict[str, list[dict]]]) -> dict:
    """Per server and figure: each client's median and range over the rounds, their
    difference (loadgen over aiperf - 1) and whether the ranges overlap."""
    table = {}
    for server, clients in figures.items():
        rows = {}
        for ours, *_ in FIGURES + [("duration_s",)]:
            a, a_span = median_range([f[ours] for f in clients["aiperf"]], lambda v: v)
            b, b_span = median_range([f[ours] for f in clients["loadgen"]], lambda v: v)
            rows[ours] = {
                "aiperf": a,
                "aiperf_range": a_span,
                "loadgen": b,
                "loadgen_range": b_span,
                "loadgen_over_aiperf": (b / a - 1) if a and b is not None else None,
                "agree": ranges_overlap(a_span, b_span),
            }
        table[server] = rows
    return table


def format_table(comparison: dict, rounds: int) -> str:
    names = list(comparison)
    head = f"{'':<18}" + "".join(f"{n + ': aiperf':>24}{'ours':>24}{'':>10}" for n in names)
    lines = [f"median of {rounds} round(s) (min-max); 'same' where the ranges overlap", head]

    def cell(value, span, fmt):
        if value is None:
            return "-"
        return f"{value:{fmt}}" + (f" ({span[0]:{fmt}}-{span[1]:{fmt}})" if rounds > 1 else "")

    for ours, _, _, label, fmt in FIGURES:
        line = f"{label:<18}"
        for n in names:
            row = comparison[n][ours]
            diff = row["loadgen_over_aiperf"]
            verdict = "same" if row["agree"] else (f"{diff:+.0%}" if diff is not None else "-")
            line += f"{cell(row['aiperf'], row['aiperf_range'], fmt):>24}"
            line += f"{cell(row['loadgen'], row['loadgen_range'], fmt):>24}{verdict:>10}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--isl", type=int, default=128, help="prompt tokens (aiperf's tokenizer)")
    parser.add_argument("--osl", type=int, default=32, help="output tokens, exactly")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="decode slots of both servers")
    parser.add_argument("--no-streaming", dest="streaming", action="store_false")
    parser.add_argument("--servers", default="batchlab,mlx-lm", help="comma-separated: batchlab, mlx-lm")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="servers on CPU 0, clients on CPU 1 (Linux): no client takes the server's core",
    )
    parser.add_argument("--model-dir", help="an existing `batchlab export-mlx` folder to reuse")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--md", metavar="OUT", help="a short report beside the JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1:
        parser.error("--rounds, --requests and --concurrency must be at least 1")
    if not args.streaming:
        parser.error("our load generator streams; --no-streaming is for aiperf alone (tests/test_aiperf.py)")

    lm = batchlab.load_model()
    extra = bodies(lm)
    results: dict[str, dict[str, list]] = {}
    loads = []
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = Path(args.model_dir) if args.model_dir else tmp / "smollm2-mlx"
        if not (model_dir / "config.json").exists():
            export_mlx(lm, model_dir)
        hub = tmp / "hf-cache"  # mlx_lm.server's /v1/models lists this (empty) cache
        hub.mkdir()
        mlx = mlx_lm_spec(model_dir, args.batch_size)
        mlx = ServerSpec(mlx.name, mlx.command, {**mlx.env, "HF_HUB_CACHE": str(hub)}, mlx.model)
        specs = {"batchlab": batchlab_spec(args.batch_size), "mlx-lm": mlx}
        chosen = [specs[name] for name in args.servers.split(",")]
        if args.pin:
            chosen = [ServerSpec(c.name, [*SERVER_CPU, *c.command], c.env, c.model) for c in chosen]
        workload = None
        for rnd in range(args.rounds):
            for spec in chosen:
                order = ("aiperf", "loadgen") if rnd % 2 == 0 else ("loadgen", "aiperf")
                for client in order:
                    with running(spec) as server:
                        model = spec.model or first_model(server.base_url)
                        warm_up(server.base_url, model)
                        before = os.getloadavg()[0]
                        print(f"round {rnd + 1}/{args.rounds}: {client} -> {spec.name}", flush=True)
                        body = extra[spec.name]
                        if client == "aiperf":
                            out = tmp / f"aiperf-{spec.name.split()[0]}-{rnd}"
                            command = aiperf_args(server.base_url, model, model_dir, out, body, args)
                            if args.pin:
                                command = [*CLIENT_CPU, *command]
                            summary = run_aiperf(command, out, timeout_s=3600)
                            if workload is None:
                                workload = workload_from_inputs(summary["inputs"], args.osl)
                            figures = aiperf_figures(summary, args.osl)
                            figures["command"] = " ".join(command[1:])
                        else:
                            if workload is None:
                                raise SystemExit("aiperf runs first in the first round")
                            cpu = time.process_time()  # the servers are other processes
                            own = os.sched_getaffinity(0)
                            if args.pin:
                                os.sched_setaffinity(0, {int(CLIENT_CPU[-1])})
                            result = run_loadgen(
                                server.base_url,
                                workload,
                                model=model,
                                concurrency=args.concurrency,
                                seed=args.seed,
                                progress=False,
                                extra_body=body,
                            )
                            os.sched_setaffinity(0, own)
                            figures = loadgen_figures(result, args.osl)
                            figures["client_cpu_s"] = time.process_time() - cpu
                        figures["load_before_after"] = [before, os.getloadavg()[0]]
                        figures["blas"] = server.blas
                        loads.append(figures["load_before_after"])
                        results.setdefault(spec.name, {}).setdefault(client, []).append(figures)
                        print(
                            f"  {figures['output_throughput']:.1f} tok/s, TTFT p50 "
                            f"{figures['ttft_ms_p50']:.0f} ms, TPOT p50 {figures['tpot_ms_p50']:.1f} ms, "
                            f"output lengths {figures['output_lengths']}; sent in "
                            f"{figures['send_bursts']} bursts; the client took "
                            f"{figures['client_cpu_s']:.1f} CPU s in {figures['duration_s']:.1f} s",
                            flush=True,
                        )
        commands = {spec.name: " ".join(spec.command[1:]) for spec in chosen}
    comparison = compare(results)
    table = format_table(comparison, args.rounds)
    fixed = {
        n: all(f["fixed_lengths"] for runs in clients.values() for f in runs)
        for n, clients in results.items()
    }
    print("\n" + table)
    for name, ok in fixed.items():
        print(f"{name}: every answer exactly {args.osl} tokens by the server's count: {ok}")
    record = {
        "command": " ".join(["benchmarks/aiperf_side_by_side.py"] + (argv or sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        "minutes": (time.time() - started) / 60,
        "settings": {k: getattr(args, k) for k in ("requests", "concurrency", "isl", "osl", "seed", "rounds")}
        | {"batch_size": args.batch_size, "streaming": args.streaming, "pin": args.pin},
        "bodies": extra,
        "servers": commands,
        "load_average_1min": [min(x for pair in loads for x in pair), max(x for pair in loads for x in pair)],
        "fixed_lengths": fixed,
        "table": table,
        "comparison": comparison,
        "runs": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.md:
        Path(args.md).write_text(report(record))
        print(f"wrote {args.md}")
    return 0


def report(record: dict) -> str:
    """The short Markdown report: settings, the table, and the agreement in words."""
    s = record["settings"]
    lines = [
        "# aiperf beside `batchlab loadgen`, on `batchlab serve` and `mlx_lm.server`",
        "",
        f"Measured {record['date']} ({record['minutes']:.0f} minutes) with:",
        "",
        "```bash",
        f".venv/bin/python {record['command']}",
        "```",
        "",
        f"{s['requests']} streamed chat requests, {s['concurrency']} in flight, prompts of {s['isl']} tokens "
        f"(aiperf's synthetic text, seed {s['seed']}; the same messages for both clients), exactly "
        f"{s['osl']} output tokens, greedy; {s['batch_size']} decode slots in both servers; "
        f"{s['rounds']} rounds, a fresh server for every client and round. Load average (1 min) "
        f"during the runs: {record['load_average_1min'][0]:.1f}-{record['load_average_1min'][1]:.1f}.",
        "",
        "```text",
        record["table"],
        "```",
        "",
    ]
    for server, ok in record["fixed_lengths"].items():
        lines.append(
            f"- {server}: every answer was exactly {s['osl']} tokens by the server's usage count: "
            f"{'yes' if ok else 'NO'}."
        )
    for server, rows in record["comparison"].items():
        apart = [k for k, row in rows.items() if not row["agree"] and k != "duration_s"]
        said = (
            "the two clients agree on every figure (their ranges over the rounds overlap)"
            if not apart
            else "they differ beyond the rounds' noise on "
            + ", ".join(f"{k} ({rows[k]['loadgen_over_aiperf']:+.1%})" for k in apart)
        )
        lines.append(f"- {server}: {said}.")
    for server, clients in record["runs"].items():
        said = []
        for client, runs in clients.items():
            cpu = median_range([f["client_cpu_s"] / f["duration_s"] for f in runs], lambda v: v)[0]
            bursts = median_range([f["send_bursts"] for f in runs], lambda v: v)[0]
            said.append(f"{client} took {cpu:.2f} CPU s a second of its run and sent in {bursts:.0f} bursts")
        lines.append(
            f"- {server}, medians over the rounds (CPU: start-up included): " + "; ".join(said) + "."
        )
    names = list(record["comparison"])
    if len(names) == 2:
        a, b = names
        for client in ("aiperf", "loadgen"):
            x = record["comparison"][a]["output_throughput"][client]
            y = record["comparison"][b]["output_throughput"][client]
            if x and y:
                lines.append(f"- {a} over {b}, output tokens/s, by {client}: {x / y:.2f}x.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
