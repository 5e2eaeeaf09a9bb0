"""The lessons' prose keeps its promises: short, and every measured number comes from output.

- At most ~2,000 words of prose a lesson (Markdown cells).
- A measured quantity (a time, a rate, a ratio, a share, a size) never sits in hand-written
  Markdown: the lesson prints it, or builds its "what to see" sentences from the measured
  values (an ``IPython.display.Markdown`` output), so prose cannot contradict the run.
- The run time a lesson states in its first cell matches its execution metadata.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_WORDS = 2100  # "~2,000 words of prose a lesson"
RUN_TIME = re.compile(r"\*\*Run time:\*\* about (\d+(?:½)?) (seconds|minutes?)")
MEASURED = re.compile(
    r"(?<![\w.])\d+(?:[.,]\d+)?(?:½)?\s?(?:ms|s|seconds|minutes|tok/s|tokens/s|tokens per second|"
    r"×|%|GFLOP/s|GB/s|MiB|KiB|MB)(?![\w/])"
)


def prose(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


def words(text: str) -> int:
    return len(re.findall(r"[A-Za-z][A-Za-z'’-]*", text))


def run_seconds(nb) -> float:
    """Wall time from the first cell's start to the last cell's reply, as recorded."""
    times = [
        c.metadata["execution"]
        for c in nb.cells
        if c.cell_type == "code" and "shell.execute_reply" in c.metadata.get("execution", {})
    ]
    parse = datetime.datetime.fromisoformat
    start = parse(
        times[0].get("iopub.execute_input", times[0].get("iopub.status.busy")).replace("Z", "+00:00")
    )
    return (parse(times[-1]["shell.execute_reply"].replace("Z", "+00:00")) - start).total_seconds()


def generated(nb) -> list[str]:
    """The Markdown a lesson's cells print (its generated "what to see" sentences)."""
    return [
        "".join(out["data"]["text/markdown"])
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "text/markdown" in out.get("data", {})
    ]


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_prose_is_short(path):
    """A learner reads the Markdown cells and the sentences the cells generate: both count."""
    nb = nbformat.read(path, as_version=4)
    written, printed = words("\n".join(prose(nb))), words("\n".join(generated(nb)))
    assert written + printed <= MAX_WORDS, f"{written} words written + {printed} generated"


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_measured_number_is_typed_into_prose(path):
    nb = nbformat.read(path, as_version=4)
    found = [
        (i, m.group(0), cell.source[max(m.start() - 40, 0) : m.end() + 20].replace("\n", " "))
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "markdown"
        for m in MEASURED.finditer(RUN_TIME.sub("", cell.source))
    ]
    assert not found, (
        "measured-looking numbers in Markdown (print them, or build the sentence "
        "from the measured values):\n" + "\n".join(map(str, found))
    )


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_stated_run_time_matches_the_recorded_run(path):
    nb = nbformat.read(path, as_version=4)
    stated = RUN_TIME.search(nb.cells[0].source if nb.cells[0].cell_type == "markdown" else "")
    assert stated, "the first cell states '**Run time:** about N seconds|minutes ...'"
    amount = float(stated.group(1).replace("½", ".5"))
    seconds = amount * (60 if stated.group(2).startswith("minute") else 1)
    recorded = run_seconds(nb)
    assert seconds / 1.5 <= recorded <= seconds * 1.5, (
        f"states about {seconds:.0f} s, the committed run took {recorded:.0f} s"
    )
