"""Every learner copy runs top to bottom without an error cell.

A learner who opens a lesson and runs it before writing anything must see the lesson work:
each unwritten piece of their engine is reported by its checker and replaced by the
reference (``batchlab.course.pieces.choose``), never a traceback. The copies run in order in one
fresh folder (one a worker under ``-n 2``, where the copies spread over both), as a learner's working
copy would, so what one lesson writes to ``my_engine/`` is what a later one finds. Lesson 8 runs
on the GPU path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from run_notebook import error_cells

from batchlab.model.backend import GPU_PATH_ENV
from batchlab.model.load import LAYERS_ENV

ROOT = Path(__file__).resolve().parents[1]
COPIES = sorted((ROOT / "notebooks" / "learner").glob("*.ipynb"))

pytestmark = pytest.mark.slow
# Lesson 8's copy runs on the GPU path (the code a Mac runs on Metal) on this machine's CPU, in
# float32 for time (MLX's CPU kernels in float16 are about six times slower here): its fused
# passes, paged KV, prefix cache and preemption are every part of that path a lesson reaches.
# On it a copy took 2.3-2.9x its CPU-path time under the suite's two workers (CI at a425d5d), so
# lessons 2 and 5b, whose parts lesson 8 repeats, run on the CPU path. ``test_gpu_path.py`` runs
# the GPU path in float16, where the dtype is the point, and covers every GPU-only line.
GPU_PATH_LESSONS = {"08_memory"}
# The copies run the model with only its first two layers: the same weights, tokenizer and code
# computing about a quarter of a decode step and a tenth of a prefill. This test checks that every
# cell runs, not what the model answers or how fast; the solved lessons run all thirty layers
# under nbval, and their outputs are compared there. On the cut model every timing changes, so a
# copy's generated sentences take branches the solved run may not: both get run.
MODEL_LAYERS = "2"
GPU_PATH_SWITCH = {GPU_PATH_ENV: "1", "BATCHLAB_DTYPE": "float32"}


@pytest.fixture(scope="module")
def course_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("my-course")
    for path in COPIES:
        shutil.copy(path, folder / path.name)
    return folder


@pytest.mark.parametrize("name", [p.name for p in COPIES], ids=[p.stem for p in COPIES])
def test_learner_copy_runs_without_an_error_cell(course_folder, name, monkeypatch):
    path = course_folder / name
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv(LAYERS_ENV, MODEL_LAYERS)
    on_gpu_path = path.stem in GPU_PATH_LESSONS
    if on_gpu_path:  # the kernel inherits the switch; a first cell says which path it took
        for switch, value in GPU_PATH_SWITCH.items():
            monkeypatch.setenv(switch, value)
        nb.cells.insert(
            0, nbformat.v4.new_code_cell("import batchlab.model.backend as b\nprint(b.describe())")
        )
    nb.cells.insert(
        0,
        nbformat.v4.new_code_cell(
            "from batchlab.model.load import layers_kept\nprint('layers kept:', layers_kept(30))"
        ),
    )
    errors = error_cells(nb, course_folder)
    assert not errors, f"{name}: error cells {errors}"
    assert f"layers kept: {MODEL_LAYERS}" in nb.cells[0].outputs[0]["text"], nb.cells[0].outputs
    if on_gpu_path:
        assert "gpu path on the CPU" in nb.cells[1].outputs[0]["text"], nb.cells[1].outputs


@pytest.mark.parametrize("path", COPIES, ids=[p.stem for p in COPIES])
def test_learner_copy_is_clean_no_outputs_no_execution_counts(path):
    """The nbgrader / fastbook "clean" convention: a learner sees a result only when they
    run its cell, so no answer, verdict or "predict first" result shows before its question."""
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"{path.name}: code cells with outputs or execution counts: {dirty}"
    assert "widgets" not in nb.metadata, f"{path.name}: carries the solved run's widget state"


@pytest.mark.parametrize("path", COPIES, ids=[p.stem for p in COPIES])
def test_learner_copy_points_at_the_my_course_workflow(path):
    text = path.read_text(encoding="utf-8")
    for stale in ("Save Notebook As", "git pull", "notebooks/learner/", "%%writefile"):
        assert stale not in text, f"{path.name} still says {stale!r}"
    assert "solved/" in text


@pytest.mark.parametrize("path", COPIES, ids=[p.stem for p in COPIES])
def test_no_prediction_is_answered_in_static_text(path):
    """After a "Predict first" question, the cells that measure the answer come next, and the
    first text after them is no static "What to see": the answer is printed by a cell that
    reads the measurement, so the learner meets it only by running that cell."""
    cells = nbformat.read(path, as_version=4).cells
    answered = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown" or "Predict first" not in cell.source:
            continue
        k = next((j for j in range(i + 1, len(cells)) if cells[j].cell_type == "code"), len(cells))
        while k < len(cells) and cells[k].cell_type == "code":
            k += 1
        if k < len(cells) and cells[k].source.lstrip().lower().startswith(("**what to see", "what to see")):
            answered.append(f"cell {k}: {cells[k].source[:60]!r}")
    assert not answered, f"{path.name}: a prediction answered in static text: {answered}"
