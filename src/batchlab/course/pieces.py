"""Your engine: the pieces a learner writes, kept in plain Python files, used by the lessons.

Each lesson's main exercise is a piece of the learner's own engine. Its cell starts with
``%%piece my_engine/<piece>.py`` (a cell magic that ``setup()`` registers), so running the
cell saves the piece as a file in a package ``my_engine/`` beside the notebooks: the learner
can open it, and the next lesson builds on it. Saving never loses work:

* writing over a different version first keeps the old one as
  ``my_engine/.history/<piece>.<n>.py`` (and says so in one line);
* an exercise cell that is still the empty exercise (a ``raise NotImplementedError`` where
  the code goes) is not written over a piece that is already written: it says so, and how
  to start over (``%%piece --force ...``, or delete the file);
* nothing else writes to ``my_engine/`` (refreshing a lesson copies notebooks only).

A lesson then

1. loads the piece fresh from its file: ``mine = course.piece("static", "MyStaticScheduler")``;
2. checks it: ``verdict = check.static_scheduler(mine)`` (a missing or broken file is a
   failed check that says why, never an error cell);
3. runs its measurements and animations on ``course.choose(mine, verdict, StaticScheduler)``:
   the learner's piece once it passes, else the library's reference, with one line saying
   which -- so a lesson always runs top to bottom.

A piece builds on an earlier one with ``earlier(module)``: the learner's class from that
lesson, or (when it is not written yet) the library's, with one line saying which.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re
import sys
from pathlib import Path

from . import guard

PACKAGE = "my_engine"
HISTORY = ".history"
_root: Path | None = None  # the folder holding my_engine/ (set by setup)

# module -> (lesson, class the learner writes there, the library's class standing in for it)
PIECES: dict[str, tuple[str, str, str]] = {
    "static": ("1", "MyStaticScheduler", "batchlab.core.scheduler:StaticScheduler"),
    "continuous": ("2", "MyContinuousScheduler", "batchlab.core.scheduler:ContinuousScheduler"),
    "chunked": ("4", "MyChunkedScheduler", "batchlab.core.scheduler:ContinuousScheduler"),
    "stallfree": ("5a", "MyStallFreeScheduler", "batchlab.core.scheduler:StallFreeScheduler"),
    "front": ("6", "MyEngine", "batchlab.core.engine:Engine"),
    "server": ("7", "MyServer", "batchlab.serving.server:Server"),
    "memory": ("8", "MyMemoryScheduler", "batchlab.core.scheduler:StallFreeScheduler"),
    "policy": ("9", "MyAdmission", "batchlab.core.engine:Admission"),
    "aging": ("10", "MyAgingPolicy", "batchlab.core.policies:AgingPolicy"),
    "speculative": ("11", "MySpeculativeScheduler", "batchlab.core.scheduler:StallFreeScheduler"),
    "structured": ("12", "MyStructuredEngine", "batchlab.core.engine:Engine"),
}
# a second class (or a function) of a piece's file, and the library's one standing in for it
OTHERS: dict[tuple[str, str], str] = {
    ("memory", "MyVictimPolicy"): "batchlab.core.policies:PriorityPolicy",
    ("speculative", "propose"): "batchlab.core.speculative:propose_ngram",
}
_STUB = re.compile(r"^\s*# YOUR CODE HERE\s*\n\s*raise NotImplementedError\(", re.M)
# the earlier pieces references stood in for (``earlier``), newest last, each with why: a
# piece that mixes a library part into one of them cannot be built on the reference (``_load``)
_stood_in: list[tuple[str, str]] = []
_WAITS = "cannot be built yet"


COURSE_DIR_ENV = "BATCHLAB_COURSE_DIR"  # where my_engine/ goes instead of "." (the test suite's nbval runs)


def setup(folder: str | Path | None = None) -> Path:
    """Make ``folder/my_engine/`` a package (once) and importable, register the ``%%piece``
    cell magic (in a notebook); return the package's path. Every lesson calls this in its
    first code cell. ``folder`` defaults to ``$BATCHLAB_COURSE_DIR`` if set, else the
    working directory (the notebook's folder)."""
    global _root
    _root = Path(folder if folder is not None else os.environ.get(COURSE_DIR_ENV) or ".").resolve()
    package = _root / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    init = package / "__init__.py"
    if not init.exists():
        init.write_text('"""My engine: the pieces I wrote in the batchlab lessons."""\n')
    if str(_root) not in sys.path:
        sys.path.insert(0, str(_root))
    _register_magic()
    return package


def _register_magic() -> None:
    try:
        from IPython import get_ipython
    except ImportError:  # plain Python: nothing to register
        return
    shell = get_ipython()
    if shell is None:
        return

    def piece_magic(line: str, cell: str) -> None:
        args = line.split()
        force = any(a in ("-f", "--force") for a in args)
        paths = [a for a in args if not a.startswith("-")]
        if len(paths) != 1:
            print(f"usage: %%piece [--force] {PACKAGE}/<piece>.py")
            return
        try:
            print(write_piece(paths[0], cell, force=force))
        except ValueError as e:  # a path outside my_engine/: said, not a traceback
            print(e)

    shell.register_magic_function(piece_magic, magic_kind="cell", magic_name="piece")


def is_stub(source: str) -> bool:
    """True if ``source`` still holds an empty exercise (``# YOUR CODE HERE`` + raise)."""
    return bool(_STUB.search(source))


def _lesson_of(path: Path) -> str:
    entry = PIECES.get(path.stem)
    return f" (lesson {entry[0]})" if entry else ""


def write_piece(target: str | Path, source: str, force: bool = False) -> str:
    """Save ``source`` as the piece ``target`` (e.g. ``my_engine/static.py``, relative to
    the course folder) without ever losing a version; return the one line to show.

    A different existing version is kept first as ``my_engine/.history/<piece>.<n>.py``.
    An empty exercise (``is_stub``) is not written over a piece whose file is written,
    unless ``force``."""
    if _root is None:
        setup()
    path = Path(target)
    path = (path if path.is_absolute() else _root / path).resolve()
    package = (_root / PACKAGE).resolve()
    if path.parent != package or path.suffix != ".py":
        raise ValueError(
            f"%%piece writes one file of {PACKAGE}/ in the course folder ({package}), e.g. "
            f"{PACKAGE}/static.py; {target} is not one, so nothing was written"
        )
    rel = path.relative_to(_root.resolve()).as_posix()
    if not source.endswith("\n"):
        source += "\n"
    if path.exists():
        old = path.read_text(encoding="utf-8")
        if old == source:
            return f"{rel} is already this version (unchanged)."
        if is_stub(source) and not is_stub(old) and not force:
            return (
                f"{rel} already holds your piece{_lesson_of(path)}, so this cell (still the "
                f"empty exercise) did not replace it; the lesson uses your file. To start "
                f"over from this cell, run it with %%piece --force {rel} (your file is "
                f"kept in {PACKAGE}/{HISTORY}/)."
            )
        kept = _keep(path, old)
        path.write_text(source, encoding="utf-8")
        return f"Saved {rel}; your previous version is kept as {kept.relative_to(_root).as_posix()}."
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")
    return f"Saved {rel}."


def _keep(path: Path, text: str) -> Path:
    history = path.parent / HISTORY
    history.mkdir(exist_ok=True)
    n = 1
    while (kept := history / f"{path.stem}.{n}{path.suffix}").exists():
        n += 1
    kept.write_text(text, encoding="utf-8")
    return kept


class Missing:
    """Stands for a piece that cannot be used yet; ``missing_reason`` says why. Checkers
    report it as "not written yet" with that reason, or as "cannot run yet" when its file is
    written but does not import (``written``); ``waiting_on`` names the earlier piece it builds
    on when that one is what is missing."""

    def __init__(self, name: str, reason: str, waiting_on: str | None = None, written: bool = False):
        self.__name__, self.missing_reason, self.waiting_on = name, reason, waiting_on
        self.written = written or waiting_on is not None

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<{self.__name__}: {self.missing_reason}>"


def _where(module: str) -> str:
    entry = PIECES.get(module)
    lesson = f"lesson {entry[0]}'s " if entry else "the "
    return f"{lesson}cell that starts with %%piece {PACKAGE}/{module}.py"


def piece(module: str, name: str):
    """``name`` from ``my_engine/<module>.py``, read fresh from the file (so an edited and
    re-run cell is what runs), or ``Missing`` saying why it cannot be used."""
    if _root is None:
        setup()
    path = _root / PACKAGE / f"{module}.py"
    if not path.exists():
        return Missing(name, f"{PACKAGE}/{module}.py does not exist yet: run {_where(module)}")
    found, why = _load(module)
    if why:
        waiting_on = _stood_in[-1][0] if why.startswith(_WAITS) else None
        return Missing(name, f"{PACKAGE}/{module}.py {why}", waiting_on, written=True)
    if not hasattr(found, name):
        return Missing(name, f"{PACKAGE}/{module}.py defines no {name}")
    return getattr(found, name)


def _load(module: str):
    """``my_engine.<module>`` imported within the checkers' time limit: (the module, None), or (None,
    why not: it does not import, says where; it never finishes; it changes batchlab, which is put back).
    Every piece is read fresh from its file (pieces import each other), never from an import that an
    earlier call left half done (Python 3.10 can keep a module whose import was stopped); inside a
    piece's own import (its ``course.earlier`` line) the pieces being imported are left alone."""
    loaded = [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]
    if not any(getattr(getattr(sys.modules[m], "__spec__", None), "_initializing", False) for m in loaded):
        for m in loaded:
            del sys.modules[m]
        importlib.invalidate_caches()
    before, stood_in, printed = guard.snapshot(), len(_stood_in), io.StringIO()
    with contextlib.redirect_stdout(printed):  # shown below, unless a stand-in could not stand in
        outcome = guard.run_guarded(lambda: importlib.import_module(f"{PACKAGE}.{module}"))
    changed = guard.restore(before)
    e = outcome.error
    said = " ".join(str(e).split())  # Python wraps this message over two lines
    unbuildable = isinstance(e, TypeError) and "method resolution order" in said and len(_stood_in) > stood_in
    if not unbuildable:  # (else its "stands in" line would be false)
        sys.stdout.write(printed.getvalue())
    if outcome.late:
        return None, f"does not finish importing: it {outcome.late}"
    if unbuildable:
        # e.g. lesson 8's ``class MyMemoryScheduler(OnDemandKV, MyStallFreeScheduler)`` where the
        # library's StallFreeScheduler, which already holds OnDemandKV, stood in for lesson 5a's
        return None, (
            f"{_WAITS}: it builds on {_stood_in[-1][0]}, which {_stood_in[-1][1]}, and the library's "
            f"class cannot take its place beneath yours (Python: {said}). Make that piece work first"
        )
    if e is not None:  # a learner's file that does not import: say what and where
        moved = f" ({MERGED[e.name]}: change that import line)" if getattr(e, "name", None) in MERGED else ""
        return None, f"does not import: {type(e).__name__}: {e}{moved}{guard.where_raised(e)}"
    if changed:
        return None, f"does not import cleanly: {guard.library_changed(changed)}"
    return outcome.value, None


# Modules a piece saved with an earlier batchlab may import, which batchlab has since merged
# into others (issue 42: a request's road in fewer files): where their names are now.
MERGED = {
    "batchlab.core.batch": "Batch is in batchlab.core.scheduler now",
    "batchlab.core.sampling": (
        "SamplingParams and Sampler are in batchlab.core.request now, sample_rows in batchlab.core.runner"
    ),
    "batchlab.core.numbers": "is_int and is_number are in batchlab.core.request now",
    "batchlab.core.scheduler.stallfree": "StallFreeScheduler is in batchlab.core.scheduler now",
}


def _reference(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def earlier(module: str, name: str | None = None, quiet: bool = True):
    """The class an earlier lesson's piece defines, for a later piece to build on: the
    learner's, read from ``my_engine/<module>.py``, or -- when that file is missing, does
    not import, or is still the empty exercise -- the library's class, with one line
    naming the lesson and the file (``quiet=False``: a line when the learner's is used,
    too). Whether the learner's piece is *right* is its own lesson's checker's business."""
    lesson, default_name, reference = PIECES[module]
    name = name or default_name
    reference = OTHERS.get((module, name), reference)
    if _root is None:
        setup()
    path = _root / PACKAGE / f"{module}.py"
    why = None
    if not path.exists():
        why = "is not written yet"
    elif is_stub(path.read_text(encoding="utf-8")):
        why = "is not written yet (its file still holds the empty exercise)"
    else:
        found, why = _load(module)
        if why is None and not hasattr(found, name):
            why = f"is missing ({PACKAGE}/{module}.py defines no {name})"
    ref = _reference(reference)
    if why:
        print(
            f"Lesson {lesson}'s {name} ({PACKAGE}/{module}.py) {why}: the reference "
            f"{ref.__name__} stands in for it."
        )
        _stood_in.append((f"lesson {lesson}'s {name} ({PACKAGE}/{module}.py)", why))
        return ref
    if not quiet:
        print(f"Building on your {name} from lesson {lesson} ({PACKAGE}/{module}.py).")
    return getattr(found, name)


def choose(mine, verdict, reference):
    """The learner's piece if its checker passed, else ``reference``; prints which, in
    one line, so every measurement below is labelled honestly."""
    label = getattr(mine, "__name__", str(mine))
    if getattr(mine, "written", False):  # a saved file that cannot be used as it stands
        waits = mine.waiting_on
        why = f"cannot be built until {waits} works (its file builds on it)" if waits else "cannot run yet"
        said = "" if waits else f" ({mine.missing_reason})"
        print(
            f"Your {label} {why}{said}: the runs below use the reference {reference.__name__} in its place."
        )
        return reference
    if verdict and not isinstance(mine, Missing):
        print(f"Using your {label}: the runs below are your engine's.")
        return mine
    # a checker may cover several classes of a file (lesson 8): say what is true of this one
    checker = getattr(verdict, "name", "its checker")
    if not getattr(verdict, "not_written", False):
        why = f"Your {label}'s checker, {checker}, does not pass yet"
    elif isinstance(mine, Missing) or _holds_stub(mine):
        why = f"Your {label} is not written yet"
    else:
        why = f"Your {label}'s checker, {checker}, stopped at a part not written yet"
    print(f"{why}: the runs below use the reference {reference.__name__} in its place.")
    return reference


def _holds_stub(obj) -> bool:
    """True if ``obj``'s own source still holds an empty exercise (or cannot be read)."""
    try:
        return is_stub(inspect.getsource(obj))
    except (OSError, TypeError):
        return True


def mine_or_reference(module: str, check_fn=None):
    """A later lesson's way to run the learner's engine so far: the class from
    ``my_engine/<module>.py`` if it imports and is written (and passes ``check_fn``, when
    given, silently), else the library's; one line says which. Returns the class."""
    lesson, name, reference = PIECES[module]
    cls = piece(module, name)
    ref = _reference(reference)
    why = None
    if isinstance(cls, Missing):
        why = "is not written yet" if "does not exist" in cls.missing_reason else cls.missing_reason
    elif is_stub((_root / PACKAGE / f"{module}.py").read_text(encoding="utf-8")):
        why = "is not written yet"
    elif check_fn is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            ok = check_fn(cls)
        if not ok:
            why = "does not pass its checker yet"
    if why:
        print(
            f"Your {name} (lesson {lesson}, {PACKAGE}/{module}.py) {why}: the reference "
            f"{ref.__name__} stands in for it below."
        )
        return ref
    print(f"Using your {name} (lesson {lesson}, {PACKAGE}/{module}.py): the runs below are your engine's.")
    return cls
