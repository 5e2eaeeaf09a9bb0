"""The one checker harness (``checks._pieces``): a run that cannot end is stopped with words,
never a hang; a memory case whose scenario the reference does not show is refused; the
trace invariants accept the library's runs, preemptions included."""

from __future__ import annotations

import pytest

from batchlab.course.checks import _pieces
from batchlab.core.scheduler import Batch, ContinuousScheduler, StallFreeScheduler, StaticScheduler


class EmptyPassesForever(ContinuousScheduler):
    """Yields a pass with nothing in it, every step, for ever (the base drops empty passes)."""

    def batches(self):
        yield Batch()


class NeverFinishes(ContinuousScheduler):
    """Finishing rules that never end a request: it decodes for ever."""

    def finish_reason(self, req, token):
        return None


class YieldsAFailedRequestForever(ContinuousScheduler):
    """Keeps yielding its first request's chunk, also once that request has failed and left."""

    def batches(self):
        self.admit()
        for req in list(self.running)[:1]:
            while True:
                yield Batch(prefill=[(req, 1)])


def test_a_planner_that_yields_only_departed_requests_is_stopped():
    """Its passes empty out (the request left after a failed pass): the base stops the step
    after MAX_EMPTY_PASSES of them, in the checker and in a plain engine alike."""
    from batchlab import make_engine
    from batchlab.core.fake import FakeModel, FakeRunner

    run = _pieces.run_piece(
        YieldsAFailedRequestForever, _pieces.fake_workload("w", [(5, 3)]), max_batch_size=2
    )
    assert run.problem and "passes in a row with nothing left to run" in run.problem, run.problem
    engine = make_engine(YieldsAFailedRequestForever, FakeModel(), runner=FakeRunner, max_batch_size=2)
    engine.submit([1, 2, 3, 4, 5], max_new_tokens=3)
    with pytest.raises(RuntimeError, match="nothing left to run"):
        for _ in range(50):
            engine.step()


def test_a_scheduler_that_never_stops_is_stopped_with_words():
    run = _pieces.run_piece(EmptyPassesForever, _pieces.fake_workload("w", [(5, 3)]), max_batch_size=2)
    assert run.problem and "the engine got stuck" in run.problem and "batches() yields nothing" in run.problem
    run = _pieces.run_piece(
        NeverFinishes, _pieces.fake_workload("w", [(5, 3)]), max_batch_size=2, num_kv_blocks=400
    )
    assert run.problem and "the scheduler never stops" in run.problem


def test_a_run_on_another_test_model_is_bounded_too():
    """Lesson 11's runs use the echoing test models of ``core.fake``: they stop a scheduler that
    never stops as the fake's own runner does."""
    from batchlab.core.fake import EchoRunner

    run = _pieces.run_piece(
        NeverFinishes,
        _pieces.fake_workload("w", [(5, 3)]),
        runner=EchoRunner,
        max_batch_size=2,
        num_kv_blocks=400,
    )
    assert run.problem and "the scheduler never stops" in run.problem
    assert _pieces.bounded(EchoRunner).choose is EchoRunner.choose


def test_a_memory_case_whose_reference_does_not_preempt_is_refused():
    roomy = _pieces.fake_workload("w", [(5, 3), (6, 2)])
    judge = _pieces.piece_judge(
        ContinuousScheduler, ContinuousScheduler, roomy, [], max_batch_size=2, num_kv_blocks=64
    )
    with pytest.raises(AssertionError, match="did not show the scenario"):
        _pieces.memory_case("memory: roomy", judge, True)


@pytest.mark.parametrize(
    "cls, options",
    [
        (StaticScheduler, {"max_batch_size": 4}),
        (ContinuousScheduler, {"max_batch_size": 4, "prefill_step": 16}),
        (StallFreeScheduler, {"max_batch_size": 4, "token_budget": 24}),
    ],
)
def test_the_invariants_accept_the_librarys_runs_under_preemption(cls, options):
    workload = _pieces.fake_workload("w", _pieces.random_rows(5, 10, (20, 120), (20, 50)), 5)
    run = _pieces.run_piece(cls, workload, num_kv_blocks=16, **options)
    assert run.problem is None and run.blocks_held == 0
    assert run.preemptions or cls is StaticScheduler  # static reserves: it never preempts
    trace = run.trace
    for problem in (
        _pieces.output_problem(trace, workload),
        _pieces.slot_problem(trace, 4, rectangular=cls.rectangular),
        _pieces.early_decode_problem(trace, workload),
        _pieces.gap_problem(trace, workload),
        _pieces.state_problem(trace, ""),
    ):
        assert problem is None, problem
