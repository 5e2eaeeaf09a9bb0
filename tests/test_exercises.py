"""The exercise mechanism: reference solutions pass their checkers, the generated learner
copies fail them ("not written yet"), wrong answers get a message naming the failing case,
the generator is idempotent and touches only exercise cells, and the committed learner
copies are current."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
import mlx.core as mx
import nbformat
import numpy as np
from types import SimpleNamespace

import pytest

from batchlab.course import checks, exercises
from batchlab import course
from batchlab.course.checks import Verdict

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "notebooks"
LEARNER = LESSONS / "learner"
LESSON_FILES = sorted(LESSONS.glob("*.ipynb"))


def run_cell(source: str, ns: dict):
    """Run a cell's source like a notebook does; return the value of a final expression.
    A ``%%piece PATH`` cell writes its body to PATH under the course folder instead."""
    if source.startswith("%%piece "):
        first, _, body = source.partition("\n")
        target = Path(ns["__course_root__"]) / first.split(maxsplit=1)[1].strip()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
        return None
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), ns)
    if last is not None:
        return eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
    return None


def exercise_namespace(lm, root: Path) -> dict:
    """What exercise and checker cells may use (the convention in batchlab.course.exercises);
    ``root`` is the course folder where ``%%piece my_engine/...`` cells write."""
    course.setup(root)
    return {
        "mx": mx,
        "np": np,
        "batchlab": batchlab,
        "check": checks,
        "course": course,
        "lm": lm,
        "__course_root__": str(root),
    }


def run_exercises(nb, lm, root: Path) -> list[tuple[str, Verdict, str]]:
    """Run every exercise cell and its checker cell, in order, in one namespace:
    (checker cell source, verdict, printed text) for each."""
    ns = exercise_namespace(lm, root)
    results = []
    for ex, chk in exercises.exercise_pairs(nb):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run_cell(nb.cells[ex].source, ns)
            verdict = run_cell(nb.cells[chk].source, ns)
        results.append((nb.cells[chk].source, verdict, _without_stand_ins(out.getvalue())))
    return results


def _without_stand_ins(printed: str) -> str:
    """The checker's own words: without the line a later piece prints when an earlier
    lesson's piece is missing and the reference stands in for it (``course.earlier``)."""
    return "".join(
        line
        for line in printed.splitlines(keepends=True)
        if not (line.startswith("Lesson ") and "stands in for it" in line)
    )


# --------------------------------------------------------------------------------------
# The lessons' exercises, with solutions and without.


@pytest.mark.parametrize("path", LESSON_FILES, ids=[p.stem for p in LESSON_FILES])
def test_lesson_follows_the_exercise_convention(path):
    nb = nbformat.read(path, as_version=4)
    pairs = exercises.exercise_pairs(nb, path.name)
    assert len(pairs) >= 2, f"{path.name}: every lesson has at least two exercises"
    for ex, chk in pairs:
        assert "# NBVAL_CHECK_OUTPUT" in nb.cells[chk].source, (
            f"{path.name} cell {chk}: a checker cell's verdict is checked by nbval"
        )
        assert any(o.get("text", "").startswith(checks.OK) for o in nb.cells[chk].outputs), (
            f"{path.name} cell {chk}: the committed output should be the checker's ✓ verdict"
        )


def write_earlier_pieces(path: Path, root: Path) -> None:
    """Write the engine pieces of every lesson before ``path`` (their ``%%piece`` cells,
    with solutions) into ``root``: a lesson starts from the engine the earlier ones built
    (lesson 4's MyChunkedScheduler extends lesson 2's MyContinuousScheduler)."""
    ns = {"__course_root__": str(root)}
    for earlier in LESSON_FILES[: LESSON_FILES.index(path)]:
        for cell in nbformat.read(earlier, as_version=4).cells:
            if cell.cell_type == "code" and cell.source.startswith("%%piece "):
                run_cell(cell.source, ns)


@pytest.mark.parametrize("path", LESSON_FILES, ids=[p.stem for p in LESSON_FILES])
def test_reference_solutions_pass_every_checker(path, lm, tmp_path):
    nb = nbformat.read(path, as_version=4)
    write_earlier_pieces(path, tmp_path)
    for source, verdict, printed in run_exercises(nb, lm, tmp_path):
        assert isinstance(verdict, Verdict), f"{source!r} should end with the checker call"
        assert verdict, printed
        assert printed.strip() == verdict.message and printed.startswith(checks.OK)


