"""The slot grid as an animation in the notebook: ``frame_html`` draws one step as HTML,
``SlotView`` (ipywidgets) plays the frames, replayed or following a live run. A replay's
frames are made once (``player_html``: the grid, and a small style and readout a step, switched by
an ``ipywidgets.Stack`` linked to the slider in the browser), so it plays while the kernel runs
later cells."""

from __future__ import annotations

import html
import time
import uuid
from collections.abc import Callable, Mapping

import ipywidgets as widgets
from IPython.display import display

from ..core.trace import StepRecord, Trace
from .colors import Palette, short_label, text_color
from .plots import plot_slot_grid, png_base64
from .grid import (
    DECODE,
    HELD,
    IDLE,
    PADDING,
    PREFILL,
    PREFILL_DECODE,
    VERIFY_LEGEND,
    VERIFY_SAMPLE,
    Cell,
    Occupancy,
    _lane_names,
    _prefill_lanes,
    _step_cells,
    has_drafts,
    request_colors,
    state_at,
    time_origin,
    trace_of,
)

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
.bl-root .bl-current-cell,.bl-root .bl-col.bl-current{position:relative;overflow:visible}
.bl-root .bl-current-cell::after,.bl-root .bl-col.bl-current::after,.bl-root .bl-swatch.bl-playhead::after{
  content:"";position:absolute;top:-2px;bottom:-2px;right:-2px;width:2px;background:#111}
.bl-root .bl-swatch.bl-playhead{position:relative;border:none;width:8px}
.bl-root .bl-legend .bl-swatch{display:inline-block;width:14px;height:14px;
  vertical-align:middle;margin:0 3px 0 10px;border-radius:3px;box-sizing:border-box;--c:#4e79a7}
.bl-root .bl-readout b{font-variant-numeric:tabular-nums}
""".replace("HATCH", _HATCH)
# only where the trace has verify rows, so a picture of a run without drafts is unchanged: a
# verify row is one band a token position it ran (--n of them, white lines between), the
# lower --k of the cell in the request's colour (its token and the accepted drafts), the
# rest grey (rejected drafts)
_VERIFY_CSS = """
.bl-root .bl-verify{background:repeating-linear-gradient(to top,#0000 0 calc(100% / var(--n) - 1px),
  #fff 0 calc(100% / var(--n))),linear-gradient(to top,var(--c) var(--k),#d0d0d0 0)}
.bl-root .bl-verify span{color:#111;background:#fffd;border-radius:2px;padding:0 1px;line-height:12px}
"""


def _css(trace: Trace) -> str:
    return _CSS + _VERIFY_CSS if has_drafts(trace) else _CSS


def _verify_style(cell: Cell) -> str:
    """A verify row's bands and the share of them in colour, as CSS variables."""
    bands = cell.bands
    return f";--n:{len(bands)};--k:{100 * sum(bands) / len(bands):.4g}%"


def _cell_style(cell: Cell, color: str) -> str:
    """The request's colour as CSS variables; the kind's class draws with them."""
    if not cell.request or cell.kind == PADDING:
        return ""
    verify = _verify_style(cell) if cell.kind == DECODE and cell.verify else ""
    return f"--c:{color};--t:{text_color(color)}{verify}"


def _cell_title(cell: Cell, step: int, lane: str) -> str:
    what = {
        DECODE: f"verify row: {cell.accepted} of {cell.drafts} drafts accepted ({cell.mark})"
        if cell.verify
        else "decode row",
        PREFILL: f"prefill, {cell.prefill_tokens} prompt tokens",
        PREFILL_DECODE: f"prefill ({cell.prefill_tokens} prompt tokens) + decode row",
        PADDING: "padding: finished, still computed",
        HELD: "holds the slot, ran nothing",
        IDLE: "idle",
    }[cell.kind]
    return f"step {step} · {lane}" + (f" · {cell.request}" if cell.request else "") + f" · {what}"


def _legend_html(trace: Trace) -> str:
    swatches = [
        (DECODE, "decode"),
        (PREFILL, "prefill"),
        (PADDING, "padding (wasted)"),
        (HELD, "holds slot, no work"),
        (IDLE, "idle"),
        ("playhead", "current step (the line)"),
    ]
    verify = ""
    if has_drafts(trace):
        verify = (
            f'<span class="bl-swatch bl-decode bl-verify" style="{_verify_style(VERIFY_SAMPLE)[1:]}"></span>'
            f"{html.escape(VERIFY_LEGEND)}"
        )
    return (
        '<div class="bl-legend">'
        + "".join(f'<span class="bl-swatch bl-{kind}"></span>{name}' for kind, name in swatches)
        + verify
        + "</div>"
    )


def _readout_html(trace: Trace, k: int, steps: list[StepRecord]) -> str:
    size = trace.max_batch_size
    if k < 0:
        return (
            '<div class="bl-readout"><span class="bl-counter" data-step="-1">no steps yet</span>'
            f" · {size} slots · waiting for the engine</div>"
        )
    step = steps[k]
    occ = Occupancy(sum(len(s.decoded) for s in steps[: k + 1]), size * (k + 1))
    records = list(dict(trace.requests).values())
    counts: dict[str, int] = {}
    for rec in records:
        state = state_at(rec, step.end_s)
        if state is not None:
            counts[state] = counts.get(state, 0) + 1
    tokens = sum(len(t) for s in steps[: k + 1] for t in s.emitted.values())
    work = []
    if step.decoded:
        rows = [_verify_cell(step, rid) for rid in step.decoded]
        work.append(
            "decode " + ", ".join(html.escape(c.request) + (f" ({c.mark})" if c.verify else "") for c in rows)
        )
    work += [f"prefill {html.escape(rid)} tokens {start}–{start + n - 1}" for rid, start, n in step.prefill]
    if step.padding:
        work.append("padding " + ", ".join(map(html.escape, step.padding)))
    work += [f"<b>{html.escape(rid)}</b> finished ({reason})" for rid, reason in step.finished.items()]
    states = " · ".join(
        f"{counts.get(s, 0)} {s.replace('_', ' ')}"
        for s in ("queued", "prefilling", "awaiting_slot", "decoding", "finished")
    )
    return (
        '<div class="bl-readout">'
        f'<div><span class="bl-counter" data-step="{k}"><b>step {step.index}</b></span>'
        f" (steps {steps[0].index}–{steps[-1].index})"
        f" · t = {step.end_s - time_origin(trace):.2f} s · "
        f"this step {step.duration_s * 1000:.0f} ms, {step.passes} forward pass(es)</div>"
        f'<div class="bl-occupancy" data-decode-rows="{occ.decode_rows}" data-slot-steps="{occ.slot_steps}">'
        f"occupancy so far: <b>{occ.decode_rows}</b> decode rows ÷ ({size} slots × {k + 1} steps)"
        f" = <b>{occ.fraction:.0%}</b></div>"
        f"<div>this step: {' · '.join(work) or 'nothing'}</div>"
        f"<div>requests: {states} · {tokens} tokens out so far</div></div>"
    )


def _verify_cell(step: StepRecord, rid: str) -> Cell:
    return Cell(DECODE, rid, drafts=step.drafts.get(rid, 0), accepted=step.accepted.get(rid, 0))


def _grid_html(
    trace: Trace, steps: list[StepRecord], columns: list[int], k: int | None, colors, width: int | None = None
) -> str:
    """The grid's columns ``columns`` (positions in ``steps``): a header, then one row a lane.
    With ``k``, a frame: the columns after ``k`` are blank, ``k`` is marked current and each
    run of a request is labelled where it starts in view. With ``k`` None, the replay's whole
    grid (``player_html``): every cell drawn, each with its column's class ``s<c>``, and a
    label in every cell of a request, shown where its run starts (the others are ``bl-more``,
    shown by a step's style at the window's left edge), ``width`` columns in view at a time."""
    prefill_lanes = _prefill_lanes(trace, steps)
    lanes = _lane_names(trace.max_batch_size, prefill_lanes)
    parts = [
        f'<div class="bl-grid" style="grid-template-columns:5.5em{" 18px" * (width or len(columns))}">',
        '<div class="bl-lane"></div>',
    ]
    for c in columns:
        index = steps[c].index
        if k is None:
            every5 = " bl-every5" if index % 5 == 0 else ""
            parts.append(f'<div class="bl-col s{c}{every5}">{index}</div>')
            continue
        label = str(index) if c == k or (index % 5 == 0 and abs(c - k) > 2) else ""
        parts.append(f'<div class="bl-col{" bl-current" if c == k else ""}">{label}</div>')
    drawn = [c for c in columns if k is None or c <= k]
    cells = {c: _step_cells(steps, trace.max_batch_size, c, prefill_lanes) for c in drawn}
    for li, lane in enumerate(lanes):
        slot = (
            f'data-slot="{li}"'
            if li < trace.max_batch_size
            else f'data-prefill-lane="{li - trace.max_batch_size}"'
        )
        parts.append(f'<div class="bl-lane" {slot}>{lane}</div>')
        previous = None
        for c in columns:
            if k is not None and c > k:
                parts.append('<div class="bl-cell bl-future"></div>')
                continue
            cell = cells[c][li]
            named = cell.request is not None and cell.kind != PADDING
            starts = named and (previous is None or previous.request != cell.request)
            label = ""
            if named and (starts or k is None):
                more = "" if starts else ' class="bl-more"'
                label = f"<span{more}>{html.escape(short_label(cell.request))}</span>"
            marks = " bl-current-cell" if c == k else f" s{c}" if k is None else ""
            request = f' data-request="{html.escape(cell.request)}"' if cell.request else ""
            if cell.kind == DECODE and cell.verify:
                marks = " bl-verify" + marks
                request += f' data-drafts="{cell.drafts}" data-accepted="{cell.accepted}"'
            parts.append(
                f'<div class="bl-cell bl-{cell.kind}{marks}" data-lane="{li}" data-step="{c}" '
                f'data-kind="{cell.kind}"{request} style="{_cell_style(cell, colors.get(cell.request, ""))}" '
                f'title="{html.escape(_cell_title(cell, steps[c].index, lane))}">{label}</div>'
            )
            previous = cell
    parts.append("</div>")
    return "".join(parts)


def _root(trace: Trace, steps: list, extra: str = "") -> str:
    return (
        f'<div class="batchlab-slots bl-root"{extra} data-num-slots="{trace.max_batch_size}" '
        f'data-num-steps="{len(steps)}" data-kind="{html.escape(trace.kind)}">'
    )


def frame_html(trace: Trace, step: int, window: int = 40, colors: Mapping[str, str] | None = None) -> str:
    """One animation frame as self-contained HTML: the grid up to ``step`` (the last
    ``window`` steps of it), a line after the current column, and a readout below.
    ``colors`` (request -> colour) defaults to ``request_colors(trace)``.

    Elements carry data attributes (``data-slot`` on slot labels, ``data-step``,
    ``data-kind`` and ``data-request`` on cells) so tests can read the picture.
    """
    steps = list(trace.steps)
    k = min(max(step, 0), len(steps) - 1)  # -1: no steps yet
    first = max(0, k - window + 1)
    columns = list(range(first, min(len(steps), first + window)))
    colors = request_colors(trace) if colors is None else colors
    return "".join(
        [
            _root(trace, steps, f' data-step="{k}"'),
            f"<style>{_css(trace)}</style>",
            _readout_html(trace, k, steps),
            _grid_html(trace, steps, columns, k, colors),
            _legend_html(trace),
            "</div>",
        ]
    )


def _window(k: int, window: int, num_steps: int) -> range:
    """The columns a frame at step ``k`` shows (as ``frame_html`` does)."""
    first = max(0, k - window + 1)
    return range(first, min(num_steps, first + window))


def _selector(root: str, columns, what: str = "") -> str:
    return f"{root} :is({','.join(f'.s{c}' for c in columns)}){what}"


def player_html(
    trace: Trace, window: int = 40, colors: Mapping[str, str] | None = None, uid: str = "bl-replay"
) -> tuple[str, list[str]]:
    """The replay of a finished trace in two parts, for a player that needs no kernel: the
    whole grid once (every column, hidden), and for each step a small piece of HTML, its
    readout and a ``<style>`` that shows that step's ``window`` of columns as ``frame_html``
    draws them: the columns after it blank, a line after it. Only the step shown is on the
    page (an ``ipywidgets.Stack`` keeps one child in it), so only its style applies; ``uid``
    (the grid's id) keeps it to this grid."""
    steps = list(trace.steps)
    colors = request_colors(trace) if colors is None else colors
    width = len(_window(0, window, len(steps)))
    root = f"#{uid}.bl-root"  # an id and a class: above the grid's own rules below
    hidden = (
        f"#{uid} .bl-cell,#{uid} .bl-col,#{uid} .bl-more{{display:none}}#{uid} .bl-col{{color:transparent}}"
    )
    grid = "".join(
        [
            _root(trace, steps, f' id="{uid}"'),
            f"<style>{_css(trace)}{hidden}{root} .bl-every5{{color:#999}}</style>",
            _grid_html(trace, steps, list(range(len(steps))), None, colors, width),
            _legend_html(trace),
            "</div>",
        ]
    )
    states = []
    for k in range(len(steps)):
        shown = _window(k, window, len(steps))
        after = [c for c in shown if c > k]
        near = [c for c in range(k - 2, k + 3) if c != k and 0 <= c < len(steps)]
        rules = [
            _selector(root, shown, "{display:block}"),
            f"{root} .bl-cell.s{shown.start} .bl-more{{display:inline}}",
            f"{root} .bl-col.s{k}{{color:#000;font-weight:700}}",
            f"{root} .bl-cell.s{k}{{position:relative;overflow:visible}}",
            f'{root} .bl-cell.s{k}::after{{content:"";position:absolute;top:-2px;bottom:-2px;'
            f"right:-2px;width:2px;background:#111}}",
        ]
        if near:
            rules.append(_selector(root, near, ".bl-col{color:transparent}"))
        if after:
            rules.append(
                _selector(root, after, ".bl-cell{background:#fafafa!important;border:1px dashed #ececec}")
            )
            rules.append(_selector(root, after, ".bl-cell span{display:none!important}"))
        states.append(
            f'<div class="bl-root bl-state" data-step="{k}"><style>{"".join(rules)}</style>'
            f"{_readout_html(trace, k, steps)}</div>"
        )
    return grid, states


# -- the widget -------------------------------------------------------------------------------
class SlotView(widgets.VBox):
    """The slot grid as an animation: play / pause, step back and forward, a step slider,
    and the frame below.

    Replay: ``SlotView(trace)``. Every step's frame is made once (``player_html``) and the
    browser switches between them: play and the slider need no kernel, so the replay plays
    while later cells run (and in a saved notebook whose widget state was kept). Live:
    ``SlotView(engine_or_loop, live=True)``, show it with ``view.display()``, and call
    ``refresh()`` in a loop, or ``follow()``, while the engine runs; each refresh draws the
    newest step (``frame_html``) in Python. Callbacks never print, so the widget adds no stray
    output to a notebook. Saved notebooks also carry
    a PNG of the whole grid, which viewers without a kernel (GitHub) show instead; a live
    view gets its PNG when ``follow()`` ends, by updating the output ``display()`` made.
    For an animation those viewers play, show ``animation(trace)`` beside the view.
    """

    def __init__(self, source, live: bool = False, window: int = 40, interval_ms: int = 250):
        self.trace = trace_of(source)
        self.palette = Palette()  # a request keeps its colour while a live trace grows or forgets
        self.live = live
        self.window = window
        self._play = widgets.Play(
            min=0, max=0, interval=interval_ms, show_repeat=False, tooltip="play / pause"
        )
        self._play.add_class("batchlab-play")
        # no numeric readout: the slider counts positions in the trace, and the frame says
        # which engine step ("step N") it shows, so the two could not disagree
        self._slider = widgets.IntSlider(
            min=0, max=0, description="step", readout=False, layout=widgets.Layout(width="420px")
        )
        self._links = [widgets.jslink((self._play, "value"), (self._slider, "value"))]
        back = widgets.Button(
            icon="step-backward", tooltip="one step back", layout=widgets.Layout(width="36px")
        )
        forward = widgets.Button(
            icon="step-forward", tooltip="one step forward", layout=widgets.Layout(width="36px")
        )
        back.on_click(lambda _: self.show_step(self._slider.value - 1))
        forward.on_click(lambda _: self.show_step(self._slider.value + 1))
        self._frame = widgets.HTML()  # live: the frame Python draws
        self._states = widgets.Stack()  # replay: every step's frame state, one shown at a time
        self._grid = widgets.HTML()  # replay: the whole grid, drawn once
        self._links.append(widgets.jslink((self._slider, "value"), (self._states, "selected_index")))
        self._made = -1  # how many steps the replay's frames were made for
        self._uid = f"bl-{uuid.uuid4().hex[:12]}"  # unique on a page, saved outputs of other runs included
        self._display = None  # the output that display() made, updated when follow() ends
        self._slider.observe(self._render, names="value")
        super().__init__([widgets.HBox([self._play, back, forward, self._slider])])
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
        k = self.step if step is None else step
        colors = request_colors(self.trace, self.palette)
        return frame_html(self.trace, k, self.window, colors) + self._below(k)

    def _below(self, k: int) -> str:
        """What a frame shows under the slot grid at step ``k`` (``BlockView``: the KV pool)."""
        return ""

    def _render(self, _change=None) -> None:
        if self.live:
            self._frame.value = self.to_html()
        elif self._states.children:
            self._states.selected_index = min(self._slider.value, len(self._states.children) - 1)

    def _make_replay(self) -> None:
        """Every step's frame, once: the grid and a state a step (``player_html``)."""
        steps = len(self.trace.steps)
        grid, states = player_html(
            self.trace, self.window, request_colors(self.trace, self.palette), self._uid
        )
        if not steps:
            grid, states = frame_html(self.trace, -1, self.window), [""]
        self._grid.value = grid
        first = widgets.HTML(states[0] + self._below(0))
        shared = dict(layout=first.layout, style=first.style)  # one each, not one a step
        self._states.children = [first] + [
            widgets.HTML(s + self._below(k), **shared) for k, s in enumerate(states) if k
        ]
        self._made = steps
        self.children = (self.children[0], self._states, self._grid)

    def refresh(self) -> None:
        """Take in the steps the engine has added; a live view jumps to the newest."""
        last = max(len(self.trace.steps) - 1, 0)
        self._play.max = self._slider.max = last
        if self.live:
            self.children = (self.children[0], self._frame)
            if self._slider.value != last:
                self._slider.value = last  # the observer renders
                return
        elif self._made != len(self.trace.steps):
            self._make_replay()
        self._render()

    def display(self) -> None:
        """Show the view as a cell output that ``follow()`` can update when it ends."""
        self._display = display(self, display_id=True)

    def follow(
        self,
        until: Callable[[], bool] | None = None,
        seconds: float = 60.0,
        interval: float = 0.2,
        grace: float = 1.0,
    ) -> None:
        """Refresh every ``interval`` seconds while the engine runs in another thread.

        Returns when ``until()`` is true (e.g. ``lambda: not any(t.is_alive() for t in
        clients)``), or, without ``until``, when every request so far has finished and nothing
        new (request or step) has come for ``grace`` seconds: clients that arrive one by one
        leave moments where the engine is idle but the run is not over. Returns after
        ``seconds`` in any case. Then the output of ``display()`` is redrawn, so a saved
        notebook keeps the final grid as a picture.
        """
        self.live = True
        deadline = time.monotonic() + seconds
        seen, quiet_since = None, time.monotonic()
        while True:
            self.refresh()
            now = time.monotonic()
            size = (len(self.trace.requests), len(self.trace.steps))
            if size != seen:
                seen, quiet_since = size, now
            if until is not None:
                done = until()
            else:
                done = _run_is_over(self.trace) and now - quiet_since >= grace
            if done or now >= deadline:
                break
            time.sleep(interval)
        self.refresh()
        if self._display is not None:
            self._display.update(self)

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        if self.trace.steps:  # what a viewer without the widget (GitHub) shows
            bundle["image/png"] = png_base64(plot_slot_grid(self.trace))
        return bundle

    def __repr__(self) -> str:
        return (
            f"SlotView({self.trace.kind} trace, {self.trace.max_batch_size} slots, "
            f"{len(self.trace.steps)} steps)"
        )


def _run_is_over(trace: Trace) -> bool:
    """Every request finished, and the step that finished the last one is in the trace."""
    records = list(dict(trace.requests).values())
    steps = list(trace.steps)
    if not records or not steps or any(r.finished_s is None for r in records):
        return False
    served = [r.finished_s for r in records if r.finish_reason != "cancelled"]
    return steps[-1].end_s >= max(served, default=0.0)
