"""Learner code cannot hang or crash a lesson (``course.guard``, used by the checkers' one harness,
``checks._core._run``, and by ``course.piece`` / ``earlier``): a piece that loops forever, blocks,
returns the wrong type, does not import or changes the library gets a failed verdict that names
the method or the file, within the time limit, and the next checker call still passes."""

from __future__ import annotations

import contextlib
import io
import sys
import threading

import pytest

import learner_pieces
from batchlab import course
from batchlab.core.scheduler import KINDS, Batch, Scheduler, StaticScheduler
from batchlab.course import checks, guard

FOREVER = threading.Event()  # never set while a test runs: what a blocking piece waits on


@pytest.fixture(autouse=True)
def let_go():
    """Threads left waiting on ``FOREVER`` are let go at the end of each test."""
    yield
    FOREVER.set()
    FOREVER.clear()


@pytest.fixture
def small_limit(monkeypatch):
    """A limit of a fraction of a second, so a hanging piece costs the suite little (only for the
    pieces that hang: a right case on a loaded machine may need more)."""
    monkeypatch.setattr(guard, "CASE_LIMIT_S", 0.5)
    monkeypatch.setattr(guard, "STOP_GRACE_S", 0.5)


def verdict_of(checker: str, *pieces, deadline_s: float = 60):
    """``check.<checker>(*pieces)`` in a thread of its own, awaited up to ``deadline_s``: the verdict,
    or a failure saying the checker itself hung."""
    got = {}

    def run():
        with contextlib.redirect_stdout(io.StringIO()):
            got["verdict"] = getattr(checks, checker)(*pieces)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"check.{checker} did not answer within {deadline_s} s"
    return got["verdict"]


def assert_passes(checker: str, *pieces) -> None:
    """A right piece, checked next in the same process, passes (under a roomy limit: a loaded
    machine may take a while over a right case)."""
    small = guard.CASE_LIMIT_S
    guard.CASE_LIMIT_S = 60.0
    try:
        verdict = verdict_of(checker, *pieces, deadline_s=600)
    finally:
        guard.CASE_LIMIT_S = small
    assert verdict, verdict.message


def line_of(text: str) -> int:
    """The line of this file that holds ``text`` (what a verdict should point at)."""
    with open(__file__, encoding="utf-8") as f:
        return next(n for n, line in enumerate(f, 1) if text in line)


# -- 1. a time limit on every call into the learner's code --------------------------------------


class LoopsInAdmit(learner_pieces.MyContinuousScheduler):
    def admit(self):
        while True:  # the endless loop
            pass


class BlocksInPoll(learner_pieces.MyEngine):
    def poll(self, req_id):
        FOREVER.wait()  # blocks inside C: cannot be interrupted, only left behind
        return super().poll(req_id)


def test_an_endless_loop_in_admit_is_stopped_and_named(small_limit):
    verdict = verdict_of("continuous_scheduler", LoopsInAdmit)
    assert not verdict
    assert "did not finish within 0.5 s: still running LoopsInAdmit.admit" in verdict.message
    assert f"(checker_guard_cases.py, line {line_of('while True:  # the endless loop')})" in verdict.message
    assert "an endless loop?" in verdict.message
    assert "case 4 was not run" in verdict.message  # not 13 x the limit: after 2 cases ran out of time
    assert "(2 cases ran out of time, so the rest were not run)" in verdict.message
    assert_passes("continuous_scheduler", learner_pieces.MyContinuousScheduler)


def test_a_poll_that_blocks_forever_is_left_behind_and_named(small_limit):
    verdict = verdict_of("engine_front", BlocksInPoll)
    assert not verdict
    line = line_of("FOREVER.wait()  # blocks")
    assert f"still running BlocksInPoll.poll (checker_guard_cases.py, line {line})" in verdict.message
    assert "could not be stopped" in verdict.message
    assert_passes("engine_front", learner_pieces.MyEngine)


