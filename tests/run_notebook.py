"""Run a notebook top to bottom in a folder, as a learner would, and list its error cells."""

from __future__ import annotations

from pathlib import Path

from nbclient import NotebookClient


def error_cells(nb, folder: Path) -> list[tuple[int, str, str]]:
    """Execute ``nb`` (in place) with ``folder`` as its working directory; return each error
    output as (cell index, exception name, its message)."""
    NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(folder)}},
    ).execute()
    return [
        (i, o.get("ename"), o.get("evalue"))
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for o in cell.get("outputs", [])
        if o.get("output_type") == "error"
    ]
