"""Paged KV blocks (lesson 8): which request holds which block at each step, as data
(``block_states``), as HTML under the slot grid (``BlockView``) and as a still map."""

from __future__ import annotations

import html
import itertools
from collections.abc import Mapping

import ipywidgets as widgets
import numpy as np
from matplotlib.figure import Figure

from ..core.trace import StepRecord, Trace
from .colors import Palette, fitting_label, rgb, short_label, text_color
from .grid import request_colors
from .plots import _axes, _label_width_pt, png_base64
from .widget import SlotView

FREE, OWNED, SHARED, CACHED = "free", "owned", "shared", "cached"
SHARED_RGB = np.array([0.22, 0.22, 0.26])  # plot_block_map: every shared block, whoever holds it


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
.bl-root .bl-holders .bl-swatch{display:inline-block;width:12px;height:12px;border-radius:3px;
  vertical-align:middle;margin:0 3px 0 8px;background:var(--c)}
"""


def block_frame_html(trace: Trace, k: int, columns: int = 16, colors: Mapping[str, str] | None = None) -> str:
    """The KV pool after step ``k`` as HTML: one cell per block, coloured by the request
    that holds it and labelled with its id (short form); a shared block (prefix cache) has
    a double border and its holder count; a cached block nobody holds (evictable) is
    dashed. A key under the pool names every holder with its colour and block count."""
    step = list(trace.steps)[k]
    states = block_states(trace, k)
    colors = request_colors(trace) if colors is None else colors
    cells = []
    for b, (kind, who) in enumerate(states):
        color = colors.get(who[0], "#4e79a7") if who else "#ffffff"
        style = f"--c:{color};--t:{text_color(color)}"
        label = {OWNED: short_label(who[0]) if who else "", SHARED: f"×{len(who)}", CACHED: "c", FREE: ""}[
            kind
        ]
        title = f"block {b}: {kind}" + (f" by {', '.join(who)}" if who else "")
        request = f' data-request="{html.escape(who[0])}"' if who else ""
        cells.append(
            f'<div class="bl-block bl-{kind}"{request} style="{style}" '
            f'title="{html.escape(title)}">{html.escape(label)}</div>'
        )
    counts = {kind: sum(s == kind for s, _ in states) for kind in (OWNED, SHARED, CACHED, FREE)}
    preempted = f" · preempted: <b>{html.escape(', '.join(step.preempted))}</b>" if step.preempted else ""
    readout = (
        f'<div class="bl-readout">KV blocks after step {step.index}: '
        f"<b>{counts[OWNED] + counts[SHARED]}</b> of {len(states)} in use "
        f"(<b>{counts[SHARED]}</b> shared), <b>{counts[CACHED]}</b> cached and free, "
        f"<b>{counts[FREE]}</b> free{preempted}</div>"
    )
    held: dict[str, int] = {}
    for _, who in states:
        for rid in who:
            held[rid] = held.get(rid, 0) + 1
    holders = (
        (
            '<div class="bl-holders">holders:'
            + "".join(
                f'<span class="bl-swatch" style="--c:{colors.get(rid, "#4e79a7")}"></span>'
                f"{html.escape(rid)} ({n})"
                for rid, n in held.items()
            )
            + "</div>"
        )
        if held
        else ""
    )
    legend = (
        '<div class="bl-legend">'
        + "".join(
            f'<span class="bl-swatch bl-block bl-{kind}" style="--c:#4e79a7;--t:#fff"></span>{name}'
            for kind, name in [
                (OWNED, "held by one request"),
                (SHARED, "shared (prefix cache)"),
                (CACHED, "cached, evictable"),
                (FREE, "free"),
            ]
        )
        + "</div>"
    )
    grid = (
        f'<div class="bl-blocks" style="grid-template-columns:repeat({columns},24px)">'
        + "".join(cells)
        + "</div>"
    )
    return f'<div class="bl-root"><style>{_BLOCK_CSS}</style>{readout}{grid}{holders}{legend}</div>'


def plot_block_map(trace: Trace, ax=None, palette: Palette | None = None) -> Figure:
    """Every block (rows) at every step (columns), coloured by the request holding it and
    labelled with its id on its longest stretch; shared blocks darker, cached-but-free ones
    grey; preemptions marked on top."""
    steps = list(trace.steps)
    n = block_count(trace)
    fig, ax = _axes(ax, figsize=(9, 3.6))
    colors = request_colors(trace, palette)
    image = np.ones((n, len(steps), 3))
    owners = [block_owners(step) for step in steps]
    for k, step in enumerate(steps):
        for b in step.cached_blocks:
            image[b, k] = 0.85
        for b, who in owners[k].items():  # a shared block: one dark shade whoever holds it
            image[b, k] = SHARED_RGB if len(who) > 1 else np.array(rgb(colors.get(who[0], "#4e79a7"))) / 255
    for b in range(n):  # each stretch of a shared block carries its holder count
        counts = [len(step_owners.get(b, ())) for step_owners in owners]
        k = 0
        for count, run in itertools.groupby(counts):
            length = len(list(run))
            if count > 1:
                ax.text(
                    k + length / 2 - 0.5,
                    b,
                    f"×{count}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    fontweight="bold",
                    clip_on=True,
                )
            k += length
    longest: dict[str, tuple[int, int, int]] = {}  # request -> (length, block, first step)
    for b in range(n):
        holder = [
            (lambda who: who[0] if len(who) == 1 else None)(step_owners.get(b) or [None])
            for step_owners in owners
        ]
        k = 0
        for rid, run in itertools.groupby(holder):
            length = len(list(run))
            if rid is not None and length > longest.get(rid, (0,))[0]:
                longest[rid] = (length, b, k)
            k += length
    ax.imshow(
        image,
        aspect="auto",
        interpolation="nearest",
        origin="lower",
        extent=(-0.5, len(steps) - 0.5, -0.5, n - 0.5),
    )
    step_pt = fig.get_figwidth() * 0.8 * 72 / max(len(steps), 1)
    for rid, (length, b, k) in longest.items():
        label = fitting_label(rid, length * step_pt, lambda text: _label_width_pt(text, 7)) or short_label(
            rid
        )
        ax.text(
            k + length / 2 - 0.5,
            b,
            label,
            ha="center",
            va="center",
            fontsize=7,
            clip_on=True,
            bbox={"facecolor": "white", "alpha": 0.75, "pad": 0.4, "lw": 0},
        )
    for k, step in enumerate(steps):
        if step.preempted:
            ax.axvline(k, color="#d62728", lw=1, ls="--")
    touched = [b for s, o in zip(steps, owners) for b in [*o, *s.cached_blocks]]
    ax.set_ylim(-0.5, max(touched, default=0) + 1.5)  # a big pool's never-used top stays off
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV block")
    ax.set_title(
        "who holds each KV block (labels: request ids)\n"
        "red dashes: a preemption · dark, ×N: shared by N requests · grey: cached",
        fontsize=10,
    )
    return fig


class BlockView(SlotView):
    """``SlotView`` with the KV pool under the slots: per step, which request holds which
    block, shared blocks marked, cached ones dashed. Saved notebooks carry a PNG of the
    block map (``plot_block_map``) for viewers without a kernel."""

    def __init__(
        self, source, live: bool = False, window: int = 40, interval_ms: int = 250, columns: int = 16
    ):
        self.columns = columns
        super().__init__(source, live=live, window=window, interval_ms=interval_ms)
        self.add_class("batchlab-blockview")

    def _below(self, k: int) -> str:
        if not self.trace.steps:
            return ""
        return block_frame_html(self.trace, k, self.columns, request_colors(self.trace, self.palette))

    def _repr_mimebundle_(self, **kwargs):
        bundle = widgets.VBox._repr_mimebundle_(self, **kwargs)  # not SlotView's slot-grid PNG
        if self.trace.steps:
            bundle["image/png"] = png_base64(plot_block_map(self.trace, palette=self.palette))
        return bundle

    def __repr__(self) -> str:
        return (
            f"BlockView({self.trace.kind} trace, {block_count(self.trace)} KV blocks, "
            f"{len(self.trace.steps)} steps)"
        )
