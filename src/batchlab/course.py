"""Your engine: the pieces a learner writes, kept in plain Python files, used by the lessons.

Each lesson's main exercise is a piece of the learner's own engine. Its cell starts with
``%%writefile my_engine/<piece>.py``, so running the cell saves the piece as a file in a
package ``my_engine/`` beside the notebooks: the learner can open it, and the next lesson
starts from it (``from my_engine.continuous import MyContinuousScheduler``). A lesson then

1. loads the piece fresh from its file: ``mine = course.piece("static", "MyStaticScheduler")``;
2. checks it: ``verdict = check.static_scheduler(mine)`` (a missing or broken file is a
   failed check that says why, never an error cell);
3. runs its measurements and animations on ``course.choose(mine, verdict, StaticScheduler)``:
   the learner's piece once it passes, else the library's reference, with one line saying
   which — so a lesson always runs top to bottom.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

PACKAGE = "my_engine"
_root: Path | None = None  # the folder holding my_engine/ (set by setup)


def setup(folder: str | Path = ".") -> Path:
    """Make ``folder/my_engine/`` a package (once) and importable; return its path.
    Every lesson calls this in its first code cell."""
    global _root
    _root = Path(folder).resolve()
    package = _root / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    init = package / "__init__.py"
    if not init.exists():
        init.write_text('"""My engine: the pieces I wrote in the batchlab lessons."""\n')
    if str(_root) not in sys.path:
        sys.path.insert(0, str(_root))
    return package


class Missing:
    """Stands for a piece that cannot be used yet; ``missing_reason`` says why. Checkers
    report it as "not written yet" with that reason."""

    def __init__(self, name: str, reason: str):
        self.__name__, self.missing_reason = name, reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<{self.__name__}: {self.missing_reason}>"


def piece(module: str, name: str):
    """``name`` from ``my_engine/<module>.py``, read fresh from the file (so an edited and
    re-run cell is what runs), or ``Missing`` saying why it cannot be used."""
    if _root is None:
        setup()
    path = _root / PACKAGE / f"{module}.py"
    if not path.exists():
        return Missing(name, f"{PACKAGE}/{module}.py does not exist yet: run the cell that "
                             f"starts with %%writefile {PACKAGE}/{module}.py")
    for loaded in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[loaded]  # pieces import each other: reload them all from their files
    importlib.invalidate_caches()
    try:
        found = importlib.import_module(f"{PACKAGE}.{module}")
    except Exception as e:  # a learner's file that does not import: say where
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        return Missing(name, f"{PACKAGE}/{module}.py does not import: "
                             f"{type(e).__name__}: {e}{where}")
    if not hasattr(found, name):
        return Missing(name, f"{PACKAGE}/{module}.py defines no {name}")
    return getattr(found, name)


def choose(mine, verdict, reference):
    """The learner's piece if its checker passed, else ``reference``; prints which, in
    one line, so every measurement below is labelled honestly."""
    label = getattr(mine, "__name__", str(mine))
    if verdict and not isinstance(mine, Missing):
        print(f"Using your {label}: the runs below are your engine's.")
        return mine
    why = "is not written yet" if getattr(verdict, "not_written", False) else \
        "does not pass its checker yet"
    print(f"Your {label} {why}: the runs below use the reference {reference.__name__} in its place.")
    return reference
