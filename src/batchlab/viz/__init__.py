"""Pictures of engine runs, drawn from traces alone.

Everything here reads a ``Trace`` -- live from a running engine, loaded from JSON, or
made by hand -- and nothing else, so any run can be replayed and every picture can be
checked in a test without the model or a browser. By what it draws:

- ``grid``: the slot grid as data (``step_cells``, ``slot_grid``, ``occupancy_so_far``,
  ``busiest_window``), the model every picture shares (a verify row's cell carries its
  drafts and how many were accepted: ``Cell.mark``, ``Cell.bands``); ``colors``: one colour per request;
- ``widget``: ``SlotView``, an ipywidgets animation of the grid, replayed or live;
- ``animation``: the same grid as an animated PNG that plays without a kernel;
- ``plots``: matplotlib figures (grid, timelines, time between tokens, latency CDFs,
  occupancy, tokens, several traces side by side);
- ``blocks``: paged KV blocks (``block_states``, ``BlockView``, ``plot_block_map``).
"""

from .animation import animation
from .blocks import (
    CACHED,
    FREE,
    OWNED,
    SHARED,
    BlockView,
    block_count,
    block_frame_html,
    block_owners,
    block_states,
    plot_block_map,
)
from .colors import STATE_COLORS, Palette, palette_color, request_color, short_label, text_color
from .grid import (
    CELL_KINDS,
    DECODE,
    HELD,
    IDLE,
    PADDING,
    PREFILL,
    PREFILL_DECODE,
    Cell,
    Occupancy,
    busiest_window,
    gap_band,
    has_drafts,
    lane_names,
    occupancy_so_far,
    prefill_lane_count,
    request_colors,
    request_ids,
    slot_grid,
    state_at,
    state_intervals,
    step_cells,
    steps_window,
    time_origin,
    token_gaps,
    trace_of,
    ttfts,
)
from .plots import (
    plot_latency_cdfs,
    plot_occupancy,
    plot_side_by_side,
    plot_slot_grid,
    plot_tbt,
    plot_timeline,
    plot_tokens,
)
from .widget import SlotView, frame_html, player_html

__all__ = [
    "CACHED",
    "CELL_KINDS",
    "DECODE",
    "FREE",
    "HELD",
    "IDLE",
    "OWNED",
    "PADDING",
    "PREFILL",
    "PREFILL_DECODE",
    "SHARED",
    "STATE_COLORS",
    "BlockView",
    "Cell",
    "Occupancy",
    "Palette",
    "SlotView",
    "animation",
    "block_count",
    "block_frame_html",
    "block_owners",
    "block_states",
    "busiest_window",
    "frame_html",
    "player_html",
    "gap_band",
    "has_drafts",
    "lane_names",
    "occupancy_so_far",
    "palette_color",
    "plot_block_map",
    "plot_latency_cdfs",
    "plot_occupancy",
    "plot_side_by_side",
    "plot_slot_grid",
    "plot_tbt",
    "plot_timeline",
    "plot_tokens",
    "prefill_lane_count",
    "request_color",
    "request_colors",
    "request_ids",
    "short_label",
    "slot_grid",
    "state_at",
    "state_intervals",
    "step_cells",
    "steps_window",
    "text_color",
    "time_origin",
    "token_gaps",
    "trace_of",
    "ttfts",
]
