"""The same load against ``batchlab serve`` and ``mlx_lm.server``, one after the other.

    .venv/bin/python benchmarks/serving_side_by_side.py [--workload mixed] [--size quick]
        [--requests N] [--concurrency C] [--rate R] [--batch-size 8] [--model-dir DIR] [--json OUT]

Both servers serve the same weights (``batchlab export-mlx`` writes them as an mlx-lm
folder, float32) on free 127.0.0.1 ports, each started as a subprocess, waited for at
``/v1/models``, warmed up with one short request, measured by ``batchlab.loadgen`` with the
same workload and settings, and always stopped. They run in turn, so each has both cores.
Readiness is ``GET /health`` (both have it); ``mlx_lm.server``'s ``/v1/models`` lists the
Hugging Face cache and fails without one, so it is asked for its ``default_model`` by name.

Fairness on Linux: ``import batchlab`` binds MLX's matmuls to OpenBLAS; ``mlx_lm.server``
imports mlx directly, so it gets the same OpenBLAS through ``LD_PRELOAD`` (otherwise its
matmuls use the wheel's reference BLAS, ~30x slower). The script checks the library is
mapped in the server process and records it. Batching: ``batchlab serve --batch-size B``
(stall-free, token budget 256) against ``mlx_lm.server --decode-concurrency B
--prompt-concurrency B`` (its BatchGenerator; requests without a seed are batchable).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import batchlab  # first: makes MLX use OpenBLAS on Linux
from batchlab import _blas
from batchlab.cli import loadgen_workload
from batchlab.export import export_mlx
from batchlab.loadgen import LoadgenResult, run_loadgen
from batchlab.workloads import Workload

ROWS = [("completed", "completed requests", "d"), ("failed", "failed requests", "d"),
        ("duration_s", "duration (s)", ".1f"), ("output_tokens", "output tokens", "d"),
        ("request_throughput", "requests/s", ".2f"),
        ("output_throughput", "output tokens/s", ".1f"),
        ("ttft_ms_mean", "TTFT mean (ms)", ".0f"), ("ttft_ms_p50", "TTFT p50 (ms)", ".0f"),
        ("ttft_ms_p99", "TTFT p99 (ms)", ".0f"), ("tpot_ms_mean", "TPOT mean (ms)", ".0f"),
        ("tpot_ms_p50", "TPOT p50 (ms)", ".0f"), ("tpot_ms_p99", "TPOT p99 (ms)", ".0f"),
        ("itl_ms_mean", "ITL mean (ms)", ".0f"), ("itl_ms_p50", "ITL p50 (ms)", ".0f"),
        ("itl_ms_p99", "ITL p99 (ms)", ".0f"), ("goodput", "goodput (req/s)", ".2f")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, seconds: float = 180) -> None:
    """Until ``url/health`` answers; an error if the process dies or time runs out."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {seconds:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def blas_mapped(pid: int) -> str | None:
    """The OpenBLAS file mapped into process ``pid`` (Linux), or None."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    return next((line.split()[-1] for line in maps.splitlines() if "libopenblas" in line), None)


def servers(model_dir: Path, batch: int) -> dict[str, tuple[list[str], dict, str | None]]:
    """name -> (command without --port, extra environment, model name to ask for)."""
    env = {"LD_PRELOAD": _blas.STATUS.path} if _blas.STATUS.path and sys.platform == "linux" else {}
    return {
        "batchlab serve": ([sys.executable, "-m", "batchlab.cli", "serve", "--engine", "stallfree",
                            "--batch-size", str(batch), "--max-queue", "100000"], {}, None),
        "mlx_lm.server": ([sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
                           "--decode-concurrency", str(batch), "--prompt-concurrency", str(batch),
                           "--temp", "0", "--log-level", "WARNING"], env, "default_model"),
    }


def measure(name: str, command: list[str], env: dict, model: str | None, workload: Workload,
            warmup: Workload, **loadgen) -> tuple[LoadgenResult, dict]:
    """Start one server, measure it, stop it. Its log goes to a temporary file, shown if it
    fails to start."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(command + ["--host", "127.0.0.1", "--port", str(port)],
                            env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_ready(proc, url)
        except RuntimeError:
            log.seek(0)
            print(log.read()[-3000:], file=sys.stderr)
            raise
        info = {"command": " ".join(command), "env": env, "blas": blas_mapped(proc.pid)}
        print(f"{name}: ready at {url}; BLAS in the server: {info['blas']}", flush=True)
        run_loadgen(url, warmup, model=model, progress=False)
        return run_loadgen(url, workload, model=model, **loadgen), info
    finally:
        stop(proc)
        log.close()


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
    parser.add_argument("--workload", default="mixed",
                        choices=["mixed", "high_variance", "sharegpt", "interference"])
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
    print(f"workload: {workload.description}; {len(workload)} requests, concurrency "
          f"{args.concurrency or 'unlimited'}, rate {args.rate or 'all at once'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "smollm2-mlx"
        if not (model_dir / "config.json").exists():
            export_mlx(lm, model_dir)
        del lm  # the servers load their own copies
        results, infos = {}, {}
        for name, (command, env, model) in servers(model_dir, args.batch_size).items():
            results[name], infos[name] = measure(
                name, command, env, model, workload, warmup, concurrency=args.concurrency,
                rate=args.rate, seed=args.seed, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    table = side_by_side(results)
    print(f"\n{table}\n(goodput: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["benchmarks/serving_side_by_side.py"] + sys.argv[1:]),
                       "workload": workload.description, "batch_size": args.batch_size,
                       "table": table, "servers": {n: {**infos[n], **results[n].to_json()}
                                                   for n in results}}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
