"""Repository-wide pytest settings for the lesson notebooks.

This file sits at the root because it is the one conftest pytest always loads, whether
it collects ``tests/``, ``notebooks/`` or a single notebook.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent

# Everything the suite's processes would keep in the home folder goes to one temporary folder of
# this run instead, removed at its end, and is shared by them (set before anything imports
# batchlab; kernels and subprocesses inherit it): batchlab's caches (the BLAS verdict, the model's
# dequantized weights: dequantized once a run, not once a notebook), matplotlib's, IPython's and
# Jupyter's runtime files.
SCRATCH = Path(tempfile.mkdtemp(prefix="batchlab-tests-"))
for name, sub in [
    ("XDG_CACHE_HOME", "cache"),
    ("MPLCONFIGDIR", "matplotlib"),
    ("IPYTHONDIR", "ipython"),
    ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"),
]:
    os.environ[name] = str(SCRATCH / sub)
# Under pytest-xdist (`-n 2`) each worker is a process of its own: its OpenBLAS (and so the model's
# matrix products, in the lessons' kernels and the servers it starts too, which inherit this) gets
# its share of the cores instead of every core. Two workers each running two BLAS threads on two
# cores took 227 s over test_engine_real.py and test_kv_real.py, one thread each 171 s (2026-12-06,
# back to back on this 2-core EPYC, four read-only reader sessions beside them). A setting of the
# user's own is kept. Set here, before anything imports batchlab, which loads OpenBLAS.
if os.environ.get("PYTEST_XDIST_WORKER") and "OPENBLAS_NUM_THREADS" not in os.environ:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, cores // workers))
# Lessons and micro-benchmarks run each timed comparison once under test: nbval compares no
# timing, so more rounds would only cost minutes (``driver.capped``; tests of the rounds
# themselves unset it).
os.environ.setdefault("BATCHLAB_REPETITIONS", "1")
NBVAL_SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"

# The learner copies (notebooks/learner/) have their solutions removed and their checker
# outputs cleared, so running them under nbval would only report the missing solutions.
# tests/test_exercises.py checks them instead (they are current, and they fail their checkers).
collect_ignore = ["notebooks/learner"]


# Tests that need the real model (or a browser, a server process, a notebook) are "slow";
# `pytest -m "not slow"` runs the rest (fake model, pure logic): about 900 tests.
REAL_MODEL_FIXTURES = {
    "lm",
    "lm_two_layers",
    "hf_model",
    "hf_gguf",
    "hf_tokenizer",
    "gguf_reader",
    "gguf_meta",
    "gguf_file",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        notebook = item.path.suffix == ".ipynb"
        if notebook or REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (the other Pythons' fast tier runs without it)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n 2`) a worker takes a whole test file at a time (nbval runs a
    notebook's cells in order in one kernel), and each learner copy's run on its own. The solved
    lessons need no order between them: each runs in a course folder of its own that already
    holds what the lessons before it wrote (``lesson_course_folder``), so they spread over both
    workers. (xdist's own ``loadgroup`` cannot split a file's tests with pytest 9: the group it
    appends to a test's id no longer reaches the id.)"""
    from xdist.scheduler import LoadScopeScheduling

    class CopiesApart(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            # a learner copy's run is minutes long and needs nothing another one wrote: each is
            # a unit of its own, so the copies spread over both workers
            return nodeid if "test_learner_copy_runs" in nodeid else nodeid.split("::", 1)[0]

    return CopiesApart(config, log)


COURSE_DIR_ENV = "BATCHLAB_COURSE_DIR"  # batchlab.course.setup() reads it (not imported here: see above)


def lesson_course_folder(lesson: Path) -> Path:
    """The course folder one solved lesson runs in under test (made once a run): its
    ``my_engine/`` holds what the ``%%piece`` cells of the solved lessons before it write, in
    lesson order, as a learner's folder would after working through them. So a lesson finds
    what it would find after the others ran, without waiting for them: the lessons run apart."""
    folder = SCRATCH / "course" / lesson.stem
    if folder.exists():
        return folder
    for earlier in sorted(lesson.parent.glob("*.ipynb")):
        if earlier.name >= lesson.name:
            break
        for cell in json.loads(earlier.read_text(encoding="utf-8"))["cells"]:
            source = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
            if source.startswith("%%piece"):
                magic, _, body = source.partition("\n")  # what the magic gets: the cell after its line
                (target,) = [a for a in magic.split()[1:] if not a.startswith("-")]
                (folder / target).parent.mkdir(parents=True, exist_ok=True)
                (folder / target).write_text(body if body.endswith("\n") else body + "\n", encoding="utf-8")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# Under nbval the solved lessons run the model's first two layers (``batchlab.model.load``'s
# ``BATCHLAB_LAYERS``; the learner copies do too): the same weights, tokenizer and code at a
# fraction of the compute. What nbval compares in them (schedules on the fake model, checkers'
# verdicts, tokenization) does not depend on the depth, and no timing is compared. The lessons
# whose compared cells print the whole model's own figures (its KV bytes per token, its greedy
# tokens) run all thirty layers; the server's name for a cut model, "(its first 2 of 30 layers)",
# is left out of the comparison (tests/nbval_sanitize.cfg). Every figure a learner reads in a
# lesson comes from a run of the whole model (the committed outputs).
LAYERS_ENV, LESSON_LAYERS = "BATCHLAB_LAYERS", "2"
WHOLE_MODEL_LESSONS = {"05b_one_fused_pass", "08_memory"}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """nbval runs the solved lessons in notebooks/, so their kernels would write my_engine/
    there: each writes it to a folder of this run's temporary folder instead
    (``lesson_course_folder``; the kernel, started at a notebook's first cell, inherits the
    variable). Nothing else sees it. The kernel takes the model's depth the same way."""
    if item.path.suffix == ".ipynb" and item.path.parent == ROOT / "notebooks":
        os.environ[COURSE_DIR_ENV] = str(lesson_course_folder(item.path))
        if item.path.stem in WHOLE_MODEL_LESSONS:
            os.environ.pop(LAYERS_ENV, None)
        else:
            os.environ[LAYERS_ENV] = LESSON_LAYERS
    else:
        os.environ.pop(COURSE_DIR_ENV, None)
        os.environ.pop(LAYERS_ENV, None)


def pytest_unconfigure(config):
    shutil.rmtree(SCRATCH, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: needs the real model, a browser, a server "
        "process or a notebook run (deselect with -m 'not slow')",
    )
    # nbval opens its sanitize file relative to the working directory; an absolute path
    # lets pytest start anywhere. An explicit --nbval-sanitize-with still wins.
    if getattr(config.option, "nbval_sanitize_with", "unset") is None and not getattr(
        config.option, "sanitize_with", None
    ):
        config.option.nbval_sanitize_with = str(NBVAL_SANITIZE)
