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
    "continuous": "MyStaticScheduler",
    "chunked": "MyContinuousScheduler",
    "stallfree": "MyChunkedScheduler",
    "memory": "MyStallFreeScheduler",
    "aging": "MyVictimPolicy",
    "speculative": "MyMemoryScheduler",
    "structured": "MyEngine",
}


def lesson_notebook(piece: str) -> Path | None:
    """The committed notebook of the lesson where ``piece`` is written (None: not committed yet)."""
    from batchlab.course.pieces import PIECES as REGISTERED

    lesson = REGISTERED[piece][0]
    number = re.match(r"\d+", lesson).group()
    found = sorted((ROOT / "notebooks").glob(f"{int(number):02d}{lesson[len(number) :]}_*.ipynb"))
    return found[0] if found else None


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


EARLIER = re.compile(r"course\.earlier\(([^)]*)\)")


def test_a_lesson_runs_a_learners_piece_only_once_its_checker_passes():
    """Outside ``%%piece`` cells a lesson takes the learner's engine classes through
    ``course.mine_or_reference`` with a checker, so a piece that is written but wrong never runs a
    lesson's measurements; ``course.earlier`` (no check, for a piece to build on) is left for the
    second classes of a piece's file, which its piece's checker checks with it."""
    from batchlab.course.pieces import OTHERS

    seconds = {f'"{module}", "{name}"' for module, name in OTHERS}
    found = [
        (p.name, m.group(1))
        for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
        for c in nbformat.read(p, as_version=4).cells
        if c.cell_type == "code" and not c.source.startswith("%%piece")
        for m in EARLIER.finditer(c.source)
    ]
    assert found, "no lesson calls course.earlier outside a piece: the pattern is stale"
    unchecked = [(name, args) for name, args in found if args not in seconds]
    assert not unchecked, f"a lesson runs a piece with no checker (use course.mine_or_reference): {unchecked}"


@pytest.mark.parametrize("piece, base", LINEAGE.items())
def test_each_piece_subclasses_the_learners_previous_one(piece, base):
    if lesson_notebook(piece) is None:
        pytest.skip(f"the lesson of my_engine/{piece}.py has no committed notebook yet")
    cells = [
        c.source
        for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
        for c in nbformat.read(p, as_version=4).cells
        if c.cell_type == "code" and c.source.startswith(f"%%piece my_engine/{piece}.py")
    ]
    assert len(cells) == 1, f"one cell writes my_engine/{piece}.py"
    assert f"{base} = course.earlier(" in cells[0] and re.search(
        rf"class My\w+\((OnDemandKV, )?{base}\)", cells[0]
    )


# what a piece may extend: the bases that decide nothing, and the learner's own classes
BASES = {
    "batchlab.core.scheduler.base.Scheduler",
    "batchlab.core.engine.EngineBase",
    "batchlab.core.policies.Policy",
    "batchlab.core.policies.AdmissionBase",
    "batchlab.core.scheduler.continuous.OnDemandKV",  # a mechanism: its admission rule is the kind's
    "batchlab.serving.server.ServerBase",
    "batchlab.core.structured.Constraint",
    "builtins.object",
}
PIECES = {
    "static",
    "continuous",
    "chunked",
    "stallfree",
    "front",
    "server",
    "memory",
    "policy",
    "aging",
    "speculative",
    "structured",
}


def test_every_registered_piece_is_written_by_its_lesson_once_committed():
    """``course.pieces.PIECES`` names every piece; those whose lesson's notebook is committed are
    the pieces the lessons write (the ancestry test below walks them); the others wait for theirs."""
    from batchlab.course.pieces import PIECES as REGISTERED

    assert PIECES == {piece for piece in REGISTERED if lesson_notebook(piece) is not None}
    assert set(LINEAGE) <= set(REGISTERED)


WALK = """
import json, sys
from pathlib import Path
import nbformat
from batchlab import course

root, lessons = Path(sys.argv[1]), sys.argv[2:]
course.setup(root)
found = {}
for lesson in lessons:
    for cell in nbformat.read(lesson, as_version=4).cells:
        if cell.cell_type == "code" and cell.source.startswith("%%piece "):
            head, _, body = cell.source.partition("\\n")
            course.write_piece(head.split()[1], body)
            found[Path(head.split()[1]).stem] = None
ancestry = {}
for module in found:
    loaded = __import__(f"my_engine.{module}", fromlist=["*"])
    for name, obj in vars(loaded).items():
        if isinstance(obj, type) and obj.__module__ == loaded.__name__:
            ancestry[f"{module}:{name}"] = [f"{k.__module__}.{k.__qualname__}" for k in obj.__mro__]
print(json.dumps(ancestry))
"""


