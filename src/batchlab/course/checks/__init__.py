"""Checkers for the lessons' exercises: ``check.greedy_pick(greedy_pick)`` prints a :class:`Verdict` and
returns it (``verdict.raise_if_failed()`` raises). New ones: ``_core.table``, ``run_cases``, ``_pieces``."""

from ._core import FAIL, OK, Case, CheckFailed, Verdict, run_cases, whole_number_compare  # noqa: F401
from .lesson00 import decode_intensity, greedy_generate, greedy_pick, tokens_per_second  # noqa: F401
from .lesson01 import static_scheduler, static_steps, wasted_slot_steps  # noqa: F401
from .lesson02 import continuous_scheduler, continuous_steps  # noqa: F401
from .lesson03 import percentile_linear, predict_stall, time_between_tokens  # noqa: F401
from .lesson04 import chunked_scheduler, largest_chunk, predict_long_ttft  # noqa: F401
from .lesson05 import fused_saving, pack_chunks, skipped_decodes, stallfree_planner  # noqa: F401
from .lesson06 import engine_front, stream_text  # noqa: F401
from .lesson07 import goodput, parse_sse, server_events, stream_metrics  # noqa: F401
from .lesson08 import cached_prefix, kv_slots, memory_scheduler  # noqa: F401
from .lesson09 import admission_policy, mean_in_system, to_shed  # noqa: F401
from .lesson10 import aging_policy, overtaken_after  # noqa: F401
from .lesson11 import expected_tokens, speculative_scheduler  # noqa: F401
from .lesson12 import mask_share, structured_engine  # noqa: F401
