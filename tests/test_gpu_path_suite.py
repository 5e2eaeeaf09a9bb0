"""The real-model tests and three lessons again, on the GPU path (``BATCHLAB_GPU_PATH=1``,
the code a Mac runs on Metal) on this machine's CPU, in float32 for time: MLX's CPU
kernels in float16 are about six times slower than in float32 here. ``test_gpu_path.py``
runs the same path in float16, where the dtype is the point.

The tests run unchanged in a pytest of their own with the switch set; the lessons run top to
bottom in a copy, and no cell may end in an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from run_notebook import error_cells

from batchlab.model.backend import GPU_PATH_ENV

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SWITCH = {GPU_PATH_ENV: "1", "BATCHLAB_DTYPE": "float32"}
TESTS = [  # greedy against mlx-lm / the sequential engine, every kind; paged KV; streaming
    "tests/test_engine_real.py",
    "tests/test_kv_real.py",
    "tests/test_server.py::test_openai_client_streams_a_chat_completion",
]
LESSONS = ["02_continuous_batching", "05b_one_fused_pass", "08_memory"]


def test_real_model_tests_pass_on_the_gpu_path():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", *TESTS],
        cwd=ROOT,
        env={**os.environ, **SWITCH},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert "path: gpu path on the CPU" in run.stdout, f"the switch did not take:\n{tail}"
    assert run.returncode == 0, tail


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_runs_on_the_gpu_path_without_an_error_cell(lesson, tmp_path, monkeypatch):
    for name, value in SWITCH.items():  # the kernel inherits them
        monkeypatch.setenv(name, value)
    path = shutil.copy(ROOT / "notebooks" / f"{lesson}.ipynb", tmp_path)
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(
        0,
        nbformat.v4.new_code_cell("import batchlab.model.backend\nprint(batchlab.model.backend.describe())"),
    )
    errors = error_cells(nb, tmp_path)
    assert "gpu path on the CPU" in nb.cells[0].outputs[0]["text"]
    assert not errors, f"{lesson}: error cells {errors}"