class LoopsInNextQueued(learner_pieces.MyAgingPolicy):
    def next_queued(self, queue):
        while True:  # the queue order that never decides
            pass


def test_an_endless_loop_in_a_policy_is_stopped_and_named(small_limit):
    verdict = verdict_of("aging_policy", LoopsInNextQueued)
    assert not verdict
    assert "did not finish within 0.5 s: still running LoopsInNextQueued.next_queued" in verdict.message
    assert_passes("aging_policy", learner_pieces.MyAgingPolicy)


def propose_forever(tokens, k, min_n=1, max_n=4):
    n = min_n
    while tokens[-n:] != tokens[:n]:  # the search that never moves on
        pass
    return tokens[n : n + k]


class LoopsInAccept(learner_pieces.MySpeculativeScheduler):
    def accept(self, req, drafts, picks):
        kept = []
        while len(kept) < len(drafts) and drafts[len(kept)] == picks[len(kept)]:
            kept.append(drafts[len(kept)])
        while len(kept) == len(drafts):  # the bonus that never comes
            pass
        return kept + [picks[len(kept)]]


def test_an_endless_loop_in_a_function_piece_is_stopped_and_named(small_limit):
    """Lesson 11's propose is a function of the piece's file, not a method: it is stopped and named
    the same way, and so is a loop in the scheduler's accept."""
    verdict = verdict_of("speculative_scheduler", propose_forever, learner_pieces.MySpeculativeScheduler)
    assert not verdict and "did not finish within 0.5 s: still running propose_forever" in verdict.message
    assert f"(checker_guard_cases.py, line {line_of('# the search that never moves on')})" in verdict.message
    verdict = verdict_of("speculative_scheduler", learner_pieces.propose, LoopsInAccept)
    assert not verdict and "still running LoopsInAccept.accept" in verdict.message, verdict.message
    assert_passes("speculative_scheduler", learner_pieces.propose, learner_pieces.MySpeculativeScheduler)


def test_a_case_that_finishes_in_time_is_judged_as_before():
    outcome = guard.run_guarded(lambda: 6 * 7)
    assert (outcome.value, outcome.error, outcome.late) == (42, None, None)
    raised = guard.run_guarded(lambda: 1 / 0).error
    assert isinstance(raised, ZeroDivisionError)


def test_a_stop_that_lands_after_the_call_returned_does_not_escape(monkeypatch):
    """The watchdog's last signal can land while the guard cleans up after a call that has just
    returned (it was seen in the join): the guard must still return the call's outcome, never
    raise the stop at its caller."""
    real = threading.Thread

    class LateStop(real):
        landed = False

        def join(self, *args, **kwargs):
            if self.name == "batchlab-watchdog" and not LateStop.landed:
                LateStop.landed = True
                raise guard.OutOfTime()
            return super().join(*args, **kwargs)

    monkeypatch.setattr(guard.threading, "Thread", LateStop)
    outcome = guard.run_guarded(lambda: 6 * 7)
    assert LateStop.landed, "the guard ran no watchdog: this test tests nothing"
    assert (outcome.value, outcome.error) == (42, None)


class NeverAdmits(learner_pieces.MyContinuousScheduler):
    def admit(self):
        pass  # nobody ever starts: every step yields nothing


def test_the_engine_stops_a_scheduler_that_yields_nothing_and_says_so():
    verdict = verdict_of("continuous_scheduler", NeverAdmits)
    assert not verdict
    assert "the engine got stuck" in verdict.message and "batches() yields nothing" in verdict.message
    assert "did not finish" not in verdict.message  # the driver's stuck detection, not the time limit


# -- 2. the wrong type from a learner's method ---------------------------------------------------


class YieldsADict(learner_pieces.MyStaticScheduler):
    def batches(self):
        yield {"prefill": list(self.queue)}  # a dict, not a Batch


