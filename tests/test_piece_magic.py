"""Work is never lost: the ``%%piece`` cell magic (``course.write_piece``) keeps every
earlier version, refuses to write an empty exercise over a written piece, and a later
piece builds on an earlier lesson's (``course.earlier``) or says which reference stands in."""

from __future__ import annotations

import sys

import pytest

from batchlab import course

WRITTEN = """from batchlab.core.scheduler import ContinuousScheduler


class MyContinuousScheduler(ContinuousScheduler):
    def admit(self):
        return super().admit()
"""
STUB = """from batchlab.core.scheduler import ContinuousScheduler


class MyContinuousScheduler(ContinuousScheduler):
    def admit(self):
        # YOUR CODE HERE
        raise NotImplementedError("admit is not written yet")
"""


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    course.setup(tmp_path)
    yield tmp_path
    for name in [m for m in sys.modules if m == "my_engine" or m.startswith("my_engine.")]:
        del sys.modules[name]


def test_a_new_piece_is_saved(folder):
    said = course.write_piece("my_engine/continuous.py", WRITTEN)
    assert said == "Saved my_engine/continuous.py."
    assert (folder / "my_engine" / "continuous.py").read_text() == WRITTEN


def test_writing_a_different_version_keeps_the_old_one_in_history(folder):
    course.write_piece("my_engine/continuous.py", WRITTEN)
    second = WRITTEN.replace("return super().admit()", "super().admit()")
    said = course.write_piece("my_engine/continuous.py", second)
    kept = folder / "my_engine" / ".history" / "continuous.1.py"
    assert said == (
        "Saved my_engine/continuous.py; your previous version is kept as my_engine/.history/continuous.1.py."
    )
    assert kept.read_text() == WRITTEN
    course.write_piece("my_engine/continuous.py", WRITTEN)
    assert (folder / "my_engine" / ".history" / "continuous.2.py").read_text() == second
    assert len(said.splitlines()) == 1


def test_the_same_version_again_writes_nothing(folder):
    course.write_piece("my_engine/continuous.py", WRITTEN)
    assert "unchanged" in course.write_piece("my_engine/continuous.py", WRITTEN)
    assert not (folder / "my_engine" / ".history").exists()


def test_an_empty_exercise_never_replaces_a_written_piece(folder):
    course.write_piece("my_engine/continuous.py", WRITTEN)
    said = course.write_piece("my_engine/continuous.py", STUB)
    assert (folder / "my_engine" / "continuous.py").read_text() == WRITTEN
    assert "already holds your piece (lesson 2)" in said and "did not replace it" in said
    assert "%%piece --force my_engine/continuous.py" in said  # how to start over
    said = course.write_piece("my_engine/continuous.py", STUB, force=True)
    assert (folder / "my_engine" / "continuous.py").read_text() == STUB
    assert (folder / "my_engine" / ".history" / "continuous.1.py").read_text() == WRITTEN


def test_an_empty_exercise_is_saved_where_nothing_is_written_yet(folder):
    course.write_piece("my_engine/continuous.py", STUB)
    assert (folder / "my_engine" / "continuous.py").read_text() == STUB


def test_the_cell_magic_is_registered_by_setup_and_writes_through_write_piece(folder, capsys):
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    memory = Config()  # no history file: the shell would write one as the process exits
    memory.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=memory)
    try:
        course.setup(folder)
        shell.run_cell_magic("piece", "my_engine/continuous.py", WRITTEN)
        assert capsys.readouterr().out.strip() == "Saved my_engine/continuous.py."
        shell.run_cell_magic("piece", "my_engine/continuous.py", STUB)
        assert "did not replace it" in capsys.readouterr().out
        shell.run_cell_magic("piece", "--force my_engine/continuous.py", STUB)
        assert "previous version is kept" in capsys.readouterr().out
    finally:
        InteractiveShell.clear_instance()


def test_a_later_piece_builds_on_the_learners_earlier_one(folder, capsys):
    course.write_piece("my_engine/continuous.py", WRITTEN)
    cls = course.earlier("continuous")
    assert cls.__name__ == "MyContinuousScheduler"
    assert capsys.readouterr().out == ""  # a line only when a reference stands in
    course.earlier("continuous", quiet=False)
    assert "Building on your MyContinuousScheduler from lesson 2" in capsys.readouterr().out