@pytest.mark.parametrize("path", LESSON_FILES, ids=[p.stem for p in LESSON_FILES])
def test_generated_learner_copy_fails_every_checker(path, lm, tmp_path):
    shutil_copy(path, tmp_path / "src" / path.name)
    exercises.make_learner_copies(tmp_path / "src", tmp_path / "learner")
    clean = nbformat.read(tmp_path / "learner" / path.name, as_version=4)
    results = run_exercises(clean, lm, tmp_path / "course")
    assert results
    for source, verdict, printed in results:
        assert isinstance(verdict, Verdict)
        assert not verdict and verdict.not_written, printed
        assert printed.startswith(checks.FAIL) and "not written yet" in printed, printed
    for ex, chk in exercises.exercise_pairs(clean):
        cell = clean.cells[ex]
        assert exercises.PLACEHOLDER in cell.source and "NotImplementedError" in cell.source
        assert exercises.BEGIN not in cell.source and exercises.END not in cell.source
        assert cell.outputs == [] and clean.cells[chk].outputs == []


def shutil_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())


def test_committed_learner_copies_are_current():
    if not LESSON_FILES:
        pytest.skip("no lessons yet")
    problems = exercises.stale_learner_copies(LESSONS, LEARNER)
    assert not problems, (
        "\n".join(problems) + "\nIf you changed or re-executed a lesson, regenerate the learner "
        "copies: python -m batchlab.course.exercises notebooks notebooks/learner\n(If you did the "
        "exercises inside notebooks/learner/, this failure is expected: `git stash` them or "
        "save your work under another name.)"
    )


# --------------------------------------------------------------------------------------
# Checkers: wrong answers are named precisely.


def test_wrong_greedy_pick_names_the_failing_case(lm):
    verdict = checks.greedy_pick(lambda logits: int(mx.argmax(mx.abs(logits))), lm)
    assert not verdict and not verdict.not_written
    assert "case 3 of 5: logits [-5.0, -2.0, -9.0, -1.5]" in verdict.message
    assert "expected: 3" in verdict.message and "got:      2" in verdict.message
    assert verdict.passed == 3 and len(verdict.failed) == 2


def test_greedy_pick_on_tied_float16_logits_takes_any_of_the_tied_ids():
    """On a Mac the logits are float16 and tie often; ``mx.argmax`` may pick the last of the
    tied ids there, and that is right. A non-maximal id still fails."""
    row = [0.0] * 10
    row[3] = row[7] = 20.015625  # one float16 step above 20
    tied = SimpleNamespace(
        model=lambda ids: mx.array([[row]], dtype=mx.float16),
        tokenizer=SimpleNamespace(encode_chat=lambda messages: [1, 2, 3]),
    )

    def last_of_the_largest(logits):
        values = np.array(logits.astype(mx.float32))
        return int(np.flatnonzero(values == values.max())[-1])

    assert checks.greedy_pick(last_of_the_largest, tied)
    verdict = checks.greedy_pick(lambda logits: 7 if logits.size == 10 else int(mx.argmax(logits)), tied)
    assert verdict, "id 7 is tied for the largest logit"
    verdict = checks.greedy_pick(lambda logits: 2 if logits.size == 10 else int(mx.argmax(logits)), tied)
    assert not verdict and "case 5 of 5" in verdict.message


def test_greedy_pick_asks_for_a_python_int():
    verdict = checks.greedy_pick(lambda logits: mx.argmax(logits), None)
    assert not verdict
    assert "wrap it in int(...)" in verdict.message


def test_wrong_tokens_per_second_gets_a_diagnosis():
    verdict = checks.tokens_per_second(lambda steps, batch: float(np.mean([batch / t for t in steps])))
    assert verdict.passed == 4
    assert "case 3 of 5: 2 uneven steps" in verdict.message
    assert "average of the per-step rates" in verdict.message
    verdict = checks.tokens_per_second(lambda steps, batch: len(steps) / sum(steps))
    assert "case 2 of 5" in verdict.message and "leaves out the batch" in verdict.message


def test_a_crash_is_reported_with_the_case_and_the_error():
    def broken(steps, batch):
        return batch / 0

    verdict = checks.tokens_per_second(broken)
    assert not verdict
    assert "case 1 of 5" in verdict.message
    assert "raised ZeroDivisionError" in verdict.message and "batch / 0" in verdict.message


def test_not_a_function_and_not_written_yet():
    verdict = checks.tokens_per_second(3)
    assert not verdict and "Pass the function itself" in verdict.message

    def todo(steps, batch):
        raise NotImplementedError("tokens_per_second is not written yet")

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        verdict = checks.tokens_per_second(todo)
    assert not verdict and verdict.not_written
    assert out.getvalue().startswith("✗ tokens_per_second: not written yet")
    with pytest.raises(checks.CheckFailed):
        verdict.raise_if_failed()


