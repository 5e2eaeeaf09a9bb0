"""Pictures of engine runs, drawn from traces alone.

Everything here reads a ``Trace`` -- live from a running engine, loaded from JSON, or
made by hand -- and nothing else, so any run can be replayed and every picture can be
checked in a test without the model or a browser. Three layers:

- the slot grid as data (``step_cells``, ``slot_grid``, ``occupancy_so_far``): what each
  lane (a decode slot, or the prefill lane of the continuous engine) did at each step;
- ``SlotView``: an ipywidgets animation of that grid, replayed or following a live run;
- matplotlib figures: the grid, request timelines, time between tokens, latency CDFs,
  occupancy and output tokens over time, and several traces side by side.

Times on every axis are seconds since the run's first request arrived (``time_origin``),
so runs made at different moments line up.
"""

from __future__ import annotations

import base64
import colorsys
import html
import io
import itertools
import re
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .trace import RequestRecord, StepRecord, Trace

__all__ = ["CELL_KINDS", "Cell", "Occupancy", "SlotView", "frame_html", "lane_names",
           "occupancy_so_far", "plot_latency_cdfs", "plot_occupancy", "plot_side_by_side",
           "plot_slot_grid", "plot_tbt", "plot_timeline", "plot_tokens", "prefill_lane_count",
           "request_color", "request_colors", "short_label", "slot_grid", "state_at", "state_intervals",
           "step_cells", "time_origin", "token_gaps", "trace_of", "ttfts"]

# What one lane did in one step.
DECODE = "decode"  # one decode row: the request produced a token
PREFILL = "prefill"  # a chunk of the request's prompt ran
PREFILL_DECODE = "prefill_decode"  # its whole prompt, then its first decode row (static)
PADDING = "padding"  # static: a finished row still computed, its result thrown away
HELD = "held"  # the request holds the slot but ran nothing this step (stall-free, out of budget)
IDLE = "idle"  # an empty slot
CELL_KINDS = (DECODE, PREFILL, PREFILL_DECODE, PADDING, HELD, IDLE)

# Engines whose prefilling requests hold no decode slot: their chunks get a lane of their own.
SLOTLESS_PREFILL_KINDS = frozenset({"continuous"})

STATE_COLORS = {"queued": "#c9c9c9", "prefilling": "#f28e2b", "awaiting_slot": "#edc948",
                "decoding": "#4e79a7"}
PADDING_COLOR, PADDING_EDGE = "#d0d0d0", "#8f8f8f"


# -- colours and labels ----------------------------------------------------------------------
def _palette(i: int) -> str:
    """The i-th colour: hues a golden angle apart, so neighbours in arrival order differ."""
    r, g, b = colorsys.hls_to_rgb((0.6 + i * 0.618033988749895) % 1.0, 0.5, 0.62)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def _text_color(hex_color: str) -> str:
    """Black or white, whichever reads better on ``hex_color``."""
    r, g, b = (int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "#111" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "#fff"


def _lighten(hex_color: str, amount: float = 0.6) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in (r, g, b))


def _request_ids(step: StepRecord) -> list[str]:
    ids = [r for r in step.slots if r is not None] + step.decoded + step.padding
    return ids + [rid for rid, _, _ in step.prefill]


def request_color(request_id: str) -> str:
    """A request's colour, from its id alone: the same in every frame, figure and trace
    (req-3 of a static run matches req-3 of a continuous run), however many requests a
    live or bounded trace adds or forgets. The engine's ids "req-N" take the N-th colour."""
    number = re.fullmatch(r"req-(\d+)", request_id)
    return _palette(int(number.group(1)) if number else zlib.crc32(request_id.encode()))


def request_colors(trace: Trace) -> dict[str, str]:
    """The colour of every request in the trace, in arrival order (then any request named
    only in its steps, as in a hand-made trace)."""
    ids = dict.fromkeys(dict(trace.requests))
    for step in list(trace.steps):
        ids.update(dict.fromkeys(_request_ids(step)))
    return {rid: request_color(rid) for rid in ids}


def short_label(request_id: str) -> str:
    """A label that fits in a cell: the number that ends ids like "req-12", else 3 characters."""
    number = re.search(r"\d+$", request_id)
    return number.group() if number else request_id[:3]


# -- the grid as data -------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """What one lane did in one step."""

    kind: str  # one of CELL_KINDS
    request: str | None = None
    prefill_tokens: int = 0  # prompt tokens the request ran in this step


@dataclass(frozen=True)
class Occupancy:
    """Decode rows run so far against the slot-steps available so far."""

    decode_rows: int
    slot_steps: int

    @property
    def fraction(self) -> float:
        return self.decode_rows / self.slot_steps if self.slot_steps else 0.0