@pytest.mark.parametrize("source", [None, STUB, "this is not python ("])
def test_a_missing_earlier_piece_is_the_reference_and_the_lesson_says_which(folder, capsys, source):
    from batchlab.core.scheduler import ContinuousScheduler

    if source is not None:
        (folder / "my_engine" / "continuous.py").write_text(source)
    assert course.earlier("continuous") is ContinuousScheduler
    said = capsys.readouterr().out.strip()
    assert len(said.splitlines()) == 1
    assert said.startswith("Lesson 2's MyContinuousScheduler (my_engine/continuous.py)")
    assert "the reference ContinuousScheduler stands in for it" in said


SPECULATIVE = """def propose(tokens, k, min_n=1, max_n=4):
    return []
"""


def test_a_function_of_a_piece_is_read_like_a_class(folder, capsys):
    """Lesson 11's file holds a function (``propose``) beside its class: ``piece`` and ``earlier``
    read it from the file, or name the reference function standing in for it."""
    from batchlab.core.speculative import propose_ngram

    missing = course.piece("speculative", "propose")
    assert not missing and "lesson 11" in missing.missing_reason
    assert course.earlier("speculative", "propose") is propose_ngram
    said = capsys.readouterr().out.strip()
    assert said == (
        "Lesson 11's propose (my_engine/speculative.py) is not written yet: the reference propose_ngram "
        "stands in for it."
    )
    course.write_piece("my_engine/speculative.py", SPECULATIVE)
    mine = course.piece("speculative", "propose")
    assert callable(mine) and mine.__name__ == "propose" and mine([1, 2, 1], 2) == []
    assert course.earlier("speculative", "propose")([1, 2, 1], 2) == []
    assert (
        "defines no MySpeculativeScheduler"
        in course.piece("speculative", "MySpeculativeScheduler").missing_reason
    )


def test_not_written_yet_names_the_lesson_and_the_file(folder):
    missing = course.piece("chunked", "MyChunkedScheduler")
    assert "my_engine/chunked.py" in missing.missing_reason
    assert "lesson 4" in missing.missing_reason


@pytest.mark.parametrize(
    "target", ["../elsewhere.py", "my_engine/../outside.py", "my_engine/sub/deep.py", "my_engine/notes.txt"]
)
def test_a_piece_path_outside_my_engine_is_refused_and_nothing_is_written(folder, target):
    before = sorted(p.relative_to(folder.parent) for p in folder.parent.rglob("*"))
    with pytest.raises(ValueError, match="nothing was written"):
        course.write_piece(target, WRITTEN)
    assert sorted(p.relative_to(folder.parent) for p in folder.parent.rglob("*")) == before


def test_an_absolute_path_into_my_engine_is_accepted(folder):
    said = course.write_piece(folder / "my_engine" / "continuous.py", WRITTEN)
    assert said == "Saved my_engine/continuous.py."


# A written piece that fails its checker, or does not import: the reference runs, and one line says why.
WRONG = """from batchlab.core.scheduler import ContinuousScheduler


class MyContinuousScheduler(ContinuousScheduler):
    def admit_next(self, max_tokens):
        return None  # never starts anyone
"""


def test_a_piece_that_fails_its_checker_is_replaced_by_the_reference(folder, capsys):
    from batchlab.core.scheduler import ContinuousScheduler
    from batchlab.course import checks as check

    course.write_piece("my_engine/continuous.py", WRONG)
    mine = course.piece("continuous", "MyContinuousScheduler")
    verdict = check.continuous_scheduler(mine)
    assert not verdict, verdict.message
    capsys.readouterr()
    assert course.choose(mine, verdict, ContinuousScheduler) is ContinuousScheduler
    said = capsys.readouterr().out
    assert said.strip().splitlines() == [
        "Your MyContinuousScheduler's checker, continuous_scheduler, does not pass yet: the runs below use "
        "the reference "
        "ContinuousScheduler in its place."
    ]
    assert course.mine_or_reference("continuous", check.continuous_scheduler) is ContinuousScheduler
    said = capsys.readouterr().out
    assert "does not pass its checker yet" in said and "my_engine/continuous.py" in said, said
    assert len(said.strip().splitlines()) == 1, said  # the checker's own report stays quiet here


