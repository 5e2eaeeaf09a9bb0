"""The lineage rule of the learner's pieces: each derives from a base that decides nothing
(``Scheduler``, ``EngineBase``) or from the learner's own earlier piece, never from one of
our reference implementations, so no piece can pass by handing its work to ours."""

from __future__ import annotations

from functools import partial

from ...core.scheduler import (
    ContinuousScheduler,
    SequentialScheduler,
    StallFreeScheduler,
    StaticScheduler,
    StopRules,
)
from ._core import Case
from ._pieces import piece_case

# every shipped scheduler kind and its finishing rules: what no learner scheduler may extend
KINDS_OF_OURS = (StaticScheduler, ContinuousScheduler, StallFreeScheduler, SequentialScheduler, StopRules)


def ancestry_problem(base: type, references: tuple[type, ...], cls) -> str | None:
    """None if ``cls`` is a subclass of ``base`` with none of ``references`` among its
    ancestors; else what is wrong, in a sentence."""
    if not isinstance(cls, type):
        return f"pass your class itself (a subclass of {base.__name__}), not {cls!r}"
    if not issubclass(cls, base):
        return f"{cls.__name__} must derive from {base.__name__}"
    ours = [k for k in cls.__mro__ if k in references]
    if ours and ours[0] is cls:
        return f"this is our {cls.__name__}: pass your own class"
    if ours:
        return (
            f"{cls.__name__} derives from our {ours[0].__name__}, so it could pass by calling ours: "
            f"derive from {base.__name__} (or your own earlier piece) and write the methods yourself. "
            f"(If it builds on course.earlier(...), an earlier lesson's piece is not written yet and ours "
            f"stood in for it: write that piece first.)"
        )
    return None


def lineage_case(base: type, references: tuple[type, ...]) -> Case:
    """The first case of a piece's checker: the class derives from ``base``, not from ours."""
    label = f"derives from {base.__name__} (not from our {', '.join(r.__name__ for r in references)})"
    return piece_case(label, partial(ancestry_problem, base, references))