class ReturnsNothing(learner_pieces.MyStaticScheduler):
    def batches(self):
        return None


class YieldsAPair(learner_pieces.MyContinuousScheduler):
    def prefill(self):
        for req in self.running[:1]:
            yield (req, req.prefill_left)  # a pair, not a Batch


class PrefillWithoutCounts(learner_pieces.MyStaticScheduler):
    def batches(self):
        while self.queue and len(self.running) < self.max_batch_size and self.reserve(self.queue[0]):
            req = self.queue[0]
            self.begin(req)
            self.take_slot(req)
        yield Batch(prefill=list(self.running))  # requests without their token counts


class PollsNone(learner_pieces.MyEngine):
    def poll(self, req_id):
        return None


class ShedsANumber(learner_pieces.MyAdmission):
    def to_shed(self, queue, now):
        return 3


class ShedsIds(learner_pieces.MyAdmission):
    def to_shed(self, queue, now):
        return [r.id for r in queue if self.max_wait_s is not None and now - r.arrival_s > self.max_wait_s]


@pytest.mark.parametrize(
    "checker, piece, said",
    [
        (
            "static_scheduler",
            YieldsADict,
            "YieldsADict.batches (checker_guard_cases.py, line {}) yielded {{'prefill'",
        ),
        ("static_scheduler", ReturnsNothing, "ReturnsNothing.batches returned None (a NoneType), not passes"),
        (
            "continuous_scheduler",
            YieldsAPair,
            "YieldsAPair.prefill (checker_guard_cases.py, line {}) yielded (",
        ),
        ("static_scheduler", PrefillWithoutCounts, "prefill holds <request r0>: each item is a pair"),
        ("engine_front", PollsNone, "poll returns three things"),
        (
            "admission_policy",
            ShedsANumber,
            "ShedsANumber.to_shed returned 3 (an int), not a list of requests",
        ),
        ("admission_policy", ShedsIds, "ShedsIds.to_shed returned a list holding 'a', which is not a queued"),
    ],
)
def test_a_wrong_type_is_named_with_the_method_and_what_it_gave(checker, piece, said):
    if "{}" in said:
        said = said.format(
            line_of("  # a dict, not a Batch" if piece is YieldsADict else "  # a pair, not a Batch")
        )
    verdict = verdict_of(checker, piece)
    assert not verdict and said in verdict.message, verdict.message
    assert "Traceback" not in verdict.message and "object has no attribute" not in verdict.message


def test_to_shed_returning_a_number_says_so():
    verdict = verdict_of("to_shed", lambda queue, now, slo, speed: 3)
    assert not verdict and "return a list of request ids, not an int" in verdict.message


# -- 3. a piece that does not import -------------------------------------------------------------


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    course.setup(tmp_path)
    yield tmp_path / "my_engine"
    for name in [m for m in sys.modules if m == "my_engine" or m.startswith("my_engine.")]:
        del sys.modules[name]


NAME_ERROR = """from batchlab.core.scheduler import Scheduler

LIMIT = undefined_name + 1


class MyStaticScheduler(Scheduler):
    pass
"""
SYNTAX_ERROR = """from batchlab.core.scheduler import Scheduler


class MyStaticScheduler(Scheduler):
    def batches(self)
        yield
"""
LOOPS = """while True:
    pass
"""


@pytest.mark.parametrize(
    "source, said",
    [
        (NAME_ERROR, "NameError: name 'undefined_name' is not defined (my_engine/static.py, line 3)"),
        (SYNTAX_ERROR, "SyntaxError: expected ':' (static.py, line 5) (my_engine/static.py, line 5)"),
        (
            LOOPS,
            "does not finish importing: it did not finish within 0.5 s: still running the file's top level",
        ),
    ],
)
def test_a_piece_that_does_not_import_is_a_failed_verdict_naming_file_and_line(
    folder, small_limit, source, said
):
    (folder / "static.py").write_text(source)
    mine = course.piece("static", "MyStaticScheduler")
    assert said in mine.missing_reason
    verdict = verdict_of("static_scheduler", mine)
    assert not verdict and said in verdict.message
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert course.earlier("static") is StaticScheduler  # the reference stands in, with a line
    assert "my_engine/static.py" in out.getvalue() and said.split(" (my_engine")[0] in out.getvalue()
    assert_passes("static_scheduler", learner_pieces.MyStaticScheduler)