def test_a_piece_that_does_not_import_is_replaced_and_the_line_says_where(folder, capsys):
    from batchlab.core.scheduler import ContinuousScheduler

    course.write_piece("my_engine/continuous.py", WRITTEN + "\nundefined_name + 1\n")
    assert course.mine_or_reference("continuous") is ContinuousScheduler
    said = capsys.readouterr().out
    assert "NameError" in said and "continuous.py" in said and "stands in" in said, said


def test_an_unwritten_piece_is_said_to_be_unwritten_not_failing(folder, capsys):
    from batchlab.core.scheduler import ContinuousScheduler
    from batchlab.course import checks as check

    course.write_piece("my_engine/continuous.py", STUB)
    mine = course.piece("continuous", "MyContinuousScheduler")
    verdict = check.continuous_scheduler(mine)
    capsys.readouterr()
    assert course.choose(mine, verdict, ContinuousScheduler) is ContinuousScheduler
    assert "is not written yet" in capsys.readouterr().out
    assert course.mine_or_reference("continuous", check.continuous_scheduler) is ContinuousScheduler
    assert "is not written yet" in capsys.readouterr().out


def test_a_piece_built_on_a_missing_earlier_piece_says_to_write_that_one_first(folder, capsys):
    """Lesson 8 mixes ``OnDemandKV`` into the learner's lesson-5a planner. With lesson 5a's file
    missing, the library's StallFreeScheduler stands in, and it already holds OnDemandKV, so
    Python cannot order the bases: the reason names the missing piece, not a riddle."""
    (folder / "my_engine" / "memory.py").write_text(
        "from batchlab import course\n"
        "from batchlab.core.scheduler import OnDemandKV\n"
        "MyStallFreeScheduler = course.earlier('stallfree')\n"
        "class MyMemoryScheduler(OnDemandKV, MyStallFreeScheduler):\n"
        "    pass\n"
        "class MyVictimPolicy:\n"
        "    pass\n"
    )
    missing = course.piece("memory", "MyMemoryScheduler")
    assert not missing and capsys.readouterr().out == ""
    reason = missing.missing_reason
    assert (
        "builds on lesson 5a's MyStallFreeScheduler (my_engine/stallfree.py), which is not written yet"
        in reason
    )
    assert "Make that piece work first" in reason
    assert missing.waiting_on == "lesson 5a's MyStallFreeScheduler (my_engine/stallfree.py)"
    # the checker and the lesson's choice say it cannot run yet, not that it is unwritten
    from batchlab.core.policies import PriorityPolicy
    from batchlab.core.scheduler import StallFreeScheduler
    from batchlab.course import checks

    verdict = checks.memory_scheduler(missing, course.piece("memory", "MyVictimPolicy"))
    assert not verdict and "memory_scheduler: cannot run yet (my_engine/memory.py cannot be built yet" in str(
        verdict.message
    )
    assert course.choose(missing, verdict, StallFreeScheduler) is StallFreeScheduler
    policy = course.piece("memory", "MyVictimPolicy")
    assert course.choose(policy, verdict, PriorityPolicy) is PriorityPolicy
    said = capsys.readouterr().out
    assert (
        "Your MyMemoryScheduler cannot be built until lesson 5a's MyStallFreeScheduler "
        "(my_engine/stallfree.py) works (its file builds on it): the runs below use the reference "
        "StallFreeScheduler" in said
    )
    assert "Your MyVictimPolicy cannot be built until" in said
    assert "stands in" not in said  # the library's class could not stand in: no line says it did
    # an error of the learner's own, with every earlier piece there, is reported as it is
    (folder / "my_engine" / "memory.py").write_text("class A: pass\nclass B(A, A): pass\n")
    assert "builds on" not in course.piece("memory", "A").missing_reason