def _prefill_lanes(kind: str, steps: list[StepRecord]) -> int:
    return max([1] + [len(s.prefill) for s in steps]) if kind in SLOTLESS_PREFILL_KINDS else 0


def prefill_lane_count(trace: Trace) -> int:
    """Lanes for prefill chunks that run outside any slot (none for engines where they hold one)."""
    return _prefill_lanes(trace.kind, list(trace.steps))


def _lane_names(size: int, prefill_lanes: int) -> list[str]:
    extra = ["prefill"] if prefill_lanes == 1 else [f"prefill {j}" for j in range(prefill_lanes)]
    return [f"slot {i}" for i in range(size)] + extra


def lane_names(trace: Trace) -> list[str]:
    """Row names of the grid: the slots, then the prefill lane(s) if the engine has them."""
    return _lane_names(trace.max_batch_size, prefill_lane_count(trace))


def _slot_table(slots: list[str | None], size: int) -> list[str | None]:
    return list(slots) + [None] * (size - len(slots))


def _step_cells(steps: list[StepRecord], size: int, k: int, prefill_lanes: int) -> list[Cell]:
    step = steps[k]
    after = _slot_table(step.slots, size)
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
            cells[lane[rid]] = Cell(PREFILL_DECODE if n else DECODE, rid, n)
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
    return _step_cells(steps, trace.max_batch_size, k, _prefill_lanes(trace.kind, steps))


def slot_grid(trace: Trace, upto: int | None = None) -> list[list[Cell]]:
    """Every step's cells up to and including step ``upto`` (default: all): grid[step][lane]."""
    steps = list(trace.steps)
    last = len(steps) - 1 if upto is None else upto
    prefill_lanes = _prefill_lanes(trace.kind, steps)
    return [_step_cells(steps, trace.max_batch_size, k, prefill_lanes) for k in range(last + 1)]


def occupancy_so_far(trace: Trace, k: int) -> Occupancy:
    """Decode rows ÷ (slots × steps) over steps 0..k: the share of slot-steps that made a
    token. Steps that only prefill count as idle slot-steps. (A bounded trace counts the
    steps it still holds.)"""
    rows = sum(len(s.decoded) for s in list(trace.steps)[:k + 1])
    return Occupancy(rows, trace.max_batch_size * (k + 1))


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
    return [r.first_token_s - r.arrival_s for r in dict(trace.requests).values()
            if r.first_token_s is not None]


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


# -- one frame as HTML ------------------------------------------------------------------------
_HATCH = "repeating-linear-gradient(135deg,var(--c) 0 3px,#fff 3px 6px)"
_CSS = """
.bl-root{font:12px/1.4 system-ui,-apple-system,sans-serif;color:#222;max-width:100%}
.bl-root .bl-grid{display:grid;gap:2px;align-items:center;margin:6px 0;overflow-x:auto;
  padding-bottom:2px}
.bl-root .bl-lane{padding-right:6px;text-align:right;white-space:nowrap;color:#555}
.bl-root .bl-lane[data-prefill-lane]{font-style:italic}
.bl-root .bl-col{font-size:10px;color:#999;text-align:left;white-space:nowrap;height:14px}
.bl-root .bl-col.bl-current{color:#000;font-weight:700}
.bl-root .bl-cell{height:20px;border-radius:3px;font-size:10px;line-height:20px;
  text-align:center;overflow:hidden;box-sizing:border-box;white-space:nowrap}
.bl-root .bl-decode{background:var(--c);color:var(--t)}
.bl-root .bl-prefill{background:HATCH}
.bl-root .bl-prefill_decode{background:linear-gradient(var(--c),var(--c)) bottom/100% 45% no-repeat,HATCH}
.bl-root .bl-prefill span,.bl-root .bl-prefill_decode span{color:#111;background:#fffd;
  border-radius:2px;padding:0 1px;line-height:12px}
.bl-root .bl-padding{background:repeating-linear-gradient(45deg,#8f8f8f 0 2px,#d0d0d0 2px 5px)}
.bl-root .bl-held{background:#fff;border:2px solid var(--c)}
.bl-root .bl-idle{background:#fff;border:1px solid #ddd}
.bl-root .bl-future{background:#fafafa;border:1px dashed #ececec}
.bl-root .bl-current-cell{outline:2px solid #222}
.bl-root .bl-legend .bl-swatch{display:inline-block;width:14px;height:14px;
  vertical-align:middle;margin:0 3px 0 10px;border-radius:3px;box-sizing:border-box;--c:#4e79a7}
.bl-root .bl-readout b{font-variant-numeric:tabular-nums}
""".replace("HATCH", _HATCH)