def test_no_learner_class_has_a_reference_in_its_ancestry(tmp_path):
    """Every class the lessons' pieces define (their solutions written as a learner would,
    in lesson order) extends only a base that decides nothing, or the learner's own
    classes: no shipped kind, policy or front is among its ancestors."""
    import json
    import subprocess
    import sys

    lessons = [str(p) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    done = subprocess.run(
        [sys.executable, "-c", WALK, str(tmp_path), *lessons], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    ancestry = json.loads(done.stdout.strip().splitlines()[-1])
    assert {key.split(":")[0] for key in ancestry} == PIECES
    on_a_reference = {}
    for key, mro in ancestry.items():
        ours = [k for k in mro if not k.startswith("my_engine.") and k not in BASES]
        if ours:
            on_a_reference[key] = ours[0]
    assert not on_a_reference, f"pieces on a reference: {on_a_reference}"


def delegating(cls: type, only: str | None = None) -> type:
    """``cls`` with every method it defines (but ``__init__``), or only the method ``only``,
    replaced by a call to ``super()``: the piece a learner would write to pass without writing
    anything, or without writing that one method."""
    import inspect

    made: list[type] = []

    def through_super(name, generator, async_generator):
        if async_generator:

            async def method(self, *args, **kwargs):
                async for item in getattr(super(made[0], self), name)(*args, **kwargs):
                    yield item
        elif generator:

            def method(self, *args, **kwargs):
                yield from getattr(super(made[0], self), name)(*args, **kwargs)
        else:

            def method(self, *args, **kwargs):
                return getattr(super(made[0], self), name)(*args, **kwargs)

        return method

    body = {
        name: through_super(name, inspect.isgeneratorfunction(value), inspect.isasyncgenfunction(value))
        if inspect.isfunction(value) and name != "__init__" and only in (None, name)
        else value
        for name, value in vars(cls).items()
        if name not in ("__dict__", "__weakref__")
    }
    made.append(type(cls.__name__, cls.__bases__, body))
    return made[0]


def _pieces_and_checkers():
    import learner_pieces as L

    return [
        ("static_scheduler", (L.MyStaticScheduler,), 0),
        ("continuous_scheduler", (L.MyContinuousScheduler,), 0),
        ("chunked_scheduler", (L.MyChunkedScheduler,), 0),
        ("stallfree_planner", (L.MyStallFreeScheduler,), 0),
        ("memory_scheduler", (L.MyMemoryScheduler, L.MyVictimPolicy), 0),
        ("memory_scheduler", (L.MyMemoryScheduler, L.MyVictimPolicy), 1),
        ("engine_front", (L.MyEngine,), 0),
        ("server_events", (L.MyServer,), 0),
        ("admission_policy", (L.MyAdmission,), 0),
        ("aging_policy", (L.MyAgingPolicy,), 0),
        ("speculative_scheduler", (L.propose, L.MySpeculativeScheduler), 1),
    ]


@pytest.mark.parametrize(
    "checker, pieces, which", _pieces_and_checkers(), ids=lambda v: getattr(v, "__name__", None)
)
def test_no_checker_accepts_a_piece_that_only_delegates_to_super(checker, pieces, which, request):
    """Every lesson's piece, each of its methods replaced by ``super()``: the call reaches a base
    that decides nothing (it raises "must write"), or the learner's own earlier piece, which does
    not do this lesson's new thing. Either way the checker refuses it; the right piece passes."""
    import contextlib
    import io

    from batchlab.course import checks
    from batchlab.model.tokenizer import Tokenizer

    extra = (
        (Tokenizer.from_gguf_metadata(request.getfixturevalue("gguf_meta")),)
        if checker == "server_events"
        else ()
    )
    with contextlib.redirect_stdout(io.StringIO()):
        assert getattr(checks, checker)(*pieces, *extra), f"{checker}: the lesson's own piece must pass"
        lazy = list(pieces)
        lazy[which] = delegating(pieces[which])
        verdict = getattr(checks, checker)(*lazy, *extra)
    assert not verdict, f"{checker} accepted {pieces[which].__name__} whose methods only call super()"


def _one_method_each():
    import inspect

    return [
        (checker, pieces, which, name)
        for checker, pieces, which in _pieces_and_checkers()
        for name, value in vars(pieces[which]).items()
        if inspect.isfunction(value) and not name.startswith("_")  # the methods the lesson asks for
    ]


@pytest.mark.parametrize(
    "checker, pieces, which, method",
    _one_method_each(),
    ids=lambda v: getattr(v, "__name__", v if isinstance(v, str) else None),
)
def test_no_checker_accepts_a_piece_with_one_method_left_to_super(checker, pieces, which, method, request):
    """The same, one method at a time: each method a lesson asks for is one its checker needs."""
    import contextlib
    import io

    from batchlab.course import checks
    from batchlab.model.tokenizer import Tokenizer

    extra = (
        (Tokenizer.from_gguf_metadata(request.getfixturevalue("gguf_meta")),)
        if checker == "server_events"
        else ()
    )
    lazy = list(pieces)
    lazy[which] = delegating(pieces[which], only=method)
    with contextlib.redirect_stdout(io.StringIO()):
        verdict = getattr(checks, checker)(*lazy, *extra)
    assert not verdict, f"{checker} accepted {pieces[which].__name__} whose {method} only calls super()"
