"""``batchlab lessons``: open JupyterLab on the learner's own copy of the lessons.

The learner copies (``notebooks/learner/``) are tracked by git; JupyterLab autosaves, so
working in them would turn the next ``git pull`` into a conflict. So each learner works
in ``my-course/`` (git-ignored): a lesson is copied there once, when it is missing, and
never overwritten; ``--refresh LESSON`` sets a copy aside (``*.old-N.ipynb``) and takes a
fresh one. Nothing here touches ``my-course/my_engine/``, where the learner's engine lives.
The solved lessons are copied into ``my-course/solved/`` (refreshed on every start: they are
ours, not the learner's), so JupyterLab, rooted at ``my-course/``, can open them.

Options this command does not know (``--no-browser``, ``--port 8890``...) go to JupyterLab.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository (batchlab is installed with -e)
LEARNER = ROOT / "notebooks" / "learner"
SOLVED = ROOT / "notebooks"
WORKING = ROOT / "my-course"
SOLVED_DIR = "solved"  # inside WORKING


def set_aside(path: Path) -> Path:
    """Rename a learner's copy to the first free ``<stem>.old-N.ipynb``; return the new name."""
    n = 1
    while (old := path.with_name(f"{path.stem}.old-{n}{path.suffix}")).exists():
        n += 1
    return path.rename(old)


def copy_lessons(source: Path = LEARNER, dest: Path = WORKING, refresh: list[str] = ()) -> list[str]:
    """Copy every lesson missing from ``dest``; lessons named in ``refresh`` (file name or
    stem, or "all") are set aside first, then copied fresh. Returns the names copied.

    A copy's link to its solved lesson (``../NAME.ipynb`` next to ``notebooks/learner/``)
    is pointed at ``solved/NAME.ipynb`` (see ``copy_solved``)."""
    lessons = sorted(source.glob("*.ipynb"))
    if not lessons:
        raise FileNotFoundError(
            f"no learner notebooks in {source}; run this from a clone of the batchlab repository"
        )
    names = {p.name for p in lessons} | {p.stem for p in lessons}
    unknown = [r for r in refresh if r != "all" and r not in names]
    if unknown:
        raise ValueError(
            f"no lesson named {', '.join(unknown)}; lessons: {', '.join(p.stem for p in lessons)}"
        )
    dest.mkdir(exist_ok=True)
    solved = SOLVED_DIR
    copied = []
    for lesson in lessons:
        target = dest / lesson.name
        if target.exists() and ("all" in refresh or {lesson.name, lesson.stem} & set(refresh)):
            set_aside(target)
        if not target.exists():
            text = lesson.read_text(encoding="utf-8")
            target.write_text(
                text.replace(f"](../{lesson.name})", f"]({solved}/{lesson.name})"), encoding="utf-8"
            )
            copied.append(lesson.name)
    return copied


def copy_solved(source: Path = SOLVED, dest: Path = WORKING) -> list[str]:
    """Copy the solved lessons into ``dest/solved/`` (overwriting: they are the course's,
    kept current); return their names."""
    target = dest / SOLVED_DIR
    target.mkdir(parents=True, exist_ok=True)
    names = []
    for lesson in sorted(source.glob("*.ipynb")):
        text = lesson.read_text(encoding="utf-8")
        out = target / lesson.name
        if not out.exists() or out.read_text(encoding="utf-8") != text:
            out.write_text(text, encoding="utf-8")
        names.append(lesson.name)
    return names


def jupyter_command(folder: Path, extra: list[str] = ()) -> list[str]:
    """JupyterLab on ``folder``, local only; as root (containers, some lab machines) it
    needs ``--allow-root`` or it refuses to start."""
    command = [sys.executable, "-m", "jupyter", "lab", "--ip", "127.0.0.1", str(folder), *extra]
    if hasattr(os, "getuid") and os.getuid() == 0 and "--allow-root" not in extra:
        command.append("--allow-root")
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="batchlab lessons",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--refresh",
        nargs="+",
        default=[],
        metavar="LESSON",
        help="take a fresh copy of these lessons (e.g. 03_the_prefill_stall, or "
        '"all"); your copy is kept as LESSON.old-N.ipynb',
    )
    parser.add_argument("--no-lab", action="store_true", help="copy only; do not start JupyterLab")
    args, extra = parser.parse_known_args(argv)
    try:
        copied = copy_lessons(refresh=args.refresh)
        copy_solved()
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"batchlab lessons: {e}") from None
    print(f"your lessons: {WORKING}/ ({len(copied)} copied now; your edits are never overwritten)")
    print(f"your engine: {WORKING / 'my_engine'}/ (earlier versions in my_engine/.history/)")
    print(f"solved lessons: {WORKING / SOLVED_DIR}/")
    if args.no_lab:
        return 0
    command = jupyter_command(WORKING, extra)
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