def _cell_style(cell: Cell, color: str) -> str:
    """The request's colour as CSS variables; the kind's class draws with them."""
    return f"--c:{color};--t:{_text_color(color)}" if cell.request and cell.kind != PADDING else ""


def _cell_title(cell: Cell, step: int, lane: str) -> str:
    what = {DECODE: "decode row", PREFILL: f"prefill, {cell.prefill_tokens} prompt tokens",
            PREFILL_DECODE: f"prefill ({cell.prefill_tokens} prompt tokens) + decode row",
            PADDING: "padding: finished, still computed", HELD: "holds the slot, ran nothing",
            IDLE: "idle"}[cell.kind]
    return f"step {step} · {lane}" + (f" · {cell.request}" if cell.request else "") + f" · {what}"


def _legend_html() -> str:
    swatches = [(DECODE, "decode"), (PREFILL, "prefill"), (PADDING, "padding (wasted)"),
                (HELD, "holds slot, no work"), (IDLE, "idle")]
    return '<div class="bl-legend">' + "".join(
        f'<span class="bl-swatch bl-{kind}"></span>{name}' for kind, name in swatches) + "</div>"


def _readout_html(trace: Trace, k: int, steps: list[StepRecord]) -> str:
    size = trace.max_batch_size
    if k < 0:
        return ('<div class="bl-readout"><span class="bl-counter" data-step="-1">no steps yet</span>'
                f' · {size} slots · waiting for the engine</div>')
    step = steps[k]
    occ = Occupancy(sum(len(s.decoded) for s in steps[:k + 1]), size * (k + 1))
    records = list(dict(trace.requests).values())
    counts: dict[str, int] = {}
    for rec in records:
        state = state_at(rec, step.end_s)
        if state is not None:
            counts[state] = counts.get(state, 0) + 1
    tokens = sum(len(t) for s in steps[:k + 1] for t in s.emitted.values())
    work = []
    if step.decoded:
        work.append("decode " + ", ".join(map(html.escape, step.decoded)))
    work += [f"prefill {html.escape(rid)} tokens {start}–{start + n - 1}" for rid, start, n in step.prefill]
    if step.padding:
        work.append("padding " + ", ".join(map(html.escape, step.padding)))
    work += [f"<b>{html.escape(rid)}</b> finished ({reason})" for rid, reason in step.finished.items()]
    states = " · ".join(f"{counts.get(s, 0)} {s.replace('_', ' ')}"
                        for s in ("queued", "prefilling", "awaiting_slot", "decoding", "finished"))
    return (
        '<div class="bl-readout">'
        f'<div><span class="bl-counter" data-step="{k}"><b>step {step.index}</b></span>'
        f' (steps {steps[0].index}–{steps[-1].index})'
        f' · t = {step.end_s - time_origin(trace):.2f} s · '
        f'this step {step.duration_s * 1000:.0f} ms, {step.passes} forward pass(es)</div>'
        f'<div class="bl-occupancy" data-decode-rows="{occ.decode_rows}" data-slot-steps="{occ.slot_steps}">'
        f'occupancy so far: <b>{occ.decode_rows}</b> decode rows ÷ ({size} slots × {k + 1} steps)'
        f' = <b>{occ.fraction:.0%}</b></div>'
        f'<div>this step: {" · ".join(work) or "nothing"}</div>'
        f'<div>requests: {states} · {tokens} tokens out so far</div></div>')