def test_greedy_generate_without_a_cache_is_caught(lm):
    def no_cache(lm, ids, n):  # right tokens, but recomputes the whole sequence every step
        ids, new = list(ids), []
        for _ in range(n):
            token = int(mx.argmax(lm.model(mx.array([ids]))[0, -1]))
            new.append(token)
            ids.append(token)
            if token in lm.tokenizer.eos_token_ids:
                break
        return new

    verdict = checks.greedy_generate(no_cache, lm)
    assert verdict.passed == 5 and verdict.total == 6
    assert "case 6 of 6: uses the KV cache" in verdict.message
    assert "ran without a cache" in verdict.message


def test_greedy_generate_that_ignores_eos_is_caught(lm):
    def no_stop(lm, ids, n):
        cache = lm.model.make_cache()
        logits = lm.model(mx.array([ids]), cache=cache)
        new = []
        for _ in range(n):
            new.append(int(mx.argmax(logits[0, -1])))
            logits = lm.model(mx.array([[new[-1]]]), cache=cache)
        return new

    verdict = checks.greedy_generate(no_stop, lm)
    assert not verdict
    assert "case 3 of 6: the France question, n=12" in verdict.message
    assert "kept going after the EOS token 2" in verdict.message


# --------------------------------------------------------------------------------------
# The generator, on a small synthetic lesson (no model needed).

EXERCISE = '''def double(x):
    """Twice x."""
    ### BEGIN SOLUTION
    y = x + x
    return y
    ### END SOLUTION'''


def synthetic_lesson():
    nb = nbformat.v4.new_notebook()
    md = nbformat.v4.new_markdown_cell("# A lesson")
    setup = nbformat.v4.new_code_cell("value = 21")
    setup.outputs = [nbformat.v4.new_output("stream", text="kept\n")]
    setup.execution_count = 1
    ex = nbformat.v4.new_code_cell(EXERCISE)
    ex.execution_count = 2
    chk = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\ncheck.double(double)")
    chk.outputs = [nbformat.v4.new_output("stream", text="✓ double: 3/3 cases match\n")]
    chk.execution_count = 3
    top = nbformat.v4.new_code_cell("### BEGIN SOLUTION\nanswer = 42\n### END SOLUTION")
    chk2 = nbformat.v4.new_code_cell("check.answer(answer)")
    after = nbformat.v4.new_markdown_cell("The end.")
    nb.cells = [md, setup, ex, chk, top, chk2, after]
    for i, c in enumerate(nb.cells):
        c["id"] = f"cell{i}"
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def test_strip_solutions_keeps_indentation_and_names_the_function():
    assert exercises.strip_solutions(EXERCISE) == (
        'def double(x):\n    """Twice x."""\n    # YOUR CODE HERE\n'
        '    raise NotImplementedError("double is not written yet")'
    )
    assert exercises.strip_solutions("a = 1\n### BEGIN SOLUTION\nb = 2\n### END SOLUTION\nc = 3") == (
        'a = 1\n# YOUR CODE HERE\nraise NotImplementedError("this exercise is not written yet")\nc = 3'
    )
    clean = exercises.strip_solutions(EXERCISE)
    ns: dict = {}
    exec(clean, ns)  # the clean copy still defines the function...
    with pytest.raises(NotImplementedError, match="double is not written yet"):
        ns["double"](1)  # ...which says what is missing


@pytest.mark.parametrize(
    "source",
    [
        "### BEGIN SOLUTION\nx = 1",
        "x = 1\n### END SOLUTION",
        "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n### END SOLUTION",
    ],
)
def test_unbalanced_markers_are_errors(source):
    with pytest.raises(exercises.ExerciseFormatError):
        exercises.strip_solutions(source)


def test_an_exercise_needs_a_checker_cell():
    nb = synthetic_lesson()
    del nb.cells[3]  # the checker of `double`
    with pytest.raises(exercises.ExerciseFormatError, match="followed by a checker cell"):
        exercises.exercise_pairs(nb)


