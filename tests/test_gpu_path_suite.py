"""The real-model tests again, on the GPU path (``BATCHLAB_GPU_PATH=1``, the code a Mac runs
on Metal) on this machine's CPU, in float32 for time: MLX's CPU kernels in float16 are about
six times slower than in float32 here. ``test_gpu_path.py`` runs the same path in float16,
where the dtype is the point; ``test_learner_copies.py`` runs lessons 2, 5b and 8 on it.

The tests run unchanged in a pytest of their own with the switch set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchlab.model.backend import GPU_PATH_ENV

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SWITCH = {GPU_PATH_ENV: "1", "BATCHLAB_DTYPE": "float32"}
TESTS = [  # greedy against mlx-lm / the sequential engine, every kind; paged KV; streaming
    "tests/test_engine_real.py",
    "tests/test_kv_real.py",
    "tests/test_server.py::test_openai_client_streams_a_chat_completion",
]


def test_real_model_tests_pass_on_the_gpu_path():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", *TESTS],
        cwd=ROOT,
        # not the outer run's PYTEST_ADDOPTS (CI's JUnit file is the outer run's to write)
        env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, **SWITCH},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert "path: gpu path on the CPU" in run.stdout, f"the switch did not take:\n{tail}"
    assert run.returncode == 0, tail