# -- 4. a piece that changes the library ---------------------------------------------------------


class ChangesTheLibrary(learner_pieces.MyStaticScheduler):
    def batches(self):
        KINDS["mine"] = type(self)
        Scheduler.free_slot = lambda self: None
        StaticScheduler.description = "mine now"
        yield from super().batches()


def test_a_piece_that_changes_the_library_fails_and_the_library_is_put_back():
    free_slot, description, kinds = Scheduler.free_slot, StaticScheduler.description, dict(KINDS)
    verdict = verdict_of("static_scheduler", ChangesTheLibrary)
    assert not verdict and "your code changed batchlab itself" in verdict.message
    for what in (
        "KINDS (in batchlab.core.scheduler.registry) was changed",
        "Scheduler.free_slot was replaced",
    ):
        assert what in verdict.message
    assert Scheduler.free_slot is free_slot and StaticScheduler.description == description and KINDS == kinds
    assert_passes("static_scheduler", learner_pieces.MyStaticScheduler)


def test_a_piece_that_changes_the_library_on_import_is_refused(folder):
    (folder / "static.py").write_text(
        "from batchlab.core.scheduler import KINDS, StaticScheduler\n\n"
        "KINDS.clear()\n\n\nclass MyStaticScheduler(StaticScheduler):\n    pass\n"
    )
    kinds = dict(KINDS)
    mine = course.piece("static", "MyStaticScheduler")
    assert "does not import cleanly: your code changed batchlab itself: KINDS" in mine.missing_reason
    assert KINDS == kinds
    assert_passes("static_scheduler", learner_pieces.MyStaticScheduler)


# -- the same in the main thread, where a notebook runs its cells ---------------------------------


def test_in_the_main_thread_an_endless_loop_is_stopped_and_named(small_limit):
    """In the main thread the case runs in place, a watchdog stops it (pytest's timeout: the backstop)."""
    assert threading.current_thread() is threading.main_thread()
    with contextlib.redirect_stdout(io.StringIO()):
        verdict = checks.continuous_scheduler(LoopsInAdmit)
    assert not verdict and "still running LoopsInAdmit.admit" in verdict.message
    assert "an endless loop?" in verdict.message
    assert_passes("continuous_scheduler", learner_pieces.MyContinuousScheduler)


def test_in_the_main_thread_a_blocking_poll_is_woken_and_stopped(small_limit):
    with contextlib.redirect_stdout(io.StringIO()):
        verdict = checks.engine_front(BlocksInPoll)
    assert not verdict and "still running BlocksInPoll.poll" in verdict.message
    assert "waiting for something that never comes" in verdict.message
    assert "could not be stopped" not in verdict.message  # SIGUSR1 woke the wait: nothing left behind
    with contextlib.redirect_stdout(io.StringIO()):
        assert checks.engine_front(learner_pieces.MyEngine)


def test_in_the_main_thread_the_learners_mlx_arrays_work():
    """MLX's arrays belong to the thread that made them: a case run in the kernel's thread can use
    one a cell made at its top level (a lazy one, not yet computed)."""
    import mlx.core as mx

    zero = mx.array(0.0) * 1.0  # lazy, made in this thread

    def greedy_pick(logits):
        return int(mx.argmax(logits + zero).item())

    with contextlib.redirect_stdout(io.StringIO()):
        verdict = checks.greedy_pick(greedy_pick)
    assert verdict, verdict.message
