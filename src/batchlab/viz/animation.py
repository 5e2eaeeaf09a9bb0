"""The slot grid as an animated PNG (APNG): plays without a kernel or widget JavaScript
(GitHub, nbviewer, slides, any browser), where the widget shows only its still picture."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
from IPython.display import Image as DisplayImage
from PIL import Image, ImageDraw, ImageFont

from ..core.trace import Trace
from .colors import PADDING_COLOR, PADDING_EDGE, Palette, fitting_label, lighten, text_color
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
    has_drafts,
    lane_names,
    occupancy_so_far,
    request_colors,
    slot_grid,
    trace_of,
)

ROW, LANE = 16, 14  # pixels per lane (lane height plus a gap)
GRID_WIDTH = 720  # pixels the steps share (at most 14 a step)
IDLE_COLOR, PLAYHEAD = "#eeeeee", "#111111"  # steps not reached yet stay white


def _draw_cell(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], cell: Cell, color: str) -> None:
    x0, y0, x1, y1 = box
    if cell.kind == DECODE and cell.verify:
        _draw_bands(draw, box, cell.bands, color)
    elif cell.kind == DECODE:
        draw.rectangle(box, fill=color)
    elif cell.kind == PREFILL:
        draw.rectangle(box, fill=lighten(color))
        draw.rectangle((x0, y1 - 2, x1, y1), fill=color)  # a bar along the bottom: prompt work
    elif cell.kind == PREFILL_DECODE:
        draw.rectangle((x0, y0, x1, (y0 + y1) // 2), fill=lighten(color))
        draw.rectangle((x0, (y0 + y1) // 2 + 1, x1, y1), fill=color)
    elif cell.kind == PADDING:
        draw.rectangle(box, fill=PADDING_COLOR)
        draw.line((x0, (y0 + y1) // 2, x1, (y0 + y1) // 2), fill=PADDING_EDGE)
    elif cell.kind == HELD:  # a hollow bar in the request's colour
        draw.rectangle(box, fill="white")
        draw.rectangle((x0, y0, x1, y0 + 1), fill=color)
        draw.rectangle((x0, y1 - 1, x1, y1), fill=color)
    else:
        draw.rectangle(box, fill=IDLE_COLOR)


def _draw_bands(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], bands, color: str) -> None:
    """A verify row: a band a token position it ran, bottom up, in the request's colour
    where the position became a token, grey for a rejected draft; a white line between two
    bands where they are at least 2 pixels high."""
    x0, y0, x1, y1 = box
    height = y1 - y0 + 1
    edges = [y1 + 1 - round(i * height / len(bands)) for i in range(len(bands) + 1)]
    for kept, below, top in zip(bands, edges, edges[1:]):
        if below - 1 >= top:
            draw.rectangle((x0, top, x1, below - 1), fill=color if kept else PADDING_COLOR)
        if top > y0 and height >= 2 * len(bands):
            draw.line((x0, top, x1, top), fill="white")


def animation(
    source,
    max_frames: int = 200,
    interval_ms: int = 120,
    hold_last_ms: int = 2000,
    palette: Palette | None = None,
) -> DisplayImage:
    """The slot grid filling in step by step, as an animated PNG in a display object (its
    ``.data`` holds the file's bytes). A run longer than ``max_frames`` steps advances
    several steps a frame; a run longer than 720 steps is too long to read at one pixel a
    step: animate a window of it (``busiest_window``). The colours, lanes and cells are
    those of ``plot_slot_grid`` and ``SlotView`` (a verify row in bands, its rejected
    drafts grey); each request's run is labelled with its id (or its number) once it is
    wide enough."""
    trace = trace_of(source)
    steps = list(trace.steps)
    if not steps:
        raise ValueError("the trace has no steps yet: nothing to animate")
    if len(steps) > GRID_WIDTH:
        raise ValueError(
            f"{len(steps)} steps are too many to animate readably (at most {GRID_WIDTH}); "
            f"animate a window, e.g. viz.animation(viz.busiest_window(trace, 200))"
        )
    shown = np.unique(np.linspace(0, len(steps) - 1, min(max_frames, len(steps))).round().astype(int))
    colors = request_colors(trace, palette)
    *_, last = _frames(trace, shown, colors)
    last_colors = _palette_image(last)
    # indexed as they are drawn, so the frames held for the writer (a list: it reads them
    # twice) take a byte a pixel, not three
    indexed = [
        frame.quantize(palette=last_colors, dither=Image.Dither.NONE)
        for frame in _frames(trace, shown, colors)
    ]
    buffer = io.BytesIO()
    indexed[0].save(
        buffer,
        format="PNG",
        save_all=True,
        append_images=indexed[1:],
        loop=0,
        optimize=True,
        duration=[interval_ms] * (len(shown) - 1) + [hold_last_ms],
    )
    return DisplayImage(data=buffer.getvalue(), format="png")


def _frames(trace: Trace, shown: np.ndarray, colors: dict[str, str]) -> Iterator[Image.Image]:
    """The RGB frame after each step position in ``shown``."""
    steps = list(trace.steps)
    grid, lanes = slot_grid(trace), lane_names(trace)
    font = ImageFont.load_default(size=11)
    cell_w = min(14, GRID_WIDTH // len(steps))
    left, top = int(max(font.getlength(name) for name in lanes)) + 10, 40
    verify = has_drafts(trace)  # a second legend line explains verify rows
    width, height = left + cell_w * len(steps) + 12, top + ROW * len(lanes) + 26 + ROW * verify
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.fontmode = "1"  # no anti-aliasing: the frames keep few colours, exactly
    occupancy = occupancy_so_far(trace, len(steps) - 1).fraction
    draw.text(
        (4, 2),
        f"{trace.kind}: {trace.max_batch_size} slots, steps {steps[0].index}-{steps[-1].index}, "
        f"occupancy {occupancy:.0%} · labels: request ids",
        fill="#222",
        font=font,
    )
    for li, name in enumerate(lanes):
        draw.text((4, top + li * ROW), name, fill="#555", font=font)
    _draw_legend(draw, font, 4, top + ROW * len(lanes) + 6, verify)

    run_start = [0] * len(lanes)  # the step where each lane's current run began
    labelled = [False] * len(lanes)
    drawn = 0
    for k in shown:
        for c in range(drawn, k + 1):
            for li, cell in enumerate(grid[c]):
                before = grid[c - 1][li] if c else None
                if (
                    before is None
                    or (before.kind, before.request) != (cell.kind, cell.request)
                    or cell.kind == PREFILL_DECODE
                ):
                    run_start[li], labelled[li] = c, False
                x0, y0 = left + c * cell_w, top + li * ROW
                color = colors.get(cell.request, "#000000")
                _draw_cell(draw, (x0, y0, x0 + cell_w - 1, y0 + LANE - 1), cell, color)
                if not labelled[li] and cell.request and cell.kind not in (PADDING, IDLE):
                    label = fitting_label(cell.request, (c + 1 - run_start[li]) * cell_w - 2, font.getlength)
                    # on a verify row's grey and colour bands, dark text as on prefill
                    banded = any(grid[j][li].verify for j in range(run_start[li], c + 1))
                    if label:
                        draw.text(
                            (left + run_start[li] * cell_w + 2, y0),
                            label,
                            font=font,
                            fill=text_color(color) if cell.kind == DECODE and not banded else "#111",
                        )
                        labelled[li] = True
        drawn = k + 1
        # only the new columns, the line and its step number change from frame to frame, and
        # the APNG stores each frame as its change from the last: keep the changes together
        frame = canvas.copy()
        frame_draw = ImageDraw.Draw(frame)
        frame_draw.fontmode = "1"
        x = left + (k + 1) * cell_w
        frame_draw.rectangle((x, top - 3, x + 1, top + ROW * len(lanes)), fill=PLAYHEAD)
        number = str(steps[k].index)
        frame_draw.text(
            (min(x - font.getlength(number) / 2, width - font.getlength(number)), 22),
            number,
            fill="#111",
            font=font,
        )
        yield frame


def _palette_image(last: Image.Image) -> Image.Image:
    """A palette for every frame, from the last one, which holds every colour of the run:
    exact when there are at most 256, else 256 picked from them."""
    colors = last.getcolors(maxcolors=256)
    if colors is None:
        return last.quantize(colors=256, dither=Image.Dither.NONE)
    palette = Image.new("P", (1, 1))
    palette.putpalette([channel for _, color in colors for channel in color])
    return palette


def _draw_legend(draw: ImageDraw.ImageDraw, font, x: int, y: int, verify: bool = False) -> None:
    sample = "#4e79a7"
    for kind, name in [
        (DECODE, "decode"),
        (PREFILL, "prefill"),
        (PADDING, "padding (wasted)"),
        (HELD, "holds slot, no work"),
        (IDLE, "idle"),
        ("playhead", "current step"),
    ]:
        if kind == "playhead":
            draw.rectangle((x + 5, y, x + 6, y + LANE - 1), fill=PLAYHEAD)
        else:
            _draw_cell(draw, (x, y, x + 11, y + LANE - 1), Cell(kind, "r"), sample)
        x += 16
        draw.text((x, y), name, fill="#333", font=font)
        x += int(font.getlength(name)) + 12
    if verify:
        x, y = 4, y + ROW
        _draw_cell(draw, (x, y, x + 11, y + LANE - 1), VERIFY_SAMPLE, sample)
        draw.text((x + 16, y), VERIFY_LEGEND, fill="#333", font=font)
