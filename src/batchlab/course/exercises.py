"""Exercises: one lesson notebook, two audiences.

The convention every lesson follows
-----------------------------------
* An **exercise cell** is a code cell that holds the reference solution between two
  marker lines, usually inside the function the learner must write::

      def greedy_pick(logits):
          ### BEGIN SOLUTION
          return int(mx.argmax(logits))
          ### END SOLUTION

  A cell may hold several marked regions; markers sit on lines of their own.
* The **checker cell** is the next code cell after an exercise cell. It calls a checker
  from :mod:`batchlab.course.checks` (imported as ``check``), e.g. ``check.greedy_pick(greedy_pick)``,
  and carries ``# NBVAL_CHECK_OUTPUT`` so the test suite compares its verdict.
* In a learner copy, an exercise cell is recognised by its placeholder (``# YOUR CODE HERE``
  followed by ``raise NotImplementedError(...)``), so the copies can be checked too.
* A lesson's main exercise is a piece of the learner's engine: its cell starts with
  ``%%piece my_engine/<piece>.py`` (see :mod:`batchlab.course.pieces`), its checker cell loads
  the piece with ``course.piece(...)``, and the cells after it run on
  ``course.choose(piece, verdict, Reference)``, so a learner copy whose piece is not written
  yet still runs top to bottom on the reference. Smaller exercises (a function in the
  notebook) come at the end of a lesson, and nothing but their checker depends on them.
* Exercise and checker cells may use only what they define themselves plus ``mx``
  (``mlx.core``), ``np`` (numpy), ``batchlab``, ``check``, ``course`` and ``lm`` (the loaded
  model): the tests run them in exactly that namespace.

The committed lessons in ``notebooks/`` run *with* the solutions, so the test suite
passes and learners reading on GitHub see every output. :func:`make_learner_copies`
writes the learner's clean copies (``notebooks/learner/``): each solution region becomes
``# YOUR CODE HERE`` plus ``raise NotImplementedError(...)``, **every** code cell loses its
outputs and execution count (the nbgrader / fastbook "clean" convention: a learner sees a
result only when they run its cell, so no answer and no "predict first" result is shown
before its question), a banner cell goes on top, and every other cell is kept as it is.
The copies are committed; a test regenerates them and fails when they are out of date::

    python -m batchlab.course.exercises notebooks notebooks/learner          # (re)write the copies
    python -m batchlab.course.exercises notebooks notebooks/learner --check  # exit 1 if stale
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
PLACEHOLDER = "# YOUR CODE HERE"
BANNER_ID = "learner-copy-banner"
_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)\s*\(")


class ExerciseFormatError(ValueError):
    """A lesson notebook breaks the exercise convention (unbalanced markers, no checker cell)."""


def _text(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def is_exercise_cell(cell) -> bool:
    """A code cell holding a solution region, or (in a learner copy) its placeholder."""
    if cell.get("cell_type") != "code":
        return False
    lines = [line.strip() for line in _text(cell).splitlines()]
    return BEGIN in lines or any(
        a == PLACEHOLDER and b.startswith("raise NotImplementedError(") for a, b in zip(lines, lines[1:])
    )


def strip_solutions(source: str, where: str = "cell") -> str:
    """``source`` with every solution region replaced by a placeholder that raises
    ``NotImplementedError`` naming the function the region belongs to."""
    lines = source.split("\n")
    out: list[str] = []
    inside = False
    for number, line in enumerate(lines, 1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ExerciseFormatError(f"{where}, line {number}: {BEGIN!r} inside another solution region")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            name = _enclosing_function(out, len(indent))
            what = f"{name} is not written yet" if name else "this exercise is not written yet"
            out.append(indent + PLACEHOLDER)
            out.append(f'{indent}raise NotImplementedError("{what}")')
        elif marker == END:
            if not inside:
                raise ExerciseFormatError(f"{where}, line {number}: {END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ExerciseFormatError(f"{where}: {BEGIN!r} is never closed by {END!r}")
    return "\n".join(out)


def _enclosing_function(lines: list[str], indent: int) -> str | None:
    for line in reversed(lines):
        match = _DEF.match(line)
        if match and len(match.group(1)) < indent:
            return match.group(2)
    return None


def exercise_pairs(nb, where: str = "notebook") -> list[tuple[int, int]]:
    """(exercise cell index, checker cell index) for every exercise in ``nb``."""
    cells = nb["cells"]
    pairs = []
    for i, cell in enumerate(cells):
        if not is_exercise_cell(cell):
            continue
        strip_solutions(_text(cell), f"{where}, cell {i}")  # validates the markers
        following = [j for j in range(i + 1, len(cells)) if cells[j]["cell_type"] == "code"]
        if (
            not following
            or "check." not in _text(cells[following[0]])
            or is_exercise_cell(cells[following[0]])
        ):
            raise ExerciseFormatError(
                f"{where}, cell {i}: an exercise cell must be followed by a checker cell "
                f"(the next code cell, calling check.<name>(...))"
            )
        pairs.append((i, following[0]))
    return pairs


def _clear(cell) -> None:
    cell["outputs"] = []
    cell["execution_count"] = None


def learner_notebook(nb, source_name: str):
    """A learner's clean copy of the lesson notebook ``nb`` (``nb`` is left unchanged)."""
    import nbformat

    out = copy.deepcopy(nb)
    for ex, _ in exercise_pairs(out, source_name):
        cell = out["cells"][ex]
        cell["source"] = strip_solutions(_text(cell), f"{source_name}, cell {ex}")
    for cell in out["cells"]:  # clean: no outputs, no execution counts, anywhere
        if cell.get("cell_type") == "code":
            _clear(cell)
    out.get("metadata", {}).pop("widgets", None)  # the solved run's widget state
    if not out["cells"] or out["cells"][0].get("id") != BANNER_ID:
        banner = nbformat.v4.new_markdown_cell(
            f"> **Your copy of this lesson**, without the solutions and without outputs: a "
            "result appears when you run its cell. Run it top to bottom; in each exercise, write "
            f"your code where it says `{PLACEHOLDER}`, run the cell, then the checker cell below "
            "it. Your engine's pieces are saved in `my_engine/` beside this notebook (earlier "
            "versions in `my_engine/.history/`), and nothing refreshes or overwrites them. "
            f"The solved lesson, with our answers and outputs: [`solved/{source_name}`](../{source_name})."
        )
        banner["id"] = BANNER_ID
        out["cells"].insert(0, banner)
    out.setdefault("metadata", {})["batchlab"] = {"learner_copy_of": source_name}
    return out


