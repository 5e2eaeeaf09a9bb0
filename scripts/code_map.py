"""The README's code map, generated from the tree: every room (package) of ``src/batchlab``
in the layer order the tests enforce, every module in it in import order (a module after
the ones it imports), each with the first sentence of its docstring.

    .venv/bin/python scripts/code_map.py          # print the table
    .venv/bin/python scripts/code_map.py --write  # put it in README.md (between its markers)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "batchlab"
README = ROOT / "README.md"
BEGIN, END = "<!-- code map: scripts/code_map.py -->", "<!-- end of the code map -->"
# the rooms from the bottom up (tests/test_structure.py holds every import to this order)
LAYERS = ["_blas", "core", "model", "viz", "measurement", "serving", "course", "demo", "cli"]


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    end = paragraph.find(". ")
    sentence = paragraph[: end + 1] if end >= 0 else paragraph
    sentence = re.sub(r":\w+:`([^`]+)`", r"`\1`", sentence)  # reST roles as code
    return sentence.replace("``", "`").replace("|", "\\|")


def _local_imports(path: Path, names: set[str]) -> set[str]:
    """Which of the sibling modules ``names`` this file imports (``from .x`` / ``from . import x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
    return found & names


def in_import_order(room: Path) -> list[Path]:
    """The room's modules and subpackages, each after the siblings it imports (ties by name)."""
    entries = {p.stem if p.is_file() else p.name: p for p in room.iterdir() if _is_entry(p)}
    deps = {}
    for name, p in entries.items():
        files = [p] if p.is_file() else list(p.rglob("*.py"))
        deps[name] = set().union(*(_local_imports(f, set(entries)) for f in files)) - {name}
    ordered: list[str] = []
    while len(ordered) < len(entries):
        ready = sorted(n for n in entries if n not in ordered and deps[n] <= set(ordered))
        ordered.append(ready[0] if ready else sorted(set(entries) - set(ordered))[0])
    return [entries[n] for n in ordered]


def _is_entry(p: Path) -> bool:
    if p.is_file():
        return p.suffix == ".py" and p.name != "__init__.py"
    return (p / "__init__.py").exists()


def rows(room: str) -> list[str]:
    path = PACKAGE / room
    if not path.is_dir():
        return [f"| `{room}.py` | {first_sentence(path.with_suffix('.py'))} |"]
    out = [f"| **`{room}/`** | **{first_sentence(path / '__init__.py')}** |"]
    for entry in in_import_order(path):
        if entry.is_file():
            out.append(f"| `{room}/{entry.name}` | {first_sentence(entry)} |")
        else:
            files = ", ".join(f"`{p.stem}`" for p in in_import_order(entry))
            text = first_sentence(entry / "__init__.py")
            out.append(f"| `{room}/{entry.name}/` | {text} Files: {files}. |")
    return out


def code_map() -> str:
    lines = ["| file | job |", "|---|---|"]
    for room in LAYERS:
        lines += rows(room)
    lines.append(
        "| `data/` | What ships with the package: the text corpus (with its licence) and the fitted cost model. |"
    )
    return "\n".join(lines)


def write() -> None:
    text = README.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + code_map() + "\n" + text[stop:])


if __name__ == "__main__":
    write() if "--write" in sys.argv else print(code_map())
