"""The slot grid as an animated PNG (APNG): plays without a kernel or widget JavaScript
(GitHub, nbviewer, slides, any browser), where the widget shows only its still picture."""

from __future__ import annotations

import io

import numpy as np
from IPython.display import Image as DisplayImage
from PIL import Image, ImageDraw, ImageFont

from .colors import PADDING_COLOR, PADDING_EDGE, Palette, fitting_label, lighten, text_color
from .grid import (DECODE, HELD, IDLE, PADDING, PREFILL, PREFILL_DECODE, Cell, lane_names,
                   occupancy_so_far, request_colors, slot_grid, trace_of)

ROW, LANE = 16, 14  # pixels per lane (lane height plus a gap)
GRID_WIDTH = 720  # pixels the steps share (at most 14 a step)
IDLE_COLOR, PLAYHEAD = "#eeeeee", "#111111"  # steps not reached yet stay white


def _draw_cell(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], cell: Cell, color: str) -> None:
    x0, y0, x1, y1 = box
    if cell.kind == DECODE:
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


def animation(source, max_frames: int = 200, interval_ms: int = 120, hold_last_ms: int = 2000,
              palette: Palette | None = None) -> DisplayImage:
    """The slot grid filling in step by step, as an animated PNG in a display object (its
    ``.data`` holds the file's bytes). A run longer than ``max_frames`` steps advances
    several steps a frame; for thousands of steps, animate a window (``busiest_window``).
    The colours, lanes and cells are those of ``plot_slot_grid`` and ``SlotView``; each
    request's run is labelled with its id (or its number) once it is wide enough."""
    trace = trace_of(source)
    steps = list(trace.steps)
    if not steps:
        raise ValueError("the trace has no steps yet: nothing to animate")
    grid, lanes = slot_grid(trace), lane_names(trace)
    colors = request_colors(trace, palette)
    font = ImageFont.load_default(size=11)
    cell_w = max(1, min(14, GRID_WIDTH // len(steps)))
    left = int(max(font.getlength(name) for name in lanes)) + 10
    top = 40
    width = left + cell_w * len(steps) + 12
    height = top + ROW * len(lanes) + 26
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.fontmode = "1"  # no anti-aliasing: the frames keep few colours, exactly
    occupancy = occupancy_so_far(trace, len(steps) - 1).fraction
    draw.text((4, 2), f"{trace.kind}: {trace.max_batch_size} slots, steps {steps[0].index}-{steps[-1].index}, "
              f"occupancy {occupancy:.0%}", fill="#222", font=font)
    for li, name in enumerate(lanes):
        draw.text((4, top + li * ROW), name, fill="#555", font=font)
    _draw_legend(draw, font, 4, top + ROW * len(lanes) + 6)

    run_start = [0] * len(lanes)  # the step where each lane's current run began
    labelled = [False] * len(lanes)
    frames = []
    shown = np.unique(np.linspace(0, len(steps) - 1, min(max_frames, len(steps))).round().astype(int))
    drawn = 0
    for k in shown:
        for c in range(drawn, k + 1):
            for li, cell in enumerate(grid[c]):
                before = grid[c - 1][li] if c else None
                if before is None or (before.kind, before.request) != (cell.kind, cell.request) \
                        or cell.kind == PREFILL_DECODE:
                    run_start[li], labelled[li] = c, False
                x0, y0 = left + c * cell_w, top + li * ROW
                color = colors.get(cell.request, "#000000")
                _draw_cell(draw, (x0, y0, x0 + cell_w - 1, y0 + LANE - 1), cell, color)
                if not labelled[li] and cell.request and cell.kind not in (PADDING, IDLE):
                    label = fitting_label(cell.request, (c + 1 - run_start[li]) * cell_w - 2,
                                          lambda text: font.getlength(text))
                    if label:
                        draw.text((left + run_start[li] * cell_w + 2, y0), label, font=font,
                                  fill=text_color(color) if cell.kind == DECODE else "#111")
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
        frame_draw.text((min(x - font.getlength(number) / 2, width - font.getlength(number)), 22), number,
                        fill="#111", font=font)
        frames.append(frame)
    frames = _indexed(frames)
    buffer = io.BytesIO()
    durations = [interval_ms] * (len(frames) - 1) + [hold_last_ms]
    frames[0].save(buffer, format="PNG", save_all=True, append_images=frames[1:], duration=durations,
                   loop=0, optimize=True)
    return DisplayImage(data=buffer.getvalue(), format="png")


def _indexed(frames: list[Image.Image]) -> list[Image.Image]:
    """The frames in one 256-colour palette: exact when the run has few enough colours
    (the last frame holds them all), else the nearest of 256 picked from it."""
    colors = frames[-1].getcolors(maxcolors=256)
    if colors is None:
        palette = frames[-1].quantize(colors=256, dither=Image.Dither.NONE)
    else:
        palette = Image.new("P", (1, 1))
        palette.putpalette([channel for _, color in colors for channel in color])
    return [frame.quantize(palette=palette, dither=Image.Dither.NONE) for frame in frames]


def _draw_legend(draw: ImageDraw.ImageDraw, font, x: int, y: int) -> None:
    sample = "#4e79a7"
    for kind, name in [(DECODE, "decode"), (PREFILL, "prefill"), (PADDING, "padding (wasted)"),
                       (HELD, "holds slot, no work"), (IDLE, "idle"), ("playhead", "current step")]:
        if kind == "playhead":
            draw.rectangle((x + 5, y, x + 6, y + LANE - 1), fill=PLAYHEAD)
        else:
            _draw_cell(draw, (x, y, x + 11, y + LANE - 1), Cell(kind, "r"), sample)
        x += 16
        draw.text((x, y), name, fill="#333", font=font)
        x += int(font.getlength(name)) + 12