def _render(path: Path) -> tuple[str, int]:
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    clean = learner_notebook(nb, path.name)
    nbformat.validate(clean)
    return nbformat.writes(clean, version=4) + "\n", len(exercise_pairs(nb, path.name))


def _sources(src_dir: Path) -> list[Path]:
    return sorted(p for p in src_dir.glob("*.ipynb") if p.is_file())


def _orphans(src_dir: Path, out_dir: Path) -> list[Path]:
    """Generated copies in ``out_dir`` whose lesson no longer exists."""
    names = {p.name for p in _sources(src_dir)}
    return sorted(
        p
        for p in out_dir.glob("*.ipynb")
        if p.name not in names and BANNER_ID in p.read_text(encoding="utf-8")
    )


def stale_learner_copies(
    src_dir: str | Path = "notebooks", out_dir: str | Path = "notebooks/learner"
) -> list[str]:
    """Why the committed learner copies differ from freshly generated ones ([] = up to date)."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    problems = []
    for path in _sources(src_dir):
        text, _ = _render(path)
        target = out_dir / path.name
        if not target.exists():
            problems.append(f"{target} is missing")
        elif target.read_text(encoding="utf-8") != text:
            problems.append(f"{target} differs from a fresh copy of {path}")
    problems += [f"{p} has no lesson in {src_dir}" for p in _orphans(src_dir, out_dir)]
    return problems


def make_learner_copies(
    src_dir: str | Path = "notebooks", out_dir: str | Path = "notebooks/learner"
) -> list[Path]:
    """Write a clean learner copy of every ``src_dir/*.ipynb`` into ``out_dir``; files
    whose content would not change are not touched. Returns the paths written."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in _sources(src_dir):
        text, n = _render(path)
        target = out_dir / path.name
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
            written.append(target)
    for orphan in _orphans(src_dir, out_dir):
        orphan.unlink()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchlab.course.exercises",
        description="Write learners' clean copies of the lesson notebooks (solutions removed).",
    )
    parser.add_argument("src_dir", nargs="?", default="notebooks")
    parser.add_argument("out_dir", nargs="?", default="notebooks/learner")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the copies are out of date"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = stale_learner_copies(args.src_dir, args.out_dir)
            for p in problems:
                print(p)
            if problems:
                print(f"regenerate with: python -m batchlab.course.exercises {args.src_dir} {args.out_dir}")
                return 1
            print(f"learner copies in {args.out_dir} are up to date")
            return 0
        written = make_learner_copies(args.src_dir, args.out_dir)
    except ExerciseFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"learner copies in {args.out_dir} were already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