def test_learner_copy_strips_solutions_and_every_output():
    """Solutions leave the exercise cells only; outputs and execution counts leave every
    code cell (the "clean" convention); the rest is copied unchanged."""
    nb = synthetic_lesson()
    before = json.dumps(nb, sort_keys=True)
    clean = exercises.learner_notebook(nb, "01_synthetic.ipynb")
    assert json.dumps(nb, sort_keys=True) == before  # the source is not modified
    assert clean.cells[0].id == exercises.BANNER_ID and "../01_synthetic.ipynb" in clean.cells[0].source
    assert exercises.exercise_pairs(nb) == [(2, 3), (4, 5)]
    body = clean.cells[1:]
    for i, (old, new) in enumerate(zip(nb.cells, body)):
        if old.cell_type == "code":
            assert new.outputs == [] and new.execution_count is None
            if i not in (2, 4):
                assert new.source == old.source, f"cell {i}: only exercise cells change their source"
        else:
            assert new == old, f"cell {i} should be copied unchanged"
    assert body[3].source == nb.cells[3].source and body[5].source == nb.cells[5].source
    assert "y = x + x" not in body[2].source and "answer = 42" not in body[4].source


def test_generator_is_idempotent_and_cli_checks_staleness(tmp_path):
    src, out = tmp_path / "notebooks", tmp_path / "notebooks" / "learner"
    src.mkdir()
    nbformat.write(synthetic_lesson(), src / "01_synthetic.ipynb")
    assert exercises.make_learner_copies(src, out) == [out / "01_synthetic.ipynb"]
    first = (out / "01_synthetic.ipynb").read_bytes()
    assert exercises.make_learner_copies(src, out) == []  # nothing to rewrite
    assert (out / "01_synthetic.ipynb").read_bytes() == first
    assert exercises.stale_learner_copies(src, out) == []
    # a learner copy of a learner copy is itself
    clean = nbformat.read(out / "01_synthetic.ipynb", as_version=4)
    again = exercises.learner_notebook(clean, "01_synthetic.ipynb")
    assert nbformat.writes(again) == nbformat.writes(clean)
    # the command line: --check passes, then fails once the lesson changes, then regenerates
    cmd = [sys.executable, "-m", "batchlab.course.exercises", str(src), str(out)]
    assert subprocess.run(cmd + ["--check"], capture_output=True).returncode == 0
    nb = synthetic_lesson()
    nb.cells[0].source = "# A changed lesson"
    nbformat.write(nb, src / "01_synthetic.ipynb")
    assert exercises.main([str(src), str(out), "--check"]) == 1
    assert exercises.main([str(src), str(out)]) == 0
    assert "# A changed lesson" in (out / "01_synthetic.ipynb").read_text()
    # a copy whose lesson was deleted is removed
    (src / "01_synthetic.ipynb").rename(src / "02_renamed.ipynb")
    exercises.make_learner_copies(src, out)
    assert sorted(p.name for p in out.glob("*.ipynb")) == ["02_renamed.ipynb"]


def _names(source: str) -> tuple[set[str], set[str]]:
    """What a cell defines at its top level, and the global names its code reads but does
    not define (builtins left out)."""
    import builtins
    import symtable

    if source.startswith("%%piece "):
        return set(), set()
    table = symtable.symtable(source, "<cell>", "exec")
    defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    read, tables = {s.get_name() for s in table.get_symbols() if s.is_referenced()}, [table]
    while tables:
        t = tables.pop()
        tables.extend(t.get_children())
        read |= {s.get_name() for s in t.get_symbols() if s.is_referenced() and s.is_global()}
    return defined, read - defined - set(dir(builtins))


def test_the_names_check_sees_a_name_from_elsewhere():
    assert _names("verdict = check.server_events(mine, tok)\nverdict")[1] == {"check", "mine", "tok"}
    assert _names("def f(x):\n    return y + x\n")[1] == {"y"}
    assert _names("import json\nz = [json.dumps(v) for v in lm]")[1] == {"lm"}


@pytest.mark.parametrize("path", LESSON_FILES, ids=[p.stem for p in LESSON_FILES])
def test_exercise_cells_use_only_the_conventions_names(path):
    """The tests run exercise and checker cells in one namespace (``exercise_namespace``):
    a cell that reads a name the lesson defines elsewhere (``tok``) passes in the notebook
    and fails there. Caught here, without the model."""
    nb = nbformat.read(path, as_version=4)
    allowed = {"mx", "np", "batchlab", "check", "course", "lm"}
    for ex, chk in exercises.exercise_pairs(nb):
        for i in (ex, chk):
            defined, read = _names(nb.cells[i].source)
            assert read <= allowed, (
                f"{path.name} cell {i} reads {sorted(read - allowed)}, outside the convention"
            )
            allowed |= defined  # later exercise cells may read what this one defines
