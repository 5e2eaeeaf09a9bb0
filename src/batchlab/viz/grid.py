"""The slot grid as data: what each lane (a decode slot, or a prefill lane) did at each step.

Every picture -- the widget, the still grid, the animation -- draws these cells, so they
all agree, and tests can check the grid without drawing it.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from ..core.trace import RequestRecord, StepRecord, Trace
from .colors import Palette

# What one lane did in one step.
DECODE = "decode"  # one decode row: the request produced a token
PREFILL = "prefill"  # a chunk of the request's prompt ran
PREFILL_DECODE = "prefill_decode"  # its whole prompt, then its first decode row (static)
PADDING = "padding"  # static: a finished row still computed, its result thrown away
HELD = "held"  # the request holds the slot but ran nothing this step (stall-free, out of budget)
IDLE = "idle"  # an empty slot
CELL_KINDS = (DECODE, PREFILL, PREFILL_DECODE, PADDING, HELD, IDLE)


@dataclass(frozen=True)
class Cell:
    """What one lane did in one step."""

    kind: str  # one of CELL_KINDS
    request: str | None = None
    prefill_tokens: int = 0  # prompt tokens the request ran in this step
    # speculative decoding: a decode row that carried drafts (a verify row) says how many
    # it carried and how many of them the model accepted (both 0 for a plain decode row)
    drafts: int = 0
    accepted: int = 0

    @property
    def verify(self) -> bool:
        """A decode row that carried draft tokens."""
        return self.drafts > 0

    @property
    def mark(self) -> str:
        """What a verify row says in words: "+2/3" (2 of its 3 drafts accepted); "" otherwise."""
        return f"+{self.accepted}/{self.drafts}" if self.drafts else ""

    @property
    def bands(self) -> tuple[bool, ...]:
        """A verify row as the pictures draw it, one band a token position it ran, bottom up:
        its own token, then its drafts; True where the position became an output token (its
        own and the accepted drafts, in the request's colour), False for a rejected draft
        (grey). Empty for any other cell."""
        if not self.drafts:
            return ()
        return (True,) * (1 + self.accepted) + (False,) * (self.drafts - self.accepted)


# the legend's example of a verify row, for every picture that explains them
VERIFY_SAMPLE = Cell(DECODE, "r", drafts=3, accepted=2)
VERIFY_LEGEND = (
    f"verify row {VERIFY_SAMPLE.mark}: its token and 2 of its 3 drafts accepted, "
    "a band each, bottom up; grey: rejected drafts"
)


@dataclass(frozen=True)
class Occupancy:
    """Decode rows run so far against the slot-steps available so far."""

    decode_rows: int
    slot_steps: int

    @property
    def fraction(self) -> float:
        return self.decode_rows / self.slot_steps if self.slot_steps else 0.0


def _step_request_ids(step: StepRecord) -> list[str]:
    ids = [r for r in step.slots if r is not None] + step.decoded + step.padding
    return ids + [rid for rid, _, _ in step.prefill]


def request_ids(trace: Trace) -> list[str]:
    """Every request of the trace in arrival order, then any request named only in its
    steps (as in a hand-made trace)."""
    ids = dict.fromkeys(dict(trace.requests))
    for step in list(trace.steps):
        ids.update(dict.fromkeys(_step_request_ids(step)))
    return list(ids)


def request_colors(trace: Trace, palette: Palette | None = None) -> dict[str, str]:
    """The colour of every request in the trace, distinct within it: palette colours in
    arrival order (from ``palette`` if given, which remembers colours across calls)."""
    palette = palette or Palette()
    return {rid: palette.color(rid) for rid in request_ids(trace)}


def _prefill_lanes(trace: Trace, steps: list[StepRecord]) -> int:
    return max([1] + [len(s.prefill) for s in steps]) if trace.prefill_lane else 0


def prefill_lane_count(trace: Trace) -> int:
    """Lanes for prefill chunks that run outside any slot (none where prefilling requests
    hold a slot; the trace's ``prefill_lane`` says which)."""
    return _prefill_lanes(trace, list(trace.steps))


def _lane_names(size: int, prefill_lanes: int) -> list[str]:
    extra = ["prefill"] if prefill_lanes == 1 else [f"prefill {j}" for j in range(prefill_lanes)]
    return [f"slot {i}" for i in range(size)] + extra


def lane_names(trace: Trace) -> list[str]:
    """Row names of the grid: the slots, then the prefill lane(s) if the engine has them."""
    return _lane_names(trace.max_batch_size, prefill_lane_count(trace))


def _step_cells(steps: list[StepRecord], size: int, k: int, prefill_lanes: int) -> list[Cell]:
    step = steps[k]
    after = list(step.slots) + [None] * (size - len(step.slots))
    # every request that ran in a slot this step (even one that also left it) is in slot_of
    lane = {rid: i for i, rid in enumerate(after) if rid is not None}
    lane.update(step.slot_of)
    prefill_tokens: dict[str, int] = {}
    for rid, _, n in step.prefill:
        prefill_tokens[rid] = prefill_tokens.get(rid, 0) + n
    slot_prefill = prefill_lanes == 0

    cells = [Cell(HELD, rid) if rid is not None else Cell(IDLE) for rid in after]
    for rid in step.padding:
        if rid in lane:
            cells[lane[rid]] = Cell(PADDING, rid)
    for rid in step.decoded:
        n = prefill_tokens.get(rid, 0) if slot_prefill else 0
        if rid in lane:
            drafts, accepted = step.drafts.get(rid, 0), step.accepted.get(rid, 0)
            cells[lane[rid]] = Cell(PREFILL_DECODE if n else DECODE, rid, n, drafts, accepted)
    if slot_prefill:
        for rid, n in prefill_tokens.items():
            if rid in lane and rid not in step.decoded:
                cells[lane[rid]] = Cell(PREFILL, rid, n)
        return cells
    chunks = [Cell(PREFILL, rid, n) for rid, n in prefill_tokens.items()]
    return cells + chunks + [Cell(IDLE)] * (prefill_lanes - len(chunks))


def step_cells(trace: Trace, k: int) -> list[Cell]:
    """The cells of step ``k`` (a position in ``trace.steps``), one per lane of ``lane_names``."""
    steps = list(trace.steps)
    return _step_cells(steps, trace.max_batch_size, k, _prefill_lanes(trace, steps))


def slot_grid(trace: Trace, upto: int | None = None) -> list[list[Cell]]:
    """Every step's cells up to and including step ``upto`` (default: all): grid[step][lane]."""
    steps = list(trace.steps)
    last = len(steps) - 1 if upto is None else upto
    prefill_lanes = _prefill_lanes(trace, steps)
    return [_step_cells(steps, trace.max_batch_size, k, prefill_lanes) for k in range(last + 1)]


def has_drafts(trace: Trace) -> bool:
    """Did any step run a verify row? (Only then do the pictures explain verify rows.)"""
    return any(s.drafts for s in list(trace.steps))


def runs(cells: list[Cell]):
    """(first position, length, cell) for each run of equal cells in one lane; a static
    prompt-plus-decode cell is a run of its own."""
    start = 0
    for k in range(1, len(cells) + 1):
        if (
            k == len(cells)
            or (cells[k].kind, cells[k].request) != (cells[start].kind, cells[start].request)
            or cells[k].kind == PREFILL_DECODE
        ):
            yield start, k - start, cells[start]
            start = k


def occupancy_so_far(trace: Trace, k: int) -> Occupancy:
    """Decode rows ÷ (slots × steps) over steps 0..k: the share of slot-steps that made a
    token. Steps that only prefill count as idle slot-steps. (A bounded trace counts the
    steps it still holds.)"""
    rows = sum(len(s.decoded) for s in list(trace.steps)[: k + 1])
    return Occupancy(rows, trace.max_batch_size * (k + 1))


# -- a readable window of a long run -------------------------------------------------------------
def steps_window(trace: Trace, first: int, width: int) -> Trace:
    """The same trace with only ``width`` steps from position ``first`` (every request kept)."""
    steps = list(trace.steps)
    if not 0 <= first < len(steps) or width < 1:
        raise ValueError(
            f"a window of {width} steps from step position {first} does not fit a trace of {len(steps)} steps"
        )
    return dataclasses.replace(trace, steps=steps[first : first + width])


def busiest_window(trace: Trace, width: int = 120) -> Trace:
    """The ``width`` steps in which the most requests waited (the largest sum of queue
    depths; the earliest such window on a tie): a run of thousands of steps, cut to where
    its queue is longest and still readable as one grid."""
    queued = np.array([s.queued for s in list(trace.steps)])
    if len(queued) <= width:
        return steps_window(trace, 0, width) if len(queued) else trace
    totals = np.convolve(queued, np.ones(width, dtype=int), mode="valid")
    return steps_window(trace, int(np.argmax(totals)), width)


# -- requests over time ------------------------------------------------------------------------
def state_at(record: RequestRecord, t: float) -> str | None:
    """The state a request was in at time ``t`` (None before it arrived)."""
    state = None
    for when, entered in list(record.state_times):
        if when > t:
            break
        state = entered
    return state


def state_intervals(record: RequestRecord, until: float) -> list[tuple[str, float, float]]:
    """(state, start, end) for each state the request passed through; a state it is still in
    lasts until ``until``."""
    times = list(record.state_times)
    ends = [when for when, _ in times[1:]] + [until]
    return [(state, start, end) for (start, state), end in zip(times, ends) if state != "finished"]


def token_gaps(record: RequestRecord) -> list[tuple[float, float]]:
    """(time of a token, seconds since the request's previous token) for tokens 2, 3, ..."""
    times = list(record.token_times_s)
    return [(later, later - earlier) for earlier, later in itertools.pairwise(times)]


def ttfts(trace: Trace) -> list[float]:
    """Time to first token of every request that has one, in seconds."""
    return [
        r.first_token_s - r.arrival_s for r in dict(trace.requests).values() if r.first_token_s is not None
    ]


def time_origin(trace: Trace) -> float:
    """The moment the run started: its first arrival (or first step, if earlier)."""
    starts = [r.arrival_s for r in dict(trace.requests).values()]
    starts += [step.start_s for step in list(trace.steps)[:1]]
    return min(starts, default=0.0)


def trace_of(source) -> Trace:
    """The trace of a Trace, an Engine (``.trace``) or an EngineLoop (``.engine.trace``)."""
    if isinstance(source, Trace):
        return source
    if isinstance(getattr(source, "trace", None), Trace):
        return source.trace
    if isinstance(getattr(getattr(source, "engine", None), "trace", None), Trace):
        return source.engine.trace
    raise TypeError(f"expected a Trace, an Engine or an EngineLoop, got {type(source).__name__}")


def gap_band(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The spread of several requests' time between tokens over time: at each token time
    ``x`` of any of them, the smallest and largest gap among those between two tokens at
    ``x`` (a gap lasts from the token before it, exclusive, to its token, inclusive; NaN
    where none is). Returns (times, lowest gaps, highest gaps), gaps in seconds."""
    spans = [np.asarray(list(r.token_times_s)) for r in records if len(r.token_times_s) >= 2]
    xs = np.unique(np.concatenate(spans)) if spans else np.array([])
    gaps = np.full((len(spans), len(xs)), np.nan)
    for row, times in enumerate(spans):
        inside = (xs > times[0]) & (xs <= times[-1])
        after = np.searchsorted(times, xs[inside], side="left")  # the token that ends the gap
        gaps[row, inside] = times[after] - times[after - 1]
    if not spans:
        return xs, xs.copy(), xs.copy()
    seen = ~np.all(np.isnan(gaps), axis=0)
    lo, hi = np.full(len(xs), np.nan), np.full(len(xs), np.nan)
    lo[seen], hi[seen] = np.nanmin(gaps[:, seen], axis=0), np.nanmax(gaps[:, seen], axis=0)
    return xs, lo, hi
