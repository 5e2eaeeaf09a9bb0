"""The README's Results quote the committed standard bench run, not hand-typed numbers.

- The table under Results is exactly what ``batchlab bench`` prints for
  ``docs/results/bench_standard.json`` (``format_table``).
- Every row of the goals table names a figure of that JSON and states it rounded as written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from batchlab.measurement.bench import format_table

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
        assert float(stated) == round(RESULT["figures"][key], decimals), (
            f"{key}: README says {stated}, the run gave {RESULT['figures'][key]:.4f}"
        )


def test_both_standard_workloads_are_reported():
    """The standard run has the chat-shaped workload (answers averaging >= 64 tokens) and the
    prefill-heavy one, each of >= 32 requests, and the goals table quotes, for both, the
    batching ratio, the ceiling, ours / mlx-lm and every engine's fraction of the ceiling."""
    assert not RESULT["quick"] and RESULT["repetitions"] >= 3
    stated = re.search(
        r"The whole run took ([\d.]+) minutes(, \*\*over the 25-minute goal\*\*)?", results_section()
    )
    assert stated, "the Results say how long the standard run took"
    assert float(stated.group(1)) == round(RESULT["seconds"] / 60, 1)
    assert bool(stated.group(2)) == (RESULT["seconds"] > 25 * 60), "say whether the 25-minute goal is met"
    chat, heavy = RESULT["workloads"]["chat"], RESULT["workloads"]["high_variance"]
    assert chat["requests"] >= 32 and heavy["requests"] >= 32
    assert chat["output_len_mean"] >= 64 > heavy["output_len_mean"]
    quoted = set(re.findall(r"^\| `(\w+)` \|", results_section(), flags=re.M))
    for prefix, name in (("chat_", "chat"), ("", "high_variance")):
        for key in ("continuous_over_static_tokps", "no_waste_over_static_tokps", "ours_over_mlxlm_tokps"):
            assert prefix + key in quoted, prefix + key
        for engine in ("static", "continuous", "chunked", "stallfree", "mlx_lm"):
            assert f"{name}_fraction_of_no_waste_{engine}" in RESULT["figures"]
            assert f"{name}_fraction_of_no_waste_{engine}" in results_section()
    for b in (1, 8, 16):
        assert f"decode_b{b}_over_roofline" in quoted


def test_the_ceiling_fractions_in_the_prose_match_the_json():
    """The paragraph above the goals table quotes every engine's fraction of the ceiling."""
    quoted = re.findall(r"(\d+\.\d+) \(`(\w+_fraction_of_no_waste_\w+)`\)", results_section())
    assert len(quoted) == 10
    for stated, key in quoted:
        assert float(stated) == round(RESULT["figures"][key], 2), key


SPECULATION = json.loads((ROOT / "docs/results/bench_speculation.json").read_text(encoding="utf-8"))
SPEC_COLUMNS = ("speedup_tokps", "acceptance_rate", "tokens_per_verify_row", "passes_per_token")


def test_the_speculation_figures_are_the_speculation_runs_own():
    """Each row of the README's speculation table states its figures of
    ``docs/results/bench_speculation.json`` as rounded (the speed-up with its range)."""
    rows = re.findall(r"^\| \w+, \d+ \(`(\w+)_spec_\*`\) \| (.+) \|$", results_section(), flags=re.M)
    assert len(rows) == 4, "four rows: echo and chat at B=1 and at the standard batch"
    figures, spreads = SPECULATION["figures"], SPECULATION["figure_spreads"]
    for prefix, cells in rows:
        cells = [c.strip() for c in cells.split("|")]
        speedup = f"{prefix}_spec_speedup_tokps"
        low, high = spreads[speedup]
        assert cells[0] == f"{figures[speedup]:.2f} ({low:.2f}-{high:.2f})", (prefix, cells[0])
        for column, cell in zip(SPEC_COLUMNS[1:], cells[1:]):
            assert cell == f"{figures[f'{prefix}_spec_{column}']:.2f}", (prefix, column, cell)


STRUCTURED = json.loads((ROOT / "docs/results/bench_structured.json").read_text(encoding="utf-8"))


def test_the_structured_figures_are_the_structured_runs_own():
    """The README's structured-output paragraph states ``docs/results/bench_structured.json``'s
    figures as rounded: validity and cut answers per engine, and the ratios with their ranges."""
    text = README.split("<!-- STRUCTURED-BENCH-FIGURES -->", 1)[1].split("\n\n", 5)
    section = " ".join("\n\n".join(text[:5]).split())  # lines joined
    figures, spreads = STRUCTURED["figures"], STRUCTURED["figure_spreads"]
    for suffix in ("", "_free", "_mlxlm"):
        assert f"{figures['structured_validity' + suffix]:.2f} (`structured_validity{suffix}`)" in section
        assert f"{figures['structured_length_cut' + suffix]} (`structured_length_cut{suffix}`)" in section
    for key, fmt in (
        ("structured_over_free_tokps", ".2f"),
        ("structured_over_free_ttft_p50", ".2f"),
        ("structured_mask_share", ".3f"),
    ):
        low, high = spreads[key]
        assert f"{figures[key]:{fmt}} ({low:{fmt}}-{high:{fmt}}) (`{key}`)" in section, key