def frame_html(trace: Trace, step: int, window: int = 40) -> str:
    """One animation frame as self-contained HTML: the grid up to ``step`` (the last
    ``window`` steps of it), the current column outlined, and a readout below.

    Elements carry data attributes (``data-slot`` on slot labels, ``data-step``,
    ``data-kind`` and ``data-request`` on cells) so tests can read the picture.
    """
    steps = list(trace.steps)
    k = min(max(step, 0), len(steps) - 1)  # -1: no steps yet
    prefill_lanes = _prefill_lanes(trace.kind, steps)
    lanes = _lane_names(trace.max_batch_size, prefill_lanes)
    first = max(0, k - window + 1)
    columns = list(range(first, min(len(steps), first + window)))
    colors = request_colors(trace)
    parts = [(f'<div class="batchlab-slots bl-root" data-num-slots="{trace.max_batch_size}" '
              f'data-step="{k}" data-num-steps="{len(steps)}" data-kind="{html.escape(trace.kind)}">'),
             f"<style>{_CSS}</style>", _readout_html(trace, k, steps),
             f'<div class="bl-grid" style="grid-template-columns:5.5em{" 18px" * len(columns)}">',
             '<div class="bl-lane"></div>']
    for c in columns:
        index = steps[c].index
        label = str(index) if c == k or (index % 5 == 0 and abs(c - k) > 2) else ""
        parts.append(f'<div class="bl-col{" bl-current" if c == k else ""}">{label}</div>')
    cells = {c: _step_cells(steps, trace.max_batch_size, c, prefill_lanes) for c in columns if c <= k}
    for li, lane in enumerate(lanes):
        slot = f'data-slot="{li}"' if li < trace.max_batch_size else \
            f'data-prefill-lane="{li - trace.max_batch_size}"'
        parts.append(f'<div class="bl-lane" {slot}>{lane}</div>')
        previous = None
        for c in columns:
            if c > k:
                parts.append('<div class="bl-cell bl-future"></div>')
                continue
            cell = cells[c][li]
            show_label = cell.request is not None and cell.kind != PADDING \
                and (previous is None or previous.request != cell.request)
            label = f"<span>{html.escape(short_label(cell.request))}</span>" if show_label else ""
            current = " bl-current-cell" if c == k else ""
            request = f' data-request="{html.escape(cell.request)}"' if cell.request else ""
            parts.append(
                f'<div class="bl-cell bl-{cell.kind}{current}" data-lane="{li}" data-step="{c}" '
                f'data-kind="{cell.kind}"{request} style="{_cell_style(cell, colors.get(cell.request, ""))}" '
                f'title="{html.escape(_cell_title(cell, steps[c].index, lane))}">{label}</div>')
            previous = cell
    parts += ["</div>", _legend_html(), "</div>"]
    return "".join(parts)


# -- the widget -------------------------------------------------------------------------------
class SlotView(widgets.VBox):
    """The slot grid as an animation: play / pause, step back and forward, a step slider,
    and the frame (``frame_html``) below.

    Replay: ``SlotView(trace)``. Live: ``SlotView(engine_or_loop, live=True)`` and call
    ``refresh()`` in a loop, or ``follow(seconds)``, while the engine runs; each refresh
    jumps to the newest step. Rendering happens in Python and callbacks never print, so
    the widget adds no stray output to a notebook. Saved notebooks also carry a PNG of the
    whole grid, which viewers without a kernel (GitHub) show instead.
    """

    def __init__(self, source, live: bool = False, window: int = 40, interval_ms: int = 250):
        self.trace = trace_of(source)
        self.live = live
        self.window = window
        self._play = widgets.Play(min=0, max=0, interval=interval_ms, show_repeat=False,
                                  tooltip="play / pause")
        self._play.add_class("batchlab-play")
        self._slider = widgets.IntSlider(min=0, max=0, description="step",
                                         layout=widgets.Layout(width="420px"))
        widgets.jslink((self._play, "value"), (self._slider, "value"))
        back = widgets.Button(icon="step-backward", tooltip="one step back",
                              layout=widgets.Layout(width="36px"))
        forward = widgets.Button(icon="step-forward", tooltip="one step forward",
                                 layout=widgets.Layout(width="36px"))
        back.on_click(lambda _: self.show_step(self._slider.value - 1))
        forward.on_click(lambda _: self.show_step(self._slider.value + 1))
        self._frame = widgets.HTML()
        self._slider.observe(self._render, names="value")
        super().__init__([widgets.HBox([self._play, back, forward, self._slider]), self._frame])
        self.add_class("batchlab-slotview")
        self.refresh()

    @property
    def step(self) -> int:
        """The step the frame shows (a position in ``trace.steps``)."""
        return self._slider.value

    def show_step(self, k: int) -> None:
        self._slider.value = max(0, min(k, self._slider.max))

    def to_html(self, step: int | None = None) -> str:
        """The frame for ``step`` (default: the one shown) as standalone HTML."""
        return frame_html(self.trace, self.step if step is None else step, self.window)

    def _render(self, _change=None) -> None:
        self._frame.value = self.to_html()

    def refresh(self) -> None:
        """Take in the steps the engine has added; a live view jumps to the newest."""
        last = max(len(self.trace.steps) - 1, 0)
        self._play.max = self._slider.max = last
        if self.live and self._slider.value != last:
            self._slider.value = last  # the observer renders
        else:
            self._render()

    def follow(self, seconds: float = 60.0, interval: float = 0.2) -> None:
        """Refresh every ``interval`` seconds while the engine runs in another thread; return
        when every request has finished and its last step is recorded, or after ``seconds``."""
        self.live = True
        deadline = time.monotonic() + seconds
        while True:
            self.refresh()
            if _run_is_over(self.trace) or time.monotonic() >= deadline:
                return
            time.sleep(interval)

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        if self.trace.steps:  # what a viewer without the widget (GitHub) shows
            fig = plot_slot_grid(self.trace)
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=80)
            bundle["image/png"] = base64.b64encode(buffer.getvalue()).decode("ascii")
        return bundle

    def __repr__(self) -> str:
        return (f"SlotView({self.trace.kind} trace, {self.trace.max_batch_size} slots, "
                f"{len(self.trace.steps)} steps)")


