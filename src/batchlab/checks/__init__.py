"""Checkers for the lessons' exercises. In a lesson, import this package as ``check`` and call
the checker named after the exercise with the learner's function::

    from batchlab import checks as check
    check.greedy_pick(greedy_pick)

A checker runs the function on a few small cases (fake inputs where that keeps it instant, the
real model where it matters), **prints** a verdict and **returns** it as a :class:`Verdict`:
``✓ greedy_pick: 5/5 cases match`` when all are right; else the first wrong case (numbered, in
words), what was expected, what came back and a hint, then the other failing cases by name;
``✗ greedy_pick: not written yet`` while it raises ``NotImplementedError``. Checkers never raise
because the learner's code is wrong (a traceback would bury the explanation): code that needs a
hard failure tests the Verdict or calls ``verdict.raise_if_failed()``. The committed lessons'
checker cells carry ``# NBVAL_CHECK_OUTPUT``, so a wrong reference solution fails the notebook tests.

A new exercise: rows for ``_core.table`` (``lesson00.tokens_per_second`` is a small example), or
a list of :class:`Case` for ``run_cases``; a scheduler piece runs through ``_pieces.run_piece``.
"""

from ._core import FAIL, OK, Case, CheckFailed, Verdict, run_cases, whole_number_compare
from .lesson00 import greedy_generate, greedy_pick, tokens_per_second
from .lesson01 import static_scheduler, static_steps, wasted_slot_steps
from .lesson02 import continuous_scheduler, continuous_steps
from .lesson03 import percentile_linear, predict_stall, time_between_tokens
from .lesson04 import chunked_scheduler, largest_chunk, predict_long_ttft
from .lesson05 import fused_saving, pack_chunks, skipped_decodes, stallfree_planner
from .lesson06 import engine_front, stream_text
from .lesson07 import goodput, parse_sse, stream_metrics
from .lesson08 import cached_prefix, kv_slots, memory_scheduler
from .lesson09 import admission_policy, mean_in_system, to_shed

__all__ = [
    "OK",
    "FAIL",
    "Case",
    "CheckFailed",
    "Verdict",
    "run_cases",
    "whole_number_compare",
    "greedy_pick",
    "greedy_generate",
    "tokens_per_second",
    "static_scheduler",
    "wasted_slot_steps",
    "static_steps",
    "continuous_scheduler",
    "continuous_steps",
    "time_between_tokens",
    "percentile_linear",
    "predict_stall",
    "chunked_scheduler",
    "predict_long_ttft",
    "largest_chunk",
    "stallfree_planner",
    "pack_chunks",
    "skipped_decodes",
    "fused_saving",
    "engine_front",
    "stream_text",
    "stream_metrics",
    "parse_sse",
    "goodput",
    "kv_slots",
    "cached_prefix",
    "memory_scheduler",
    "mean_in_system",
    "to_shed",
    "admission_policy",
]
