"""The README's Results quote the committed standard bench run, not hand-typed numbers.

- The table under Results is exactly what ``batchlab bench`` prints for
  ``docs/results/bench_standard.json`` (``format_table``).
- Every row of the goals table names a figure of that JSON and states it rounded as written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from batchlab.bench import format_table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULT = json.loads((ROOT / "docs/results/bench_standard.json").read_text(encoding="utf-8"))


def results_section() -> str:
    return README.split("\n## Results\n", 1)[1].split("\n### ", 1)[0]


def test_the_results_table_is_the_benchs_own_output():
    blocks = re.findall(r"```text\n(.*?)```", results_section(), flags=re.S)
    assert blocks, "the Results section shows the bench's table in a ```text block"
    assert blocks[0].strip() == format_table(RESULT).strip()


def test_every_quoted_figure_matches_the_json():
    rows = re.findall(r"^\| `(\w+)` \|[^|]*\| ([\d.]+) \|", results_section(), flags=re.M)
    assert len(rows) >= 8, "the goals table quotes the headline figures by name"
    for key, stated in rows:
        decimals = len(stated.split(".")[1]) if "." in stated else 0
        assert key in RESULT["figures"], f"{key} is not a figure of the bench run"
        assert float(stated) == round(RESULT["figures"][key], decimals), \
            f"{key}: README says {stated}, the run gave {RESULT['figures'][key]:.4f}"