def _run_is_over(trace: Trace) -> bool:
    """Every request finished, and the step that finished the last one is in the trace."""
    records = list(dict(trace.requests).values())
    steps = list(trace.steps)
    if not records or not steps or any(r.finished_s is None for r in records):
        return False
    served = [r.finished_s for r in records if r.finish_reason != "cancelled"]
    return steps[-1].end_s >= max(served, default=0.0)


# -- matplotlib figures -----------------------------------------------------------------------
def _axes(ax, **figure_kw):
    """Draw into ``ax`` if given, else into a new figure that is closed in pyplot, so a
    notebook shows the returned figure once (not again at the end of the cell)."""
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(layout="constrained", **figure_kw)
    plt.close(fig)
    return fig, ax


def _named(traces: Trace | Mapping[str, Trace]) -> dict[str, Trace]:
    return {traces.kind: traces} if isinstance(traces, Trace) else dict(traces)


def _runs(cells: list[Cell]):
    """(first step, length, cell) for each run of equal cells in one lane."""
    start = 0
    for k in range(1, len(cells) + 1):
        if k == len(cells) or (cells[k].kind, cells[k].request) != (cells[start].kind, cells[start].request) \
                or cells[k].kind == PREFILL_DECODE:
            yield start, k - start, cells[start]
            start = k


