"""Still figures (matplotlib) of a run: the slot grid, request timelines, time between
tokens, latency CDFs, occupancy and output tokens over time, several traces side by side.

Times on every axis are seconds since the run's first request arrived (``time_origin``),
so runs made at different moments line up.
"""

from __future__ import annotations

import base64
import inspect
import io
import textwrap
from collections.abc import Callable, Mapping

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerBase
from matplotlib.patches import Patch, Rectangle

from ..core.trace import Trace
from .colors import PADDING_COLOR, PADDING_EDGE, STATE_COLORS, Palette, fitting_label, lighten, text_color
from .grid import (
    DECODE,
    HELD,
    IDLE,
    PADDING,
    PREFILL,
    PREFILL_DECODE,
    VERIFY_LEGEND,
    VERIFY_SAMPLE,
    gap_band,
    has_drafts,
    lane_names,
    occupancy_so_far,
    request_colors,
    runs,
    slot_grid,
    state_intervals,
    time_origin,
    token_gaps,
    ttfts,
)

LABEL_FONTSIZE = 7


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


def png_base64(fig: Figure, dpi: int = 80) -> str:
    """The figure as a base64 PNG, for a notebook output that viewers without a kernel show."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _label_width_pt(label: str, fontsize: float = LABEL_FONTSIZE) -> float:
    """Roughly how wide ``label`` is in points, with a little margin."""
    return 0.62 * fontsize * len(label) + 3


def _verify_bands(ax, x: float, lane: int, bands: tuple[bool, ...]) -> list:
    """A verify row's cell over its run's box (the lane's y grows downwards): the rejected
    drafts' bands at its top in grey; returns the white lines between its bands."""
    height = 0.84 / len(bands)
    bottom = lane + 0.92
    rejected = bands.count(False)
    if rejected:
        ax.add_patch(Rectangle((x, lane + 0.08), 1, rejected * height, facecolor=PADDING_COLOR, lw=0))
    return [[(x, bottom - i * height), (x + 1, bottom - i * height)] for i in range(1, len(bands))]


class _VerifyHandler(HandlerBase):
    """The legend's verify row drawn as the grid draws one: ``VERIFY_SAMPLE``'s bands, bottom up."""

    def create_artists(self, legend, orig_handle, xdescent, ydescent, width, height, fontsize, trans):
        bands = VERIFY_SAMPLE.bands
        # as tall as a cell: three times an entry's swatch (its label takes several lines)
        h, bottom, left = 3 * height / len(bands), -ydescent - height, -xdescent + width / 4
        artists = [
            Rectangle(
                (left, bottom + i * h),
                width / 2,
                h,
                facecolor=orig_handle.get_facecolor() if kept else PADDING_COLOR,
                lw=0,
                transform=trans,
            )
            for i, kept in enumerate(bands)
        ]
        lines = [[(left, bottom + i * h), (left + width / 2, bottom + i * h)] for i in range(1, len(bands))]
        return [*artists, LineCollection(lines, colors="white", lw=0.6, transform=trans)]


def plot_slot_grid(trace: Trace, ax=None, upto: int | None = None, palette: Palette | None = None) -> Figure:
    """The slot grid (lanes × steps) as one picture: what the animation shows, at once.
    Each run of a request is labelled with its id where the run is wide enough (its short
    label where only that fits); the x axis counts the engine's own step numbers, so a
    window of a long run (``busiest_window``) shows where it sits. A verify row
    (speculative decoding) is drawn in bands, one a token position, its rejected drafts'
    grey (``Cell.bands``)."""
    grid = slot_grid(trace, upto)
    steps = list(trace.steps)
    lanes = lane_names(trace)
    fig, ax = _axes(ax, figsize=(min(16.0, 3.0 + 0.14 * max(len(grid), 20)), 1.3 + 0.38 * len(lanes)))
    colors = request_colors(trace, palette)
    first = steps[0].index if steps else 0
    # points per step, roughly: the axes take ~80% of the figure's width
    step_pt = fig.get_figwidth() * ax.get_position().width * 0.8 * 72 / max(len(grid), 1)
    separators = []  # white lines between a verify row's bands, drawn at once at the end
    for li, lane_cells in enumerate(zip(*grid)):
        lane_cells = list(lane_cells)
        for start, length, cell in runs(lane_cells):
            if cell.kind == IDLE:
                continue
            color = colors.get(cell.request, "#000000")
            x = first + start
            box = (x, li + 0.08)
            if cell.kind == DECODE:
                ax.add_patch(Rectangle(box, length, 0.84, facecolor=color, edgecolor="white", lw=0.5))
            elif cell.kind in (PREFILL, PREFILL_DECODE):
                height = 0.84 if cell.kind == PREFILL else 0.46
                ax.add_patch(
                    Rectangle(
                        box, length, height, facecolor=lighten(color), hatch="////", edgecolor=color, lw=0
                    )
                )
                if cell.kind == PREFILL_DECODE:
                    ax.add_patch(
                        Rectangle((x, li + 0.54), length, 0.38, facecolor=color, edgecolor="white", lw=0.5)
                    )
            elif cell.kind == PADDING:
                ax.add_patch(
                    Rectangle(
                        box, length, 0.84, facecolor=PADDING_COLOR, hatch="xxx", edgecolor=PADDING_EDGE, lw=0
                    )
                )
            elif cell.kind == HELD:
                ax.add_patch(
                    Rectangle(
                        (x + 0.06, li + 0.14), length - 0.12, 0.72, facecolor="white", edgecolor=color, lw=1.5
                    )
                )
            label = (
                None
                if cell.kind == PADDING
                else fitting_label(cell.request, length * step_pt, _label_width_pt)
            )
            # a label on bands of colour and grey gets a white box, as on prefill
            plain = cell.kind == DECODE and not any(c.verify for c in lane_cells[start : start + length])
            if label:
                ax.text(
                    x + 0.15,
                    li + 0.5,
                    label,
                    va="center",
                    fontsize=LABEL_FONTSIZE,
                    clip_on=True,
                    color=text_color(color) if plain else "#111",
                    bbox=None if plain else {"facecolor": "white", "alpha": 0.7, "pad": 0.5, "lw": 0},
                )
        for c, cell in enumerate(lane_cells):
            if cell.kind == DECODE and cell.verify:
                separators += _verify_bands(ax, first + c, li, cell.bands)
    if separators:
        ax.add_collection(LineCollection(separators, colors="white", lw=0.6))
    ax.set_xlim(first, first + max(len(grid), 1))
    ax.set_ylim(len(lanes), 0)
    ax.set_yticks([i + 0.5 for i in range(len(lanes))], lanes)
    ax.set_xlabel("engine step")
    ax.set_ylabel("lane")
    for li in range(1, len(lanes)):
        ax.axhline(li, color="#eeeeee", lw=0.8, zorder=0)
    occupancy = occupancy_so_far(trace, len(grid) - 1).fraction if grid else 0.0
    span = f"steps {steps[0].index}–{steps[len(grid) - 1].index}" if grid else "no steps"
    ax.set_title(f"{trace.kind}: {trace.max_batch_size} slots, {span}, occupancy {occupancy:.0%}")
    sample = "#4e79a7"
    # only where the run has verify rows, so a figure of a run without them is unchanged
    verify = [Patch(facecolor=sample, label=textwrap.fill(VERIFY_LEGEND, 34))] if has_drafts(trace) else []
    ax.legend(
        handles=[
            Patch(facecolor=sample, label="decode"),
            Patch(facecolor=lighten(sample), hatch="////", edgecolor=sample, lw=0, label="prefill"),
            Patch(
                facecolor=PADDING_COLOR, hatch="xxx", edgecolor=PADDING_EDGE, lw=0, label="padding (wasted)"
            ),
            Patch(facecolor="white", edgecolor=sample, lw=1.5, label="holds slot, no work"),
            Patch(facecolor="white", edgecolor="#bbbbbb", label="idle"),
            *verify,
        ],
        **({"handler_map": {verify[0]: _VerifyHandler()}} if verify else {}),
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
        title="labels: request ids",
        title_fontsize=8,
    )
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
            ax.barh(
                rows, widths, left=lefts, height=0.7, color=STATE_COLORS[state], label=state.replace("_", " ")
            )
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


def _worst_gap(record) -> float:
    return max(gap for _, gap in token_gaps(record))


def plot_tbt(
    trace: Trace,
    ax=None,
    mark_prefill: bool = True,
    highlight: str | None = None,
    palette: Palette | None = None,
) -> Figure:
    """Time between tokens over time: one request drawn as a line (``highlight``, by
    default the one with the worst gap), the others as a band from their smallest to their
    largest gap at each moment. Each gap is a flat step as wide as it lasted; steps that ran
    a prefill chunk are shaded, so stalls line up with their cause."""
    fig, ax = _axes(ax, figsize=(10, 4))
    t0 = time_origin(trace)
    records = [r for r in dict(trace.requests).values() if len(r.token_times_s) >= 2]
    if highlight is None and records:
        highlight = max(records, key=_worst_gap).id  # the first of equals
    elif highlight is not None and highlight not in {r.id for r in records}:
        raise ValueError(
            f"no request {highlight!r} with two tokens or more in this trace; "
            f"choose one of {[r.id for r in records][:10]}"
        )
    if mark_prefill:
        for i, step in enumerate(s for s in list(trace.steps) if s.prefill):
            ax.axvspan(
                step.start_s - t0,
                step.end_s - t0,
                color=STATE_COLORS["prefilling"],
                alpha=0.15,
                lw=0,
                label="step with a prefill chunk" if i == 0 else None,
            )
    others = [r for r in records if r.id != highlight]
    if others:
        xs, lo, hi = gap_band(others)
        # edged, so the band still shows where all the others have the same gap
        ax.fill_between(
            xs - t0,
            lo * 1000,
            hi * 1000,
            step="pre",
            facecolor=(0.55, 0.55, 0.55, 0.35),
            edgecolor=(0.45, 0.45, 0.45, 0.9),
            lw=0.8,
            label=f"the other {len(others)} requests: smallest to largest gap",
        )
    if highlight is not None:
        record = trace.requests[highlight]
        # each gap is drawn flat over the time it lasted, from the token before to its token,
        # so a stall is a wide plateau, not a ramp from the previous gap; the dots are tokens
        times, gaps = zip(*token_gaps(record))
        xs = np.array([record.token_times_s[0], *times]) - t0
        ys = np.array([gaps[0], *gaps]) * 1000
        ax.plot(
            xs,
            ys,
            drawstyle="steps-pre",
            marker=".",
            markevery=slice(1, None),
            lw=1.6,
            color=request_colors(trace, palette)[highlight],
            label=f"{highlight} (worst gap {max(gaps) * 1000:.0f} ms)",
        )
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel("time between tokens (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{trace.kind}: time between tokens" + (f", {highlight} highlighted" if highlight else ""))
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
        ax.step(
            [s.start_s - t0 for s in steps] + [steps[-1].end_s - t0],
            shares + shares[-1:],
            where="post",
            label=f"{name} (overall {overall:.0%})",
        )
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
        ax.step(
            np.concatenate([[0.0], times]),
            np.arange(len(times) + 1),
            where="post",
            label=f"{name} ({len(times) / times[-1]:.1f} tokens/s)" if times[-1] > 0 else name,
        )
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel("output tokens so far")
    ax.set_title("output tokens over time")
    if ax.lines:
        ax.legend(fontsize=8)
    return fig


def plot_side_by_side(
    traces: Mapping[str, Trace],
    plot: Callable[..., Figure] = plot_slot_grid,
    sharex: bool = True,
    sharey: bool = False,
    **plot_kw,
) -> Figure:
    """Draw the same figure for several traces, one above the other on shared axes (e.g.
    ``plot_side_by_side({"static": a, "continuous": b}, plot_timeline)``); figures that
    colour requests share one palette, so a request has one colour in every panel."""
    named = dict(traces)
    if "palette" in inspect.signature(plot).parameters:
        plot_kw.setdefault("palette", Palette())
    fig, axes = plt.subplots(
        len(named),
        1,
        figsize=(11, 3.2 * len(named)),
        sharex=sharex,
        sharey=sharey,
        layout="constrained",
        squeeze=False,
    )
    plt.close(fig)
    spans = []
    for ax, (name, trace) in zip(axes[:, 0], named.items()):
        plot(trace, ax=ax, **plot_kw)
        # one title per panel, the caller's name for it: the plot's own title names the
        # scheduler's kind (the same for two runs of one class), and a second title would
        # be drawn over it
        own = ax.get_title()
        what = own.split(": ", 1)[1] if own.startswith(f"{trace.kind}: ") else own
        ax.set_title("")
        ax.set_title(f"{name} · {what}" if what else name, loc="left", fontweight="bold")
        spans.append(ax.get_xlim())
    if sharex:  # each plot set its own range; show the widest so no trace is cut off
        axes[0, 0].set_xlim(min(a for a, _ in spans), max(b for _, b in spans))
    return fig
