"""The 'Going further' designs the lessons invite, written from the lessons' text alone: each keeps
the contract, so its checker passes it (naming where its rule differs from the lesson's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
import pytest

from batchlab.course import checks as check
from batchlab.core.request import State
from learner_pieces import MyAdmission, MyAgingPolicy, MyChunkedScheduler, MyContinuousScheduler
from learner_pieces import MyMemoryScheduler, MyVictimPolicy


class TwoAdmissionsAStep(MyContinuousScheduler):
    """Lesson 2, going further: admit and prefill up to two requests a step."""

    def admit(self):
        while self.queue and len(self.in_state(State.PREFILLING, State.AWAITING_SLOT)) < 2:
            if self.admit_next(math.inf) is None:
                break

    def prefill(self):
        for req in self.in_state(State.PREFILLING)[:2]:
            yield from (
                super().prefill()
                if False
                else [
                    __import__("batchlab.core.scheduler", fromlist=["Batch"]).Batch(
                        prefill=[(req, self.chunk(req))]
                    )
                ]
            )


class BalancedChunks(MyChunkedScheduler):
    """Lesson 4, another chunk rule: chunks of equal size, none over prefill_step (130 tokens at
    64 a step: 44, 43, 43 instead of 64, 64, 2)."""

    def chunk(self, req):
        if self.prefill_step == math.inf:
            return req.prefill_left
        pieces = math.ceil(req.prefill_len / self.prefill_step)
        return min(math.ceil(req.prefill_len / pieces), req.prefill_left)


class WatermarkAdmission(MyMemoryScheduler):
    """Lesson 8, vLLM's watermark: admit only if a block stays free after the first chunk."""

    def fits(self, req, max_tokens):
        if not super().fits(req, max_tokens):
            return False
        hits, cached, n = self.first_chunk(req, max_tokens)
        return self.blocks.blocks_for(cached + n) - len(hits) + 1 <= self.blocks.num_free


@dataclass(frozen=True)
class LookAheadShedding(MyAdmission):
    """Lesson 9, exercise 3 in the engine: shed a queued request whose wait plus its predicted
    prefill (at 500 tokens/s) is over max_wait_s."""

    def to_shed(self, queue, now):
        if self.max_wait_s is None:
            return []
        return [
            r
            for r in queue
            if r.state is State.QUEUED
            and not r.output_ids
            and now - r.arrival_s + r.prompt_len / 500 > self.max_wait_s
        ]


class CappedAging(MyAgingPolicy):
    """Lesson 10, another aging: a request climbs at most two priority levels by waiting."""

    def importance(self, req):
        return req.arrival_s + self.age_s * min(req.priority, 2), req.priority


@pytest.mark.parametrize(
    "checker, pieces, differs",
    [
        ("continuous_scheduler", (TwoAdmissionsAStep,), "the lesson's rule"),
        ("chunked_scheduler", (BalancedChunks,), "the lesson's rule takes min(prefill_step, tokens left)"),
        ("memory_scheduler", (WatermarkAdmission, MyVictimPolicy), None),
        ("admission_policy", (LookAheadShedding,), "the lesson's rule sheds only those that waited MORE"),
        ("aging_policy", (CappedAging,), None),
    ],
    ids=["two-admissions", "balanced-chunks", "watermark", "look-ahead-shedding", "capped-aging"],
)
def test_a_going_further_design_passes_its_checker(checker, pieces, differs):
    """It keeps the contract, so it stays the learner's in later lessons; where the lesson's own
    cases tell it apart from the lesson's rule, the verdict's second line says where."""
    verdict = getattr(check, checker)(*pieces)
    assert verdict, verdict.message
    if differs:
        assert verdict.differs and differs in verdict.message, verdict.message


def test_a_different_design_stays_the_learners_in_later_lessons(tmp_path, capsys):
    """``course.mine_or_reference`` keeps a written piece whose verdict passes with differences:
    a later lesson runs the learner's balanced chunks, not the reference's."""
    from pathlib import Path

    from batchlab import course
    from batchlab.course import pieces

    pieces.setup(tmp_path)
    tests = str(Path(__file__).parent)
    (tmp_path / "my_engine" / "chunked.py").write_text(
        f"import sys\nsys.path.insert(0, {tests!r})\nimport test_going_further\n\n\n"
        "class MyChunkedScheduler(test_going_further.BalancedChunks):\n    pass\n"
    )
    cls = course.mine_or_reference("chunked", check.chunked_scheduler)
    assert issubclass(cls, BalancedChunks) or cls.__mro__[1].__name__ == "BalancedChunks", (
        capsys.readouterr().out
    )
    assert "stands in" not in capsys.readouterr().out