def plot_slot_grid(trace: Trace, ax=None, upto: int | None = None) -> Figure:
    """The whole slot grid (lanes × steps) as one picture: what the animation shows, at once."""
    grid = slot_grid(trace, upto)
    lanes = lane_names(trace)
    fig, ax = _axes(ax, figsize=(min(16.0, 3.0 + 0.14 * max(len(grid), 20)), 1.3 + 0.38 * len(lanes)))
    colors = request_colors(trace)
    label_runs = len(grid) <= 80
    for li, lane_cells in enumerate(zip(*grid)):
        previous = None
        for start, length, cell in _runs(list(lane_cells)):
            color = colors.get(cell.request, "#000000")
            box = (start, li + 0.08)
            if cell.kind == DECODE:
                ax.add_patch(Rectangle(box, length, 0.84, facecolor=color, edgecolor="white", lw=0.5))
            elif cell.kind in (PREFILL, PREFILL_DECODE):
                height = 0.84 if cell.kind == PREFILL else 0.46
                ax.add_patch(Rectangle(box, length, height, facecolor=_lighten(color), hatch="////",
                                       edgecolor=color, lw=0))
                if cell.kind == PREFILL_DECODE:
                    ax.add_patch(Rectangle((start, li + 0.54), length, 0.38, facecolor=color,
                                           edgecolor="white", lw=0.5))
            elif cell.kind == PADDING:
                ax.add_patch(Rectangle(box, length, 0.84, facecolor=PADDING_COLOR, hatch="xxx",
                                       edgecolor=PADDING_EDGE, lw=0))
            elif cell.kind == HELD:
                ax.add_patch(Rectangle((start + 0.06, li + 0.14), length - 0.12, 0.72,
                                       facecolor="white", edgecolor=color, lw=1.5))
            if label_runs and cell.kind != PADDING and cell.request not in (None, previous):
                ax.text(start + 0.15, li + 0.5, short_label(cell.request), va="center", fontsize=7,
                        color=_text_color(color) if cell.kind == DECODE else "#111", clip_on=True)
            previous = cell.request
    ax.set_xlim(0, max(len(grid), 1))
    ax.set_ylim(len(lanes), 0)
    ax.set_yticks([i + 0.5 for i in range(len(lanes))], lanes)
    ax.set_xlabel("engine step")
    ax.set_ylabel("lane")
    for li in range(1, len(lanes)):
        ax.axhline(li, color="#eeeeee", lw=0.8, zorder=0)
    occupancy = occupancy_so_far(trace, len(grid) - 1).fraction if grid else 0.0
    ax.set_title(f"{trace.kind}: {trace.max_batch_size} slots, {len(grid)} steps, "
                 f"occupancy {occupancy:.0%}")
    sample = "#4e79a7"
    ax.legend(handles=[Patch(facecolor=sample, label="decode"),
                       Patch(facecolor=_lighten(sample), hatch="////", edgecolor=sample, lw=0, label="prefill"),
                       Patch(facecolor=PADDING_COLOR, hatch="xxx", edgecolor=PADDING_EDGE, lw=0,
                             label="padding (wasted)"),
                       Patch(facecolor="white", edgecolor="#bbbbbb", label="idle")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


def plot_timeline(trace: Trace, ax=None) -> Figure:
    """A Gantt chart: one row per request, coloured by state, with a tick at every token."""
    records = list(dict(trace.requests).values())
    fig, ax = _axes(ax, figsize=(10, 1.2 + 0.3 * max(len(records), 3)))
    t0 = time_origin(trace)
    end = max([s.end_s for s in list(trace.steps)[-1:]] + [r.finished_s or 0.0 for r in records] + [t0])
    bars: dict[str, list[tuple[int, float, float]]] = {state: [] for state in STATE_COLORS}
    for row, record in enumerate(records):
        for state, start, stop in state_intervals(record, end):
            if state in bars and stop > start:
                bars[state].append((row, start - t0, stop - start))
    for state, segments in bars.items():
        if segments:
            rows, lefts, widths = zip(*segments)
            ax.barh(rows, widths, left=lefts, height=0.7, color=STATE_COLORS[state],
                    label=state.replace("_", " "))
    tokens = [(t - t0, row) for row, r in enumerate(records) for t in r.token_times_s]
    if tokens:
        xs, ys = zip(*tokens)
        ax.scatter(xs, ys, marker="|", s=60, color="black", linewidths=0.8, label="token", zorder=3)
    ax.set_yticks(range(len(records)), [r.id for r in records])
    ax.set_ylim(len(records) - 0.5, -0.5)
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel("request")
    ax.set_title(f"{trace.kind}: request timeline")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


def plot_tbt(trace: Trace, ax=None, mark_prefill: bool = True) -> Figure:
    """Time between tokens over time, one line per request; steps that ran a prefill chunk
    are shaded, so stalls line up with their cause."""
    fig, ax = _axes(ax, figsize=(10, 4))
    t0 = time_origin(trace)
    colors = request_colors(trace)
    records = [r for r in dict(trace.requests).values() if len(r.token_times_s) >= 2]
    if mark_prefill:
        for i, step in enumerate(s for s in list(trace.steps) if s.prefill):
            ax.axvspan(step.start_s - t0, step.end_s - t0, color=STATE_COLORS["prefilling"], alpha=0.15,
                       lw=0, label="step with a prefill chunk" if i == 0 else None)
    for record in records:
        times, gaps = zip(*token_gaps(record))
        ax.plot(np.array(times) - t0, np.array(gaps) * 1000, marker=".", lw=1, color=colors[record.id],
                label=record.id if len(records) <= 10 else None)
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel("time between tokens (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{trace.kind}: time between tokens")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


def _cdf(ax, values: list[float], label: str) -> None:
    xs = np.sort(values)
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)


def plot_latency_cdfs(traces: Trace | Mapping[str, Trace]) -> Figure:
    """TTFT and TBT distributions (CDFs, p50 and p99 in the legend), one line per trace."""
    fig, (ttft_ax, tbt_ax) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    plt.close(fig)
    for name, trace in _named(traces).items():
        ttft = ttfts(trace)
        tbt = [gap * 1000 for r in dict(trace.requests).values() for _, gap in token_gaps(r)]
        if ttft:
            p50, p99 = np.percentile(ttft, [50, 99])
            _cdf(ttft_ax, ttft, f"{name} (p50 {p50:.2f} s, p99 {p99:.2f} s)")
        if tbt:
            p50, p99 = np.percentile(tbt, [50, 99])
            _cdf(tbt_ax, tbt, f"{name} (p50 {p50:.0f} ms, p99 {p99:.0f} ms)")
    ttft_ax.set_xlabel("time to first token (s)")
    ttft_ax.set_ylabel("fraction of requests")
    ttft_ax.set_title("TTFT distribution")
    tbt_ax.set_xlabel("time between tokens (ms)")
    tbt_ax.set_ylabel("fraction of token gaps")
    tbt_ax.set_title("TBT distribution")
    for ax in (ttft_ax, tbt_ax):
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="lower right", fontsize=8)
    return fig


