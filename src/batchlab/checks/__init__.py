"""Checkers for the lessons' exercises. In a lesson, import this package as ``check`` and call
the checker named after the exercise with the learner's function: ``check.greedy_pick(greedy_pick)``.

A checker runs the function on a few small cases, **prints** a verdict and **returns** it as a
:class:`Verdict`: ``✓ greedy_pick: 5/5 cases match``, or the first wrong case (what was expected,
what came back, a hint) and the other failing ones by name, or ``✗ ...: not written yet``. It never
raises because the learner's code is wrong; ``verdict.raise_if_failed()`` does. A new exercise: rows
for ``_core.table`` or a list of :class:`Case` for ``run_cases``; a scheduler piece: ``_pieces``.
The names below are this package's exports (each lesson module lists its own in ``__all__``).
"""

from ._core import FAIL, OK, Case, CheckFailed, Verdict, run_cases, whole_number_compare  # noqa: F401
from .lesson00 import greedy_generate, greedy_pick, tokens_per_second  # noqa: F401
from .lesson01 import static_scheduler, static_steps, wasted_slot_steps  # noqa: F401
from .lesson02 import continuous_scheduler, continuous_steps  # noqa: F401
from .lesson03 import percentile_linear, predict_stall, time_between_tokens  # noqa: F401
from .lesson04 import chunked_scheduler, largest_chunk, predict_long_ttft  # noqa: F401
from .lesson05 import fused_saving, pack_chunks, skipped_decodes, stallfree_planner  # noqa: F401
from .lesson06 import engine_front, stream_text  # noqa: F401
from .lesson07 import goodput, parse_sse, stream_metrics  # noqa: F401
from .lesson08 import cached_prefix, kv_slots, memory_scheduler  # noqa: F401
from .lesson09 import admission_policy, mean_in_system, to_shed  # noqa: F401