def test_choose_names_the_unwritten_class_of_a_check_shared_by_two(folder, capsys):
    """Lesson 8 checks MyMemoryScheduler and MyVictimPolicy together: when the check stops at an
    unwritten method, only the class that holds it is "not written yet"."""
    from batchlab.core.policies import PriorityPolicy
    from batchlab.core.scheduler import StallFreeScheduler
    from batchlab.course.checks._core import Verdict

    (folder / "my_engine" / "memory.py").write_text(
        "class MyMemoryScheduler:\n"
        "    def fits(self, req, max_tokens):\n"
        "        # YOUR CODE HERE\n"
        "        raise NotImplementedError('fits is not written yet')\n\n\n"
        "class MyVictimPolicy:\n"
        "    def victim(self, running):\n"
        "        return running[-1]\n"
    )
    stopped = Verdict("memory_scheduler", 0, 3, "not written yet", [], not_written=True)
    assert (
        course.choose(course.piece("memory", "MyMemoryScheduler"), stopped, StallFreeScheduler)
        is StallFreeScheduler
    )
    assert course.choose(course.piece("memory", "MyVictimPolicy"), stopped, PriorityPolicy) is PriorityPolicy
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first.startswith("Your MyMemoryScheduler is not written yet:")
    assert second.startswith(
        "Your MyVictimPolicy's checker, memory_scheduler, stopped at a part not written yet:"
    )


def test_a_written_file_that_does_not_import_cannot_run_yet_it_is_not_unwritten(folder, capsys):
    """A slip in a saved piece (here an IndentationError): the checker and the lesson say it
    cannot run yet and why, not that the learner has still to write it."""
    from batchlab.core.scheduler import ContinuousScheduler
    from batchlab.course import checks as check

    course.write_piece("my_engine/continuous.py", WRITTEN + "  LIMIT = 1\n")  # unindent matches no level
    mine = course.piece("continuous", "MyContinuousScheduler")
    assert not mine and mine.written and "IndentationError" in mine.missing_reason
    verdict = check.continuous_scheduler(mine)
    assert (
        not verdict
        and "continuous_scheduler: cannot run yet (my_engine/continuous.py does not import"
        in str(verdict.message)
    )
    capsys.readouterr()
    assert course.choose(mine, verdict, ContinuousScheduler) is ContinuousScheduler
    said = capsys.readouterr().out
    assert said.startswith(
        "Your MyContinuousScheduler cannot run yet (my_engine/continuous.py does not import"
    )
    assert "not written" not in said
    # a file that does not exist is still "not written yet", and says which cell writes it
    missing = course.piece("chunked", "MyChunkedScheduler")
    assert not missing.written and "run lesson 4's cell that starts with %%piece" in missing.missing_reason
    assert "not written yet" in str(check.continuous_scheduler(missing).message)


def test_a_piece_saved_with_an_import_batchlab_has_since_merged_says_where_the_name_is_now(folder):
    """Issue 42 merged ``core.batch`` into ``core.scheduler`` (and three more): a learner's file
    saved before that upgrade cannot import; the reason names the new home of what it wanted."""
    from batchlab.course.pieces import MERGED

    old = WRITTEN.replace(
        "from batchlab.core.scheduler import ContinuousScheduler\n",
        "from batchlab.core.batch import Batch\nfrom batchlab.core.scheduler import ContinuousScheduler\n",
    )
    course.write_piece("my_engine/continuous.py", old)
    mine = course.piece("continuous", "MyContinuousScheduler")
    assert not mine and mine.written
    assert "No module named 'batchlab.core.batch'" in mine.missing_reason, mine.missing_reason
    assert "Batch is in batchlab.core.scheduler now: change that import line" in mine.missing_reason
    # every merged path is really gone, and every name it points to is where it says
    import importlib

    homes = {
        "batchlab.core.batch": [("Batch", "batchlab.core.scheduler")],
        "batchlab.core.sampling": [
            ("SamplingParams", "batchlab.core.request"),
            ("Sampler", "batchlab.core.request"),
            ("sample_rows", "batchlab.core.runner"),
        ],
        "batchlab.core.numbers": [
            ("is_int", "batchlab.core.request"),
            ("is_number", "batchlab.core.request"),
        ],
        "batchlab.core.scheduler.stallfree": [("StallFreeScheduler", "batchlab.core.scheduler")],
    }
    assert set(homes) == set(MERGED)
    for path, names in homes.items():
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(path)
        for name, home in names:
            assert name in MERGED[path] and home in MERGED[path], (path, MERGED[path])
            assert hasattr(importlib.import_module(home), name), (name, home)