def plot_occupancy(traces: Trace | Mapping[str, Trace], ax=None) -> Figure:
    """Slot occupancy of every step over time (decode rows ÷ slots), one line per trace."""
    fig, ax = _axes(ax, figsize=(10, 3.5))
    for name, trace in _named(traces).items():
        steps = list(trace.steps)
        if not steps:
            continue
        t0 = time_origin(trace)
        shares = [100 * len(s.decoded) / trace.max_batch_size for s in steps]
        overall = occupancy_so_far(trace, len(steps) - 1).fraction
        ax.step([s.start_s - t0 for s in steps] + [steps[-1].end_s - t0], shares + shares[-1:],
                where="post", label=f"{name} (overall {overall:.0%})")
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel("slot occupancy (%)")
    ax.set_ylim(0, 105)
    ax.set_title("slot occupancy per step")
    if ax.lines:
        ax.legend(fontsize=8)
    return fig


def plot_tokens(traces: Trace | Mapping[str, Trace], ax=None) -> Figure:
    """Output tokens so far over time, one line per trace: the slope is the throughput."""
    fig, ax = _axes(ax, figsize=(10, 3.5))
    for name, trace in _named(traces).items():
        t0 = time_origin(trace)
        times = np.sort([t - t0 for r in dict(trace.requests).values() for t in r.token_times_s])
        if len(times) == 0:
            continue
        ax.step(np.concatenate([[0.0], times]), np.arange(len(times) + 1), where="post",
                label=f"{name} ({len(times) / times[-1]:.1f} tokens/s)" if times[-1] > 0 else name)
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel("output tokens so far")
    ax.set_title("output tokens over time")
    if ax.lines:
        ax.legend(fontsize=8)
    return fig


def plot_side_by_side(traces: Mapping[str, Trace], plot: Callable[..., Figure] = plot_slot_grid,
                      sharex: bool = True, sharey: bool = False, **plot_kw) -> Figure:
    """Draw the same figure for several traces, one above the other on shared axes (e.g.
    ``plot_side_by_side({"static": a, "continuous": b}, plot_timeline)``)."""
    named = dict(traces)
    fig, axes = plt.subplots(len(named), 1, figsize=(11, 3.2 * len(named)), sharex=sharex,
                             sharey=sharey, layout="constrained", squeeze=False)
    plt.close(fig)
    spans = []
    for ax, (name, trace) in zip(axes[:, 0], named.items()):
        plot(trace, ax=ax, **plot_kw)
        ax.set_title(name, loc="left", fontweight="bold")
        spans.append(ax.get_xlim())
    if sharex:  # each plot set its own range; show the widest so no trace is cut off
        axes[0, 0].set_xlim(min(a for a, _ in spans), max(b for _, b in spans))
    return fig


# -- KV blocks (lesson 8) ---------------------------------------------------------------------
FREE, OWNED, SHARED, CACHED = "free", "owned", "shared", "cached"


def block_owners(step: StepRecord) -> dict[int, list[str]]:
    """Block -> the requests whose block tables hold it after ``step`` (two or more: shared)."""
    owners: dict[int, list[str]] = {}
    for rid, table in step.block_tables.items():
        for block in table:
            owners.setdefault(block, []).append(rid)
    return owners


def block_count(trace: Trace) -> int:
    """The pool's size: recorded by the engine, else the highest block a step mentions."""
    if trace.num_kv_blocks:
        return trace.num_kv_blocks
    seen = [b for s in list(trace.steps) for b in [*block_owners(s), *s.cached_blocks]]
    return max(seen, default=-1) + 1


def block_states(trace: Trace, k: int) -> list[tuple[str, list[str]]]:
    """(FREE | OWNED | SHARED | CACHED, owners) of every block after step ``k``."""
    step = list(trace.steps)[k]
    owners, cached = block_owners(step), set(step.cached_blocks)
    out = []
    for b in range(block_count(trace)):
        who = owners.get(b, [])
        kind = SHARED if len(who) > 1 else OWNED if who else CACHED if b in cached else FREE
        out.append((kind, who))
    return out


_BLOCK_CSS = """
.bl-root .bl-blocks{display:grid;gap:2px;margin:6px 0}
.bl-root .bl-block{height:20px;border-radius:3px;font-size:10px;line-height:18px;
  text-align:center;overflow:hidden;box-sizing:border-box;white-space:nowrap}
.bl-root .bl-owned{background:var(--c);color:var(--t);border:1px solid var(--c)}
.bl-root .bl-shared{background:var(--c);color:var(--t);border:3px double #111;line-height:14px}
.bl-root .bl-cached{background:#eee;border:1px dashed #888;color:#777}
.bl-root .bl-free{background:#fff;border:1px solid #ddd}
"""


