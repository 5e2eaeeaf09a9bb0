"""One lineage: every lesson from 1 to 9 runs the learner's own classes, each built on the
learner's previous piece. The committed (solved) lessons ran with every piece written, so
each says "Using your ..." and none says a reference stood in."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = [p for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if not p.name.startswith("00_")]
STOOD_IN = re.compile(
    r"stands in for it|use the reference .* in its place|reference in place of yours|"
    r"reference \(in place of yours\)|reference \(standing in"
)

# each piece file and the earlier piece it subclasses
LINEAGE = {
    "chunked": "MyContinuousScheduler",
    "stallfree": "MyChunkedScheduler",
    "memory": "MyStallFreeScheduler",
}


def outputs(nb) -> str:
    return "\n".join(
        "".join(o.get("text", ""))
        if o.get("output_type") == "stream"
        else "".join(o.get("data", {}).get("text/plain", ""))
        + "".join(o.get("data", {}).get("text/markdown", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_lesson_runs_the_learners_engine(path):
    text = outputs(nbformat.read(path, as_version=4))
    assert "Using your " in text, (
        f"{path.name}: no 'Using your ...' line: the lesson does not run the learner's classes"
    )
    assert not STOOD_IN.search(text), (
        f"{path.name}: a reference stood in for a piece: {STOOD_IN.search(text).group(0)!r}"
    )


@pytest.mark.parametrize("piece, base", LINEAGE.items())
def test_each_piece_subclasses_the_learners_previous_one(piece, base):
    cells = [
        c.source
        for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
        for c in nbformat.read(p, as_version=4).cells
        if c.cell_type == "code" and c.source.startswith(f"%%piece my_engine/{piece}.py")
    ]
    assert len(cells) == 1, f"one cell writes my_engine/{piece}.py"
    assert f"{base} = course.earlier(" in cells[0] and re.search(rf"class My\w+\({base}\)", cells[0])
