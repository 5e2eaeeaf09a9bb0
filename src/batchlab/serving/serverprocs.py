"""OpenAI-compatible servers as subprocesses on 127.0.0.1: ``batchlab serve`` and
``mlx_lm.server`` started the same way, waited for, and always stopped, so a benchmark
or a test can send both the same load.

Fairness on Linux: ``import batchlab`` binds MLX's matmuls to OpenBLAS; ``mlx_lm.server``
imports mlx directly, so it gets the same OpenBLAS through ``LD_PRELOAD`` (without it its
matmuls run on the wheel's reference BLAS, ~30x slower). ``ServerProcess.blas`` reports
which OpenBLAS file is mapped into the running server, to check.

``mlx_lm.server``'s ``/v1/models`` lists the Hugging Face cache and fails without one, so
readiness is ``GET /health`` (both servers have it) and it is asked for its
``default_model`` by name.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .. import _blas


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: the command (without host and port), extra environment,
    and the model name clients should ask for (None: the first at ``/v1/models``)."""

    name: str
    command: list[str]
    env: dict
    model: str | None


def batchlab_spec(
    batch_size: int, max_queue: int = 100_000, engine: str = "stallfree", *options: str
) -> ServerSpec:
    """``batchlab serve``: ``engine`` (a kind, or module:Class imported from the current
    folder) with ``batch_size`` slots, plus any further command-line ``options``."""
    return ServerSpec(
        "batchlab serve",
        [
            sys.executable,
            "-m",
            "batchlab.cli",
            "serve",
            "--engine",
            engine,
            "--batch-size",
            str(batch_size),
            "--max-queue",
            str(max_queue),
            *options,
        ],
        {},
        None,
    )


LISTEN_BACKLOG = 2048  # uvicorn's default listen backlog
MLX_LM_SERVER = (
    "import sys, http.server; "
    f"http.server.ThreadingHTTPServer.request_queue_size = {LISTEN_BACKLOG}; "
    "sys.argv[0] = 'mlx_lm.server'; "
    "from mlx_lm.server import main; main()"
)


def mlx_lm_spec(model_dir: str | Path, batch_size: int) -> ServerSpec:
    """``mlx_lm.server`` on an exported folder: its BatchGenerator decodes up to
    ``batch_size`` requests (``--decode-concurrency``) and prefills up to ``batch_size``
    prompts together (``--prompt-concurrency``; it would raise the decode batch to match
    a larger value anyway). Greedy by default (``--temp 0``).

    Its ``ThreadingHTTPServer`` keeps the standard library's listen backlog of 5: when more
    clients than that connect at once, the rest are dropped ("disconnected"), which measures
    the socket, not the scheduler. It is started through ``MLX_LM_SERVER`` with the
    backlog at ``LISTEN_BACKLOG``, uvicorn's default, the one ``batchlab serve`` has."""
    env = {"LD_PRELOAD": _blas.STATUS.path} if _blas.STATUS.path and sys.platform == "linux" else {}
    return ServerSpec(
        "mlx_lm.server",
        [
            sys.executable,
            "-c",
            MLX_LM_SERVER,
            "--model",
            str(model_dir),
            "--decode-concurrency",
            str(batch_size),
            "--prompt-concurrency",
            str(batch_size),
            "--temp",
            "0",
            "--log-level",
            "WARNING",
        ],
        env,
        "default_model",
    )


@dataclass
class ServerProcess:
    spec: ServerSpec
    base_url: str
    pid: int

    @property
    def blas(self) -> str | None:
        """The OpenBLAS file mapped into the server process (Linux), or None."""
        try:
            maps = Path(f"/proc/{self.pid}/maps").read_text()
        except OSError:
            return None
        return next((line.split()[-1] for line in maps.splitlines() if "libopenblas" in line), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, seconds: float) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health did not answer within {seconds:.0f} s")


@contextmanager
def running(spec: ServerSpec, ready_within_s: float = 180) -> Iterator[ServerProcess]:
    """Start ``spec`` on a free 127.0.0.1 port, yield it once ``/health`` answers, and stop
    it afterwards whatever happens. Its log goes to a temporary file, shown if it fails."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            spec.command + ["--host", "127.0.0.1", "--port", str(port)],
            env={**os.environ, **spec.env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            try:
                _wait_ready(proc, url, ready_within_s)
            except RuntimeError as e:
                log.seek(0)
                raise RuntimeError(f"{spec.name}: {e}\n{log.read()[-3000:]}") from None
            yield ServerProcess(spec, url, proc.pid)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