def block_frame_html(trace: Trace, k: int, columns: int = 16) -> str:
    """The KV pool after step ``k`` as HTML: one cell per block, coloured by the request
    that holds it; a shared block (prefix cache) has a double border and its holder count;
    a cached block nobody holds (evictable) is dashed."""
    step = list(trace.steps)[k]
    states = block_states(trace, k)
    cells = []
    for b, (kind, who) in enumerate(states):
        color = request_color(who[0]) if who else "#ffffff"
        style = f"--c:{color};--t:{_text_color(color)}"
        label = {OWNED: short_label(who[0]) if who else "", SHARED: f"×{len(who)}",
                 CACHED: "c", FREE: ""}[kind]
        title = f"block {b}: {kind}" + (f" by {', '.join(who)}" if who else "")
        cells.append(f'<div class="bl-block bl-{kind}" style="{style}" '
                     f'title="{html.escape(title)}">{label}</div>')
    counts = {kind: sum(s == kind for s, _ in states) for kind in (OWNED, SHARED, CACHED, FREE)}
    preempted = (f" · preempted: <b>{html.escape(', '.join(step.preempted))}</b>"
                 if step.preempted else "")
    readout = (f'<div class="bl-readout">KV blocks after step {step.index}: '
               f'<b>{counts[OWNED] + counts[SHARED]}</b> of {len(states)} in use '
               f'(<b>{counts[SHARED]}</b> shared), <b>{counts[CACHED]}</b> cached and free, '
               f'<b>{counts[FREE]}</b> free{preempted}</div>')
    legend = ('<div class="bl-legend">' + "".join(
        f'<span class="bl-swatch bl-block bl-{kind}" style="--c:#4e79a7;--t:#fff"></span>{name}'
        for kind, name in [(OWNED, "held by one request"), (SHARED, "shared (prefix cache)"),
                           (CACHED, "cached, evictable"), (FREE, "free")]) + "</div>")
    grid = (f'<div class="bl-blocks" style="grid-template-columns:repeat({columns},24px)">'
            + "".join(cells) + "</div>")
    return f'<div class="bl-root"><style>{_BLOCK_CSS}</style>{readout}{grid}{legend}</div>'


def plot_block_map(trace: Trace, ax=None) -> Figure:
    """Every block (rows) at every step (columns), coloured by the request holding it;
    shared blocks darker, cached-but-free ones grey; preemptions marked on top."""
    steps = list(trace.steps)
    n = block_count(trace)
    fig, ax = _axes(ax, figsize=(9, 3.6))
    image = np.ones((n, len(steps), 3))
    for k, step in enumerate(steps):
        for b in step.cached_blocks:
            image[b, k] = 0.85
        for b, who in block_owners(step).items():
            rgb = np.array([int(request_color(who[0])[i:i + 2], 16) / 255 for i in (1, 3, 5)])
            image[b, k] = rgb * (0.6 if len(who) > 1 else 1.0)
    ax.imshow(image, aspect="auto", interpolation="nearest", origin="lower",
              extent=(-0.5, len(steps) - 0.5, -0.5, n - 0.5))
    for k, step in enumerate(steps):
        if step.preempted:
            ax.axvline(k, color="#d62728", lw=1, ls="--")
    touched = [b for s in steps for b in [*block_owners(s), *s.cached_blocks]]
    ax.set_ylim(-0.5, max(touched, default=0) + 1.5)  # a big pool's never-used top stays off
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV block")
    ax.set_title("who holds each KV block (red dashes: a preemption; dark: shared; grey: cached)")
    return fig


class BlockView(SlotView):
    """``SlotView`` with the KV pool under the slots: per step, which request holds which
    block, shared blocks marked, cached ones dashed. Saved notebooks carry a PNG of the
    block map (``plot_block_map``) for viewers without a kernel."""

    def __init__(self, source, live: bool = False, window: int = 40, interval_ms: int = 250,
                 columns: int = 16):
        self.columns = columns
        super().__init__(source, live=live, window=window, interval_ms=interval_ms)
        self.add_class("batchlab-blockview")

    def to_html(self, step: int | None = None) -> str:
        k = self.step if step is None else step
        slots = super().to_html(k)
        return slots + block_frame_html(self.trace, k, self.columns) if self.trace.steps else slots

    def _repr_mimebundle_(self, **kwargs):
        bundle = widgets.VBox._repr_mimebundle_(self, **kwargs)
        if self.trace.steps:
            fig = plot_block_map(self.trace)
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=80)
            bundle["image/png"] = base64.b64encode(buffer.getvalue()).decode("ascii")
        return bundle

    def __repr__(self) -> str:
        return (f"BlockView({self.trace.kind} trace, {block_count(self.trace)} KV blocks, "
                f"{len(self.trace.steps)} steps)")
