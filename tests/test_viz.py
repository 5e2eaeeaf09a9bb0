"""batchlab.viz: the slot grid as data, the HTML frame, the widget and the figures.

Most tests use traces built by hand, whose right answers are written out below; the
recorded traces in tests/data and one live run on the real model check the same
invariants on real engine output.
"""

from __future__ import annotations

import ast
import base64
import colorsys
import io
import itertools
import json
import threading
import time
from collections import deque
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from matplotlib import cbook

import batchlab
from batchlab import viz
from batchlab.core.fake import FakeModel, FakeRunner, TickClock
from batchlab.core.trace import RequestRecord, StepRecord, Trace
from batchlab.viz import Cell

DATA = Path(__file__).parent / "data"
RECORDED = ["static", "continuous", "stallfree"]


def step(
    index, slots, decoded=(), prefill=(), padding=(), finished=None, start=None, emitted=None, slot_of=None
):
    start = float(index) if start is None else start
    return StepRecord(
        index,
        start,
        start + 1.0,
        slots=list(slots),
        slot_of=dict(slot_of or {}),
        decoded=list(decoded),
        prefill=list(prefill),
        padding=list(padding),
        finished=dict(finished or {}),
        emitted=dict(emitted or {}),
        passes=1,
    )


def continuous_trace() -> Trace:
    """Two slots. a prefills in two chunks (steps 0-1) and decodes in slot 0 until step 3,
    where it finishes and leaves the table; b prefills and decodes from step 2; c prefills
    in step 3, waits for a slot, then is placed and finishes within step 4 (so it appears in
    no slot table)."""
    steps = [
        step(0, [None, None], prefill=[("a", 0, 3)]),
        step(1, ["a", None], decoded=["a"], prefill=[("a", 3, 2)], slot_of={"a": 0}),
        step(2, ["a", "b"], decoded=["a", "b"], prefill=[("b", 0, 4)], slot_of={"a": 0, "b": 1}),
        step(
            3,
            [None, "b"],
            decoded=["a", "b"],
            prefill=[("c", 0, 2)],
            finished={"a": "length"},
            slot_of={"a": 0, "b": 1},
        ),
        step(
            4,
            [None, None],
            decoded=["c", "b"],
            finished={"c": "stop", "b": "length"},
            slot_of={"c": 0, "b": 1},
        ),
    ]
    requests = {
        "a": RequestRecord(
            "a",
            5,
            4,
            0.0,
            [
                (0.0, "queued"),
                (0.0, "prefilling"),
                (1.5, "awaiting_slot"),
                (1.5, "decoding"),
                (4.0, "finished"),
            ],
            first_token_s=2.0,
            token_times_s=[2.0, 2.5, 3.0, 4.0],
            finished_s=4.0,
            finish_reason="length",
        ),
        "b": RequestRecord(
            "b",
            4,
            4,
            0.5,
            [(0.5, "queued"), (2.0, "prefilling"), (2.5, "decoding"), (5.0, "finished")],
            first_token_s=2.6,
            token_times_s=[2.6, 3.0, 4.0, 5.0],
            finished_s=5.0,
            finish_reason="length",
        ),
        "c": RequestRecord(
            "c",
            2,
            4,
            1.0,
            [
                (1.0, "queued"),
                (3.0, "prefilling"),
                (3.5, "awaiting_slot"),
                (4.2, "decoding"),
                (5.0, "finished"),
            ],
            first_token_s=4.0,
            token_times_s=[4.0, 5.0],
            finished_s=5.0,
            finish_reason="stop",
        ),
    }
    return Trace("continuous", 2, steps, requests, prefill_lane=True)


def static_trace() -> Trace:
    """Three slots, two requests: x and y prefill and decode together in step 0; y finishes
    in step 1 and is padding in step 2, when x finishes and the batch frees every slot."""
    steps = [
        step(
            0,
            ["x", "y", None],
            decoded=["x", "y"],
            prefill=[("x", 0, 5), ("y", 0, 3)],
            slot_of={"x": 0, "y": 1},
        ),
        step(1, ["x", "y", None], decoded=["x", "y"], finished={"y": "stop"}, slot_of={"x": 0, "y": 1}),
        step(
            2,
            [None, None, None],
            decoded=["x"],
            padding=["y"],
            finished={"x": "length"},
            slot_of={"x": 0, "y": 1},
        ),
    ]
    return Trace("static", 3, steps)


def stallfree_trace() -> Trace:
    """Two slots held from admission: p prefills in step 0; in step 1 q prefills while p,
    out of budget, holds its slot and runs nothing; in step 2 p decodes."""
    steps = [
        step(0, ["p", None], prefill=[("p", 0, 4)], slot_of={"p": 0}),
        step(1, ["p", "q"], prefill=[("q", 0, 4)], slot_of={"q": 1}),
        step(2, ["p", "q"], decoded=["p"], prefill=[("q", 4, 1)], slot_of={"p": 0, "q": 1}),
    ]
    return Trace("stallfree", 2, steps)


def recorded(kind: str) -> Trace:
    trace = Trace.from_json((DATA / f"{kind}_trace.json").read_text())
    if kind == "continuous":  # recorded before traces said whether their kind has a prefill lane
        trace.prefill_lane = True
    return trace


class Elements(HTMLParser):
    """Every element's tag and attributes, in document order."""

    def __init__(self, text: str):
        super().__init__()
        self.found: list[tuple[str, dict]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))

    def having(self, **wanted) -> list[dict]:
        wanted = {k.rstrip("_").replace("_", "-"): v for k, v in wanted.items()}  # class_ -> class
        return [a for _, a in self.found if all(a.get(k) == v for k, v in wanted.items())]


# -- the grid as data ------------------------------------------------------------------------
D, I = "decode", "idle"  # noqa: E741  (I for idle: the grids below read as pictures)


def kinds(cells):
    return [(c.kind, c.request) for c in cells]


def test_continuous_cells_put_prefill_in_its_own_lane_and_find_leaving_requests():
    trace = continuous_trace()
    assert viz.lane_names(trace) == ["slot 0", "slot 1", "prefill"]
    grid = viz.slot_grid(trace)
    assert kinds(grid[0]) == [(I, None), (I, None), ("prefill", "a")]
    assert grid[0][2].prefill_tokens == 3
    assert kinds(grid[1]) == [(D, "a"), (I, None), ("prefill", "a")]
    assert kinds(grid[2]) == [(D, "a"), (D, "b"), ("prefill", "b")]
    # a finished in step 3: gone from the table after the step, found in the one before
    assert kinds(grid[3]) == [(D, "a"), (D, "b"), ("prefill", "c")]
    # c got a slot and finished within step 4: slot_of says which
    assert kinds(grid[4]) == [(D, "c"), (D, "b"), (I, None)]
    assert viz.step_cells(trace, 4) == grid[4]
    assert len(viz.slot_grid(trace, upto=2)) == 3


def test_static_cells_show_prompt_plus_first_decode_then_padding():
    grid = viz.slot_grid(static_trace())
    assert viz.lane_names(static_trace()) == ["slot 0", "slot 1", "slot 2"]
    assert grid[0] == [Cell("prefill_decode", "x", 5), Cell("prefill_decode", "y", 3), Cell(I)]
    assert kinds(grid[1]) == [(D, "x"), (D, "y"), (I, None)]
    assert kinds(grid[2]) == [(D, "x"), ("padding", "y"), (I, None)]


def test_stallfree_prefill_sits_in_its_slot_and_an_idle_holder_is_held():
    grid = viz.slot_grid(stallfree_trace())
    assert len(grid[0]) == 2  # no prefill lane: prefilling requests hold a slot
    assert grid[0] == [Cell("prefill", "p", 4), Cell(I)]
    assert grid[1] == [Cell("held", "p"), Cell("prefill", "q", 4)]
    assert grid[2] == [Cell(D, "p"), Cell("prefill", "q", 1)]


def test_occupancy_so_far_counts_decode_rows_over_slot_steps():
    trace = continuous_trace()
    expected = [(0, 2), (1, 4), (3, 6), (5, 8), (7, 10)]
    occupancies = [viz.occupancy_so_far(trace, k) for k in range(5)]
    assert [(o.decode_rows, o.slot_steps) for o in occupancies] == expected
    assert viz.occupancy_so_far(trace, 3).fraction == pytest.approx(5 / 8)
    assert viz.occupancy_so_far(static_trace(), 2).fraction == pytest.approx(5 / 9)


@pytest.mark.parametrize("kind", RECORDED)
def test_recorded_runs_every_token_and_prompt_token_lands_in_the_grid(kind):
    """On real engine output: each request's decode cells are its tokens after the first
    (which prefill makes), and its prefill cells add up to its prompt."""
    trace = recorded(kind)
    cells = [c for column in viz.slot_grid(trace) for c in column]
    for rid, record in trace.requests.items():
        decodes = sum(1 for c in cells if c.request == rid and c.kind in ("decode", "prefill_decode"))
        assert decodes == len(record.token_times_s) - 1, rid
        assert sum(c.prefill_tokens for c in cells if c.request == rid) == record.prompt_len, rid
    decode_rows = sum(1 for c in cells if c.kind in ("decode", "prefill_decode"))
    assert viz.occupancy_so_far(trace, len(trace.steps) - 1).decode_rows == decode_rows


def lab(hex_color: str) -> np.ndarray:
    """CIE L*a*b* (D65) of an sRGB colour, to measure how different two colours look."""
    srgb = np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    linear = np.where(srgb <= 0.04045, srgb / 12.92, ((srgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ linear
    f = np.cbrt(xyz / [0.95047, 1.0, 1.08883])
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two sRGB colours."""

    def luminance(c):
        channels = [int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        r, g, b_ = [x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4 for x in channels]
        return 0.2126 * r + 0.7152 * g + 0.0722 * b_

    hi, lo = sorted([luminance(a), luminance(b)], reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_colors_within_a_figure_are_distinct_and_text_on_them_readable():
    ids = [f"req-{i}" for i in range(32)]
    colors = viz.request_colors(Trace("static", 1, [], {r: RequestRecord(r, 1, 1, 0.0) for r in ids}))
    assert list(colors) == ids
    assert len(set(colors.values())) == 32
    # no two of 32 look alike (CIE76 distance; about 2 is just noticeable, 10 clearly different)
    worst = min(np.linalg.norm(lab(a) - lab(b)) for a, b in itertools.combinations(colors.values(), 2))
    assert worst > 10
    # the first 16 hues are evenly spaced around the wheel
    hues = sorted(
        colorsys.rgb_to_hls(*(int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)))[0]
        for c in list(colors.values())[:16]
    )
    assert np.diff(hues + [hues[0] + 1]) == pytest.approx([1 / 16] * 16, abs=0.01)
    assert all(contrast(c, viz.text_color(c)) >= 4.5 for c in colors.values())
    assert viz.request_color("req-3") == colors["req-3"]  # the same as in a run of req-0, req-1, ...
    assert viz.request_color("mix-003") == colors["req-3"]
    assert list(viz.request_colors(static_trace())) == ["x", "y"]  # named only in steps: still coloured


def test_a_palette_keeps_colors_as_requests_come_and_go():
    trace = continuous_trace()
    palette = viz.Palette()
    colors = viz.request_colors(trace, palette)
    trace.requests["d"] = RequestRecord("d", 3, 2, 6.0)
    del trace.requests["a"]  # a bounded trace forgets finished requests
    changed = viz.request_colors(trace, palette)
    assert {r: changed[r] for r in "abc"} == colors
    assert changed["d"] not in colors.values()


def test_short_labels_and_request_state_queries():
    assert viz.short_label("req-12") == "12"
    assert viz.short_label("alpha") == "alp"
    c = continuous_trace().requests["c"]
    assert viz.state_at(c, 0.5) is None
    assert viz.state_at(c, 3.6) == "awaiting_slot"
    assert viz.state_at(c, 9.0) == "finished"
    assert viz.state_intervals(c, 9.0) == [
        ("queued", 1.0, 3.0),
        ("prefilling", 3.0, 3.5),
        ("awaiting_slot", 3.5, 4.2),
        ("decoding", 4.2, 5.0),
    ]
    unfinished = RequestRecord("u", 1, 1, 0.0, [(0.0, "queued"), (1.0, "decoding")])
    assert viz.state_intervals(unfinished, 7.0)[-1] == ("decoding", 1.0, 7.0)
    assert viz.token_gaps(c) == [(5.0, 1.0)]
    assert viz.ttfts(continuous_trace()) == pytest.approx([2.0, 2.1, 3.0])
    assert viz.time_origin(continuous_trace()) == 0.0


def test_trace_of_accepts_a_trace_an_engine_or_a_loop():
    trace = static_trace()

    class Engine:
        pass

    class Loop:
        pass

    engine, loop = Engine(), Loop()
    engine.trace, loop.engine = trace, engine
    assert viz.trace_of(trace) is trace
    assert viz.trace_of(engine) is trace
    assert viz.trace_of(loop) is trace
    with pytest.raises(TypeError, match="Trace"):
        viz.trace_of("not a trace")


# -- one frame as HTML -----------------------------------------------------------------------
def test_frame_html_marks_slots_cells_and_the_readout():
    trace = continuous_trace()
    page = Elements(viz.frame_html(trace, 3))
    root = page.having(data_num_slots="2")
    assert len(root) == 1 and root[0]["data-step"] == "3" and root[0]["data-num-steps"] == "5"
    assert [a["data-slot"] for a in page.having() if "data-slot" in a] == ["0", "1"]
    assert len([a for a in page.having() if "data-prefill-lane" in a]) == 1
    current = page.having(data_step="3", data_lane="0")
    assert current[0]["data-kind"] == "decode" and current[0]["data-request"] == "a"
    assert viz.request_colors(trace)["a"] in current[0]["style"]
    assert page.having(data_step="3", data_lane="2")[0]["data-kind"] == "prefill"
    assert len([a for a in page.having() if "bl-future" in a.get("class", "")]) == 3  # step 4, 3 lanes
    assert page.having(class_="bl-counter")[0]["data-step"] == "3"
    occupancy = page.having(class_="bl-occupancy")[0]
    assert (occupancy["data-decode-rows"], occupancy["data-slot-steps"]) == ("5", "8")


def test_frame_html_shows_padding_and_a_window_of_recent_steps():
    page = Elements(viz.frame_html(static_trace(), 2))
    assert page.having(data_step="2", data_lane="1")[0]["data-kind"] == "padding"
    long = Trace("static", 1, [step(k, ["r"], decoded=["r"]) for k in range(30)])
    steps_shown = {
        a["data-step"] for a in Elements(viz.frame_html(long, 29, window=10)).having() if "data-lane" in a
    }
    assert steps_shown == {str(k) for k in range(20, 30)}


def test_a_bounded_trace_keeps_its_recent_steps_and_shows_their_numbers():
    """An engine with ``trace_limit`` keeps its steps in a deque that drops the oldest."""
    full = continuous_trace()
    bounded = Trace("continuous", 2, deque(full.steps, maxlen=3), full.requests, prefill_lane=True)
    assert viz.slot_grid(bounded) == viz.slot_grid(full)[2:]
    assert viz.occupancy_so_far(bounded, 2) == viz.Occupancy(6, 6)
    page = Elements(viz.frame_html(bounded, 2))
    assert page.having(class_="bl-counter")[0]["data-step"] == "2"
    assert "step 4</b>" in viz.frame_html(bounded, 2)
    assert viz.plot_timeline(bounded).axes[0].patches


def test_frame_html_of_an_empty_trace_still_shows_the_slots():
    page = Elements(viz.frame_html(Trace("continuous", 4), 0))
    assert len([a for a in page.having() if "data-slot" in a]) == 4
    assert page.having(class_="bl-counter")[0]["data-step"] == "-1"
    assert not [a for a in page.having() if "data-lane" in a]


# -- the widget ------------------------------------------------------------------------------
def shown_step(view: viz.SlotView) -> str:
    """The step the view shows: a live view's frame, or a replay's selected state."""
    if view.live:
        frame = Elements(view._frame.value)
        return frame.having(data_num_slots=str(view.trace.max_batch_size))[0]["data-step"]
    assert view.children[1:] == (view._states, view._grid)
    state = view._states.children[view._states.selected_index].value
    return Elements(state).having(class_="bl-root bl-state")[0]["data-step"]


def replay_frame(grid: str, state: str) -> list[tuple]:
    """What a replay shows at one step: the cells of the columns its style shows, as
    (lane, step, kind, request, label shown); blank cells (after the step) as kind "future"."""
    import re

    rules = state.split("<style>")[1].split("</style>")[0]
    shown = {
        int(c) for c in re.search(r":is\(([^)]*)\)\{display:block\}", rules)[1].replace(".s", "").split(",")
    }
    blank = set()
    for m in re.finditer(r":is\(([^)]*)\)\.bl-cell\{background:#fafafa", rules):
        blank |= {int(c) for c in m[1].replace(".s", "").split(",")}
    left = int(re.search(r"\.bl-cell\.s(\d+) \.bl-more\{display:inline\}", rules)[1])
    cells = []
    for m in re.finditer(
        r'<div class="bl-cell ([^"]*)" data-lane="(\d+)" data-step="(\d+)" '
        r'data-kind="([^"]*)"(?: data-request="([^"]*)")?[^>]*>(.*?)</div>',
        grid,
    ):
        step = int(m[3])
        if step not in shown:
            continue
        if step in blank:
            cells.append((int(m[2]), step, "future", None, False))
            continue
        label = bool(m[6]) and ("bl-more" not in m[6] or step == left)
        cells.append((int(m[2]), step, m[4], m[5], label))
    return sorted(cells)


def frame_cells(frame: str) -> list[tuple]:
    """The same, read from ``frame_html``'s frame."""
    import re

    cells = []
    for lane, row in enumerate(frame.split('class="bl-lane" ')[1:]):
        row = row.split('<div class="bl-legend"')[0]
        for m in re.finditer(
            r'<div class="bl-cell ([^"]*)"(?: data-lane="\d+" data-step="(\d+)" '
            r'data-kind="([^"]*)"(?: data-request="([^"]*)")?[^>]*)?>(.*?)</div>',
            row,
        ):
            if "bl-future" in m[1]:
                cells.append((lane, None, "future", None, False))
            else:
                cells.append((lane, int(m[2]), m[3], m[4], bool(m[5])))
    return cells


@pytest.mark.parametrize("name", RECORDED)
def test_the_replays_frames_show_what_frame_html_draws(name):
    """The replay (``player_html``: the grid once, a style a step) and ``frame_html`` are one
    picture: at every step the same cells, kinds, requests and labels in the same columns."""
    trace = Trace.from_json((DATA / f"{name}_trace.json").read_text())
    for window in (40, 7):
        grid, states = viz.player_html(trace, window)
        assert len(states) == len(trace.steps)
        width = min(window, len(trace.steps))  # the grid's columns: one window's worth
        assert f'grid-template-columns:5.5em{" 18px" * width}"' in grid
        for k, state in enumerate(states):
            got, frame = replay_frame(grid, state), frame_cells(viz.frame_html(trace, k, window))
            future_steps = {s for _, s, kind, _, _ in got if kind == "future"}
            # frame_html's blank cells carry no step: give them the replay's, in column order
            columns = sorted({s for _, s, _, _, _ in got})
            lanes = len(frame) // len(columns)
            want = sorted(
                (lane, columns[i % len(columns)] if s is None else s, kind, request, label)
                for i, (lane, s, kind, request, label) in enumerate(frame)
            )
            assert got == want, (name, window, k)
            assert future_steps == {c for c in columns if c > k} and lanes >= trace.max_batch_size
            assert f'data-step="{k}"' in state and f'data-step="{k}"' in state.split("bl-counter")[1]


def test_the_replay_plays_in_the_browser_alone():
    """Play drives the slider and the slider the shown state, both linked in the browser
    (``jslink``), so a replay plays while the kernel is busy; Python follows too."""
    view = viz.SlotView(continuous_trace())
    links = {(tuple(link.source), tuple(link.target)) for link in view._links}
    assert ((view._play, "value"), (view._slider, "value")) in links
    assert ((view._slider, "value"), (view._states, "selected_index")) in links
    assert len(view._states.children) == 5 and view._grid.value.count('data-step="4"') == 3


def test_slot_view_replays_a_trace_step_by_step():
    view = viz.SlotView(continuous_trace())
    assert (view._slider.max, view._play.max, view.step) == (4, 4, 0)
    assert shown_step(view) == "0"
    view.show_step(3)
    assert shown_step(view) == "3"
    view.show_step(99)
    assert view.step == 4
    assert view.to_html(1) == viz.frame_html(view.trace, 1)
    assert "batchlab-play" in view._play._dom_classes
    assert repr(view) == "SlotView(continuous trace, 2 slots, 5 steps)"


def test_slot_view_live_follows_a_growing_trace():
    full = continuous_trace()
    trace = Trace("continuous", 2, [], full.requests, prefill_lane=True)
    view = viz.SlotView(trace, live=True)
    assert shown_step(view) == "-1"
    replay = viz.SlotView(trace)
    for k, record in enumerate(full.steps):
        trace.steps.append(record)
        view.refresh()
        replay.refresh()
        assert (view.step, shown_step(view)) == (k, str(k))
    assert (replay.step, replay._slider.max) == (0, 4)  # a replay keeps its place


def _returns_within(call, seconds: float) -> bool:
    """Run ``call`` in a thread; True if it returned before the deadline (a hang fails
    the test instead of stalling it)."""
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_follow_returns_when_the_run_is_over_and_quiet_or_time_is_up():
    """Events, not elapsed seconds: ``follow`` on a finished run returns (its own limit,
    60 s, is far beyond the deadline here); an unfinished run returns at its ``seconds``;
    ``until`` stops it at once."""
    view = viz.SlotView(continuous_trace())
    assert _returns_within(lambda: view.follow(seconds=60, interval=0.05, grace=0.3), 30)
    assert view.live and view.step == 4
    unfinished = continuous_trace()
    unfinished.requests["c"].finished_s = None
    assert _returns_within(lambda: viz.SlotView(unfinished).follow(seconds=0.3, interval=0.05), 30)
    assert _returns_within(lambda: viz.SlotView(unfinished).follow(until=lambda: True, seconds=600), 30)


def staggered_clients(loop, gap_s: float, count: int = 4) -> threading.Thread:
    """A thread that submits ``count`` requests ``gap_s`` apart; the fake engine finishes
    each one long before the next arrives, so the engine goes idle between them."""

    def submit_all():
        for k in range(count):
            time.sleep(gap_s)
            loop.submit([1 + k, 2, 3], max_new_tokens=3, ignore_eos=True, request_id=f"late-{k}")

    thread = threading.Thread(target=submit_all)
    thread.start()
    return thread


@pytest.mark.parametrize("stop", ["grace", "until"])
def test_follow_waits_for_clients_that_arrive_one_by_one(stop):
    engine = batchlab.make_engine("continuous", FakeModel(), runner=FakeRunner, max_batch_size=2)
    with batchlab.EngineLoop(engine) as loop:
        view = viz.SlotView(loop, live=True)
        loop.submit([9, 9], max_new_tokens=2, request_id="first")
        clients = staggered_clients(loop, gap_s=0.25)
        if stop == "grace":  # idle gaps of 0.25 s are shorter than the grace period
            view.follow(seconds=30, interval=0.02, grace=1.0)
        else:  # idle gaps as long as the grace period: only `until` knows the run is over
            view.follow(
                until=lambda: not clients.is_alive() and viz.widget._run_is_over(view.trace),
                seconds=30,
                interval=0.02,
                grace=0.0,
            )
        clients.join()
    trace = engine.trace
    assert set(trace.requests) == {"first"} | {f"late-{k}" for k in range(4)}
    last = max(r.finished_s for r in trace.requests.values())
    assert trace.requests["late-3"].finished_s == last
    assert view.step == len(trace.steps) - 1 and trace.steps[view.step].end_s >= last


def test_follow_redraws_its_display_with_the_final_grid_as_a_png(monkeypatch):
    class Handle:
        bundles = []

        def update(self, obj):
            self.bundles.append(obj._repr_mimebundle_())

    monkeypatch.setattr(viz.widget, "display", lambda obj, display_id: Handle())
    full = continuous_trace()
    view = viz.SlotView(Trace("continuous", 2, [], full.requests, prefill_lane=True), live=True)
    view.display()
    assert "image/png" not in view._repr_mimebundle_()  # nothing to draw yet
    view.trace.steps.extend(full.steps)
    view.follow(seconds=10, interval=0.02, grace=0.0)
    assert len(Handle.bundles) == 1
    bundle = Handle.bundles[0]
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")


def test_slot_view_carries_a_png_of_the_grid_for_viewers_without_widgets():
    bundle = viz.SlotView(static_trace())._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert "image/png" not in viz.SlotView(Trace("static", 2), live=True)._repr_mimebundle_()


# -- figures ---------------------------------------------------------------------------------
def test_plot_slot_grid_draws_one_box_per_run():
    fig = viz.plot_slot_grid(continuous_trace())
    ax = fig.axes[0]
    # slot 0: a (steps 1-3), c (4); slot 1: b (2-4); prefill lane: a (0-1), b, c
    assert len(ax.patches) == 6
    assert ax.get_xlabel() == "engine step" and ax.get_ylabel() == "lane"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["slot 0", "slot 1", "prefill"]
    static = viz.plot_slot_grid(static_trace()).axes[0]
    # x and y: prompt+decode (2 boxes each) then decode; y's padding
    assert len(static.patches) == 2 + 1 + 2 + 1 + 1
    assert "occupancy 56%" in static.get_title()


def test_plot_timeline_has_one_bar_per_state_interval():
    fig = viz.plot_timeline(continuous_trace())
    ax = fig.axes[0]
    # a: queued (0 s long, skipped), prefilling, awaiting (0 s, skipped), decoding;
    # b: queued, prefilling, decoding; c: queued, prefilling, awaiting, decoding
    assert len(ax.patches) == 2 + 3 + 4
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
    assert ax.get_xlabel() == "time since first arrival (s)" and ax.get_ylabel() == "request"
    assert len(ax.collections[0].get_offsets()) == 10  # one tick per token


def test_gap_band_spans_the_smallest_to_the_largest_gap_at_each_moment():
    a, b, c = (continuous_trace().requests[r] for r in "abc")
    # a: tokens 2.0 2.5 3.0 4.0 (gaps 0.5 0.5 1.0); b: 2.6 3.0 4.0 5.0 (gaps 0.4 1.0 1.0)
    xs, lo, hi = viz.gap_band([a, b, c])
    assert list(xs) == [2.0, 2.5, 2.6, 3.0, 4.0, 5.0]
    assert np.isnan(lo[0]) and np.isnan(hi[0])  # no gap ends at the first token
    assert list(lo[1:]) == pytest.approx([0.5, 0.5, 0.4, 1.0, 1.0])  # b has no gap until 3.0
    assert list(hi[1:]) == pytest.approx([0.5, 0.5, 0.5, 1.0, 1.0])


def test_plot_tbt_draws_one_request_and_a_band_for_the_others():
    trace = continuous_trace()
    trace.requests["b"].token_times_s = [2.6, 3.0, 4.5, 5.0]  # b's 1.5 s gap is the worst
    ax = viz.plot_tbt(trace).axes[0]
    assert len(ax.lines) == 1 and "b highlighted" in ax.get_title()
    assert ax.lines[0].get_color() == viz.request_colors(trace)["b"]
    assert max(ax.lines[0].get_ydata()) == pytest.approx(1500.0)
    band = [c for c in ax.collections if c.get_label().startswith("the other 2 requests")]
    assert len(band) == 1
    top = band[0].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(1000.0)  # the largest gap of a and c
    assert len(ax.patches) == 4  # steps 0-3 ran a prefill chunk
    assert ax.get_ylabel() == "time between tokens (ms)"
    chosen = viz.plot_tbt(trace, highlight="c", mark_prefill=False).axes[0]
    assert "c highlighted" in chosen.get_title() and len(chosen.patches) == 0
    with pytest.raises(ValueError, match="nobody"):
        viz.plot_tbt(trace, highlight="nobody")


def test_plot_tbt_draws_a_stall_as_a_flat_step_as_wide_as_the_stall():
    times = [0.0, 0.1, 0.2, 2.9, 3.0]  # a 2.7 s stall between the third and fourth token
    record = RequestRecord(
        "s",
        4,
        4,
        0.0,
        [(0.0, "queued"), (0.0, "decoding"), (3.0, "finished")],
        first_token_s=0.0,
        token_times_s=times,
        finished_s=3.0,
        finish_reason="length",
    )
    line = viz.plot_tbt(Trace("continuous", 1, [], {"s": record}), mark_prefill=False).axes[0].lines[0]
    assert line.get_drawstyle() == "steps-pre"
    xs, ys = cbook.STEP_LOOKUP_MAP["steps-pre"](*line.get_xydata().T)
    segments = list(zip(zip(xs, ys), zip(xs[1:], ys[1:])))
    # every drawn segment is flat or vertical: no ramps
    assert all(a[0] == b[0] or a[1] == b[1] for a, b in segments)
    # the stall: a rise at the token before it, then flat at 2700 ms until the token after it
    assert ((0.2, pytest.approx(100.0)), (0.2, pytest.approx(2700.0))) in segments
    assert ((0.2, pytest.approx(2700.0)), (2.9, pytest.approx(2700.0))) in segments
    # the first gap starts at the first token; dots mark the tokens that end each gap
    assert (xs[0], ys[0]) == (0.0, pytest.approx(100.0))
    assert line.get_markevery() == slice(1, None)


def test_plot_latency_cdfs_draws_one_line_per_trace_on_each_axis():
    traces = {kind: recorded(kind) for kind in RECORDED}
    fig = viz.plot_latency_cdfs(traces)
    ttft_ax, tbt_ax = fig.axes
    assert len(ttft_ax.lines) == len(tbt_ax.lines) == 3
    assert ttft_ax.get_xlabel() == "time to first token (s)"
    assert tbt_ax.get_xlabel() == "time between tokens (ms)"
    assert tbt_ax.get_ylabel() == "fraction of token gaps"
    assert ttft_ax.lines[0].get_ydata()[-1] == pytest.approx(1.0)


def test_plot_occupancy_and_tokens_overlay_traces():
    ax = viz.plot_occupancy({"continuous": continuous_trace(), "static": static_trace()}).axes[0]
    assert len(ax.lines) == 2
    assert list(ax.lines[0].get_ydata()) == pytest.approx([0, 50, 100, 100, 100, 100])
    assert ax.get_ylabel() == "slot occupancy (%)"
    assert ax.get_legend().get_texts()[0].get_text() == "continuous (overall 70%)"
    ax = viz.plot_tokens(continuous_trace()).axes[0]
    assert len(ax.lines) == 1 and ax.lines[0].get_ydata()[-1] == 10
    assert ax.get_ylabel() == "output tokens so far"


def test_plot_side_by_side_gives_each_trace_its_own_titled_axes():
    traces = {kind: recorded(kind) for kind in RECORDED}
    fig = viz.plot_side_by_side(traces, viz.plot_timeline)
    # one title per panel (none drawn over another), the caller's caption, not the kind
    assert [ax.get_title(loc="left") for ax in fig.axes] == [f"{k} · request timeline" for k in RECORDED]
    assert all(ax.get_title() == "" for ax in fig.axes)
    renamed = viz.plot_side_by_side({"whole-prompt prefill": recorded(RECORDED[0])}, viz.plot_tbt)
    assert renamed.axes[0].get_title(loc="left").startswith("whole-prompt prefill · time between tokens")
    assert all(ax.get_xlabel() == "time since first arrival (s)" for ax in fig.axes)
    grids = viz.plot_side_by_side(traces)
    assert [len(ax.get_yticklabels()) for ax in grids.axes] == [3, 4, 3]


# -- a live run on the real model ------------------------------------------------------------
def test_live_view_follows_a_real_engine_loop(lm):
    engine = batchlab.make_engine("continuous", lm, max_batch_size=2)
    loop = batchlab.EngineLoop(engine)
    view = viz.SlotView(loop, live=True)
    questions = ["What is 2+2?", "Name a colour.", "Say hello."]
    with loop:
        for question in questions:
            loop.submit(lm.tokenizer.encode_chat([{"role": "user", "content": question}]), max_new_tokens=6)
        view.follow(seconds=60, interval=0.1)
    trace = engine.trace
    assert len(trace.requests) == 3 and all(r.finished_s is not None for r in trace.requests.values())
    assert shown_step(view) == str(len(trace.steps) - 1)
    cells = [c for column in viz.slot_grid(trace) for c in column]
    for rid, record in trace.requests.items():
        assert (
            sum(1 for c in cells if c.request == rid and c.kind == "decode") == len(record.token_times_s) - 1
        ), rid
        assert sum(c.prefill_tokens for c in cells if c.request == rid) == record.prompt_len, rid


# -- readable at a glance -------------------------------------------------------------------
def lesson_sized_trace(
    kind: str = "continuous", slots: int = 16, steps_of_arrivals: int = 90, seed: int = 0
) -> Trace:
    """A fake-model run the size of a lesson's: a request every other step for
    ``steps_of_arrivals`` steps, prompts of 4-80 tokens, answers of 4-60."""
    rng = np.random.default_rng(seed)
    engine = batchlab.make_engine(
        kind, FakeModel(), runner=FakeRunner, max_batch_size=slots, clock=TickClock()
    )
    for k in range(steps_of_arrivals):
        if k % 2 == 0:
            engine.submit(
                rng.integers(1, 60, size=int(rng.integers(4, 80))).tolist(),
                max_new_tokens=int(rng.integers(4, 60)),
                ignore_eos=True,
            )
        engine.step()
    engine.run_until_idle()
    return engine.trace


def test_still_grid_labels_runs_with_request_ids_in_distinct_colors():
    fig = viz.plot_slot_grid(continuous_trace())
    assert {t.get_text() for t in fig.axes[0].texts} == {"a", "b", "c"}  # room for whole ids
    trace = lesson_sized_trace()
    assert len(trace.requests) == 45
    ax = viz.plot_slot_grid(trace).axes[0]
    labels = {t.get_text() for t in ax.texts}
    # every request ran at least one run wide enough for its id, or at least its number
    assert all(rid in labels or viz.short_label(rid) in labels for rid in trace.requests)
    decode_colors = {
        p.get_facecolor() for p in ax.patches if p.get_hatch() is None and p.get_linewidth() == 0.5
    }
    decoded = {c.request for column in viz.slot_grid(trace) for c in column if c.kind == "decode"}
    assert len(decode_colors) == len(decoded)  # one colour per request, none shared
    assert "steps 0–" in ax.get_title()


def test_busiest_window_cuts_a_long_run_where_the_queue_is_longest():
    queue = [0] * 50 + list(range(1, 31)) + [30] * 10 + list(range(29, -1, -1)) + [0] * 60
    trace = Trace(
        "stallfree",
        1,
        [
            StepRecord(1000 + k, float(k), float(k) + 1, slots=["r"], decoded=["r"], queued=q)
            for k, q in enumerate(queue)
        ],
    )
    window = viz.busiest_window(trace, width=20)
    first = window.steps[0].index - 1000
    assert len(window.steps) == 20 and window.steps[-1].index == window.steps[0].index + 19
    sums = [sum(queue[k : k + 20]) for k in range(len(queue) - 19)]
    assert sum(queue[first : first + 20]) == max(sums) and first == sums.index(max(sums))
    assert window.requests is trace.requests or window.requests == trace.requests
    title = viz.plot_slot_grid(window).axes[0].get_title()
    assert f"steps {window.steps[0].index}–{window.steps[-1].index}" in title
    assert viz.plot_slot_grid(window).axes[0].get_xlim() == (
        window.steps[0].index,
        window.steps[0].index + 20,
    )
    assert viz.busiest_window(trace, width=500).steps == trace.steps  # short runs stay whole
    with pytest.raises(ValueError, match="window"):
        viz.steps_window(trace, 200, 10)


def test_widget_current_step_marker_is_not_the_held_slot_entry():
    page = Elements(viz.frame_html(stallfree_trace(), 1))
    legend = [a["class"] for a in page.having() if "bl-swatch" in a.get("class", "")]
    assert "bl-swatch bl-held" in legend and "bl-swatch bl-playhead" in legend
    assert "current step" in viz.frame_html(stallfree_trace(), 1)
    held = page.having(data_step="1", data_lane="0")[0]
    assert held["data-kind"] == "held" and "bl-current-cell" in held["class"]
    assert page.having(class_="bl-col bl-current")  # the column header carries the marker too
    css = viz.frame_html(stallfree_trace(), 1).split("<style>")[1].split("</style>")[0]
    held_rule = next(line for line in css.splitlines() if line.startswith(".bl-root .bl-held"))
    marker_rules = [line for line in css.splitlines() if "bl-current-cell" in line]
    assert "border" in held_rule and not any("border" in rule or "outline" in rule for rule in marker_rules)


def test_block_view_labels_blocks_with_request_ids():
    engine = batchlab.make_engine(
        "continuous",
        FakeModel(),
        runner=FakeRunner,
        max_batch_size=2,
        kv_block_size=4,
        num_kv_blocks=16,
        clock=TickClock(),
    )
    engine.submit(list(range(1, 11)), max_new_tokens=6, ignore_eos=True, request_id="alpha")
    engine.submit(list(range(20, 26)), max_new_tokens=6, ignore_eos=True, request_id="req-7")
    engine.run_until_idle()
    trace = engine.trace
    both = next(k for k, s in enumerate(trace.steps) if {"alpha", "req-7"} <= set(s.block_tables))
    frame = viz.block_frame_html(trace, both)
    page = Elements(frame)
    held = {rid: len(trace.steps[both].block_tables[rid]) for rid in ("alpha", "req-7")}
    assert {rid: len(page.having(data_request=rid)) for rid in held} == held
    assert "alpha (3)" in frame and "req-7 (2)" in frame  # the key names every holder
    assert ">alp<" in frame and ">7<" in frame  # short ids on the blocks
    colors = viz.request_colors(trace)
    assert (
        colors["alpha"] != colors["req-7"]
        and colors["alpha"] in page.having(data_request="alpha")[0]["style"]
    )
    labels = {t.get_text() for t in viz.plot_block_map(trace).axes[0].texts}
    assert {"alpha", "req-7"} <= labels
    view = viz.BlockView(trace)
    view.show_step(both)
    assert view.to_html().count('data-request="alpha"') == held["alpha"] + sum(
        1 for c in viz.slot_grid(trace)[max(0, both - 39) : both + 1] for x in c if x.request == "alpha"
    )
    # the replay shows the same pool at that step, under its slot grid
    assert view._states.selected_index == both
    assert viz.block_frame_html(trace, both, view.columns, viz.request_colors(trace, view.palette)) in (
        view._states.children[both].value
    )


# -- the animation that plays without a kernel ------------------------------------------------
def frames_of(png: bytes) -> list[np.ndarray]:
    from PIL import Image, ImageSequence

    return [np.array(frame.convert("RGB")) for frame in ImageSequence.Iterator(Image.open(io.BytesIO(png)))]


def test_animation_is_a_small_animated_png_of_the_growing_grid():
    trace = lesson_sized_trace(slots=16, steps_of_arrivals=150)
    assert 180 <= len(trace.steps) <= 260  # lesson-sized
    image = viz.animation(trace)
    assert image.format == "png" and image.data.startswith(b"\x89PNG")
    assert b"acTL" in image.data  # the chunk that makes a PNG animated
    assert len(image.data) <= 300_000
    frames = frames_of(image.data)
    assert len(frames) == 200  # at most max_frames, spread over the run
    assert all(not np.array_equal(a, b) for a, b in itertools.pairwise(frames))
    # the grid fills in: later frames hold more coloured (non-white) pixels
    coloured = [int((f.sum(axis=2) < 3 * 250).sum()) for f in frames[::40]]
    assert coloured == sorted(coloured) and coloured[0] < coloured[-1]
    short = viz.animation(stallfree_trace(), max_frames=200)
    assert len(frames_of(short.data)) == 3  # one frame a step when there are few
    with pytest.raises(ValueError, match="no steps"):
        viz.animation(Trace("continuous", 2))
    long = Trace("static", 1, [step(k, ["r"], decoded=["r"]) for k in range(721)])
    with pytest.raises(ValueError, match="busiest_window"):
        viz.animation(long)
    assert len(frames_of(viz.animation(viz.busiest_window(long, 200)).data)) == 200


def test_animation_colours_each_request_as_the_still_grid_does():
    trace = continuous_trace()
    last = frames_of(viz.animation(trace).data)[-1]
    present = {tuple(px) for px in last.reshape(-1, 3)}
    for rid, color in viz.request_colors(trace).items():
        assert tuple(int(color[i : i + 2], 16) for i in (1, 3, 5)) in present, rid


# -- the trace says whether there is a prefill lane --------------------------------------------
def test_the_prefill_lane_comes_from_the_trace_never_from_the_kind():
    steps = continuous_trace().steps
    assert viz.lane_names(Trace("my-own-kind", 2, steps, prefill_lane=True))[-1] == "prefill"
    assert viz.lane_names(Trace("continuous", 2, steps, prefill_lane=False)) == ["slot 0", "slot 1"]
    kinds_named = {"continuous", "stallfree", "static", "sequential"}
    for path in Path(viz.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        strings = {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and id(node) not in docstrings
        }
        assert not strings & kinds_named, path


def test_prefill_lane_survives_json_and_defaults_to_false():
    trace = continuous_trace()
    assert Trace.from_json(trace.to_json()).prefill_lane is True
    old = json.loads(static_trace().to_json())
    del old["prefill_lane"]  # a trace saved before the field existed
    assert Trace.from_json(json.dumps(old)).prefill_lane is False
    for kind, lane in [("continuous", True), ("stallfree", False), ("static", False)]:
        engine = batchlab.make_engine(kind, FakeModel(), runner=FakeRunner, max_batch_size=2)
        assert engine.trace.prefill_lane is lane, kind


def test_slot_view_slider_shows_no_number_that_could_disagree_with_the_step():
    view = viz.SlotView(recorded(RECORDED[0]))
    assert view._slider.readout is False
    view.show_step(1)
    assert f"step {view.trace.steps[1].index}" in view.to_html()


def test_block_map_marks_shared_blocks_with_one_shade_and_their_holder_count():
    from batchlab.viz.blocks import SHARED_RGB

    engine = batchlab.make_engine(
        "continuous",
        FakeModel(),
        runner=FakeRunner,
        max_batch_size=2,
        kv_block_size=4,
        num_kv_blocks=32,
        clock=TickClock(),
        enable_prefix_cache=True,
    )
    prompt = list(range(1, 13))
    engine.submit(prompt, max_new_tokens=4, ignore_eos=True, request_id="a")
    engine.run_until_idle()
    engine.submit(prompt + [40, 41], max_new_tokens=8, ignore_eos=True, request_id="b")
    engine.submit(prompt + [50, 51], max_new_tokens=8, ignore_eos=True, request_id="c")
    engine.run_until_idle()
    trace = engine.trace
    shared = [
        (k, b)
        for k, s in enumerate(trace.steps)
        for b, who in viz.blocks.block_owners(s).items()
        if len(who) > 1
    ]
    assert shared, "the test workload should share prefix blocks"
    ax = viz.plot_block_map(trace).axes[0]
    image = ax.images[0].get_array()
    assert all(np.allclose(image[b, k], SHARED_RGB) for k, b in shared)
    assert any(t.get_text().startswith("×") for t in ax.texts)


# -- speculative decoding: verify rows ---------------------------------------------------------
def speculative_trace() -> Trace:
    """Two slots held from admission (stall-free). p and q prefill in step 0; in step 1 p
    carries 3 drafts (2 accepted), q 2 drafts (none accepted); in step 2 p's 3 drafts are all
    accepted and q runs a plain decode row; in step 3 p's 3 drafts are all rejected while q
    holds its slot."""
    steps = [
        step(0, ["p", "q"], prefill=[("p", 0, 4), ("q", 0, 4)], slot_of={"p": 0, "q": 1}),
        step(1, ["p", "q"], decoded=["p", "q"], slot_of={"p": 0, "q": 1}),
        step(2, ["p", "q"], decoded=["p", "q"], slot_of={"p": 0, "q": 1}),
        step(3, ["p", "q"], decoded=["p"], slot_of={"p": 0}),
    ]
    steps[1].drafts, steps[1].accepted = {"p": 3, "q": 2}, {"p": 2, "q": 0}
    steps[2].drafts, steps[2].accepted = {"p": 3}, {"p": 3}
    steps[3].drafts, steps[3].accepted = {"p": 3}, {"p": 0}
    return Trace("stallfree", 2, steps)


class _EchoRunner(FakeRunner):
    """A model that mostly repeats the token 5 places back (so prompt-lookup drafts from a
    repetitive prompt are often right) and takes the fake's own token after every third
    position (so some are wrong)."""

    def choose(self, seq):
        from batchlab.core.fake import next_token

        if len(seq) >= 5 and len(seq) % 3:
            return seq[-5]
        return next_token(seq, FakeModel().vocab_size)


def speculative_run() -> Trace:
    rng = np.random.default_rng(1)
    engine = batchlab.make_engine(
        "stallfree",
        FakeModel(),
        runner=_EchoRunner,
        max_batch_size=4,
        token_budget=24,
        kv_block_size=4,
        num_speculative_tokens=3,
        clock=TickClock(),
    )
    for _ in range(6):
        pattern = rng.choice(np.arange(1, 60), size=5, replace=False).tolist()
        engine.submit(pattern * int(rng.integers(3, 7)), max_new_tokens=20, ignore_eos=True)
    engine.run_until_idle()
    return engine.trace


def test_a_verify_rows_cell_says_how_many_drafts_it_carried_and_how_many_were_accepted():
    grid = viz.slot_grid(speculative_trace())
    assert grid[1] == [Cell(D, "p", drafts=3, accepted=2), Cell(D, "q", drafts=2, accepted=0)]
    assert grid[2] == [Cell(D, "p", drafts=3, accepted=3), Cell(D, "q")]  # q: a plain decode row
    assert grid[3] == [Cell(D, "p", drafts=3, accepted=0), Cell("held", "q")]
    assert [c.mark for c in grid[1]] == ["+2/3", "+0/2"] and grid[2][1].mark == ""
    assert [c.verify for row in grid for c in row] == [False, False, True, True, True, False, True, False]
    # bottom up: the row's own token and the accepted drafts (kept), then the rejected ones
    assert grid[1][0].bands == (True, True, True, False)
    assert grid[1][1].bands == (True, False, False) and grid[2][1].bands == ()


def test_verify_cells_agree_with_the_trace_and_its_speculation_totals():
    from batchlab.core.metrics import speculation

    trace = speculative_run()
    totals = speculation(trace)
    assert totals["spec_accepted"] > 0 and totals["spec_drafted"] > totals["spec_accepted"], "both kinds"
    grid = viz.slot_grid(trace)
    for k, (cells, record) in enumerate(zip(grid, trace.steps)):
        verify = {c.request: (c.drafts, c.accepted) for c in cells if c.verify}
        want = {rid: (n, record.accepted.get(rid, 0)) for rid, n in record.drafts.items() if n}
        assert verify == want, k
        assert all(c.kind == D for c in cells if c.verify)
    cells = [c for row in grid for c in row]
    assert sum(c.drafts for c in cells) == totals["spec_drafted"]
    assert sum(c.accepted for c in cells) == totals["spec_accepted"]
    assert sum(c.verify for c in cells) == totals["spec_verify_rows"]
    assert sum(len(c.bands) for c in cells) == totals["spec_verify_rows"] + totals["spec_drafted"]
    # a saved run draws the same cells
    assert viz.slot_grid(Trace.from_json(trace.to_json())) == grid


def test_the_widget_marks_a_verify_row_and_its_legend_explains_it():
    trace = speculative_trace()
    frame = viz.frame_html(trace, 3)
    (cell,) = Elements(frame).having(data_step="1", data_lane="0")
    assert cell["class"] == "bl-cell bl-decode bl-verify" and cell["data-kind"] == "decode"
    assert (cell["data-drafts"], cell["data-accepted"]) == ("3", "2")
    assert cell["style"].endswith(";--n:4;--k:75%") and "+2/3" in cell["title"]
    (rejected,) = Elements(frame).having(data_step="3", data_lane="0")
    assert rejected["style"].endswith(";--n:4;--k:25%") and "0 of 3 drafts accepted" in rejected["title"]
    (plain,) = Elements(frame).having(data_step="2", data_lane="1")
    assert plain["class"] == "bl-cell bl-decode" and "data-drafts" not in plain
    assert ".bl-verify{" in frame and viz.grid.VERIFY_LEGEND in frame
    assert "this step: decode p (+2/3), q (+0/2)" in viz.frame_html(trace, 1)
    # the replay draws the same cells
    view = viz.SlotView(trace)
    assert view._grid.value.count('class="bl-cell bl-decode bl-verify') == 4
    assert 'data-drafts="2" data-accepted="0"' in view._grid.value
    assert "(+3/3)" in view._states.children[2].value


def test_the_gif_draws_a_verify_row_as_bands_with_its_rejected_drafts_grey():
    from PIL import ImageFont

    from batchlab.viz.animation import LANE, ROW
    from batchlab.viz.colors import PADDING_COLOR, rgb

    trace = speculative_trace()
    last = frames_of(viz.animation(trace).data)[-1]
    font = ImageFont.load_default(size=11)
    left = int(max(font.getlength(name) for name in viz.lane_names(trace))) + 10
    colors = viz.request_colors(trace)

    def column(k, lane):  # a column of a cell, top to bottom, as c(olour)/g(rey)/w(hite)
        x, y = left + k * 14 + 12, 40 + lane * ROW  # right of any label
        names = {rgb(colors[trace.steps[k].slots[lane]]): "c", rgb(PADDING_COLOR): "g", (255, 255, 255): "w"}
        return "".join(names.get(tuple(int(v) for v in px), "?") for px in last[y : y + LANE, x])

    assert column(2, 1) == "c" * LANE  # a plain decode row: all colour
    for k, lane, rejected, bands in [(1, 0, 1, 4), (1, 1, 2, 3), (2, 0, 0, 4), (3, 0, 3, 4)]:
        got = column(k, lane)
        assert set(got) <= {"c", "g", "w"} and got.count("w") == bands - 1, (k, lane, got)
        assert got.rstrip("w")[-1] == "c" and ("g" in got) == bool(rejected)
        assert abs(got.rfind("g") + 1 - LANE * rejected / bands) <= 1, (k, lane, got)  # grey: the rejected
        assert got.replace("w", "") == "".join(sorted(got.replace("w", ""), reverse=True))  # grey on top
    no_drafts = frames_of(viz.animation(stallfree_trace()).data)[-1]
    assert last.shape[0] == no_drafts.shape[0] + ROW  # a second legend line: the verify row's


def test_the_still_grid_greys_a_verify_rows_rejected_drafts_and_explains_it():
    from matplotlib.collections import LineCollection

    from batchlab.viz.colors import PADDING_COLOR

    ax = viz.plot_slot_grid(speculative_trace()).axes[0]
    grey = [
        p
        for p in ax.patches
        if p.get_facecolor()[:3] == tuple(int(PADDING_COLOR[i : i + 2], 16) / 255 for i in (1, 3, 5))
    ]
    # p at step 1 (1 of 4 bands), q at step 1 (2 of 3), p at step 3 (3 of 4), each on its cell
    assert sorted((p.get_x(), p.get_y(), round(p.get_height(), 6)) for p in grey) == [
        (1, 0.08, 0.21),
        (1, 1.08, 0.56),
        (3, 0.08, 0.63),
    ]
    (lines,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(lines.get_segments()) == 3 + 2 + 3 + 3  # between the bands of each verify row
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[-1].replace("\n", " ") == viz.grid.VERIFY_LEGEND
    plain = viz.plot_slot_grid(stallfree_trace()).axes[0]
    assert not plain.collections and len(plain.get_legend().get_texts()) == len(labels) - 1


# The pictures of runs without drafts, as they were before verify rows were drawn (digests of
# each renderer's output for the traces of this file and the recorded ones): a run without
# drafts must look exactly as it did, so lessons' saved outputs stay as they are. The HTML is
# plain text; the images' pixels depend on Pillow's and matplotlib's font rendering, so those
# are compared only with the versions they were made with. A deliberate change of the pictures
# updates these digests (print ``_renders(trace)``).
_BEFORE_VERIFY_ROWS = {
    "continuous": ("4a6fe9652af7dbf7", "cb521d3be4b2f9ce", "6fcdf51021964569", "48449e861fc76cfd"),
    "static": ("d4afbc1b46b710a1", "d3ffc94f9dde0099", "b7ccab72863a58c8", "393bbeba9c495775"),
    "stallfree": ("c33083608591e13e", "2851a30c8bea8816", "e91b58606640dd6d", "29513fb2dc2afeb7"),
    "recorded static": ("37878e43384b3f0c", "a7ea223e2b170d9e", "2219dbf4f1fe8640", "5fe906aab3efde05"),
    "recorded continuous": ("26846e61f92b1d66", "9befad9508cd2e8d", "2e3e89ba9165b0cb", "fb2f65e1e34fefff"),
    "recorded stallfree": ("b54aebf45e46c916", "c850ee830561b503", "89d78e58d7643d34", "29f2b12deecbd12d"),
}
_IMAGES_MADE_WITH = {"pillow": "13.0.0", "matplotlib": "3.11.2"}


def _renders(trace: Trace) -> tuple[str, str, str, str]:
    """Digests of frame_html (every step, two windows), player_html (two windows), the
    animation's pixels (every frame) and plot_slot_grid's pixels."""
    import hashlib

    from PIL import Image, ImageSequence

    def digest(data) -> str:
        return hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()[:16]

    def pixels(png: bytes) -> bytes:
        frames = ImageSequence.Iterator(Image.open(io.BytesIO(png)))
        return b"".join(np.asarray(f.convert("RGB")).tobytes() for f in frames)

    n = len(trace.steps)
    players = [viz.player_html(trace, w, uid="bl-test") for w in (40, 7)]
    return (
        digest("".join(viz.frame_html(trace, k, w) for k in range(n) for w in (40, 7))),
        digest("".join(part for grid, states in players for part in [grid, *states])),
        digest(pixels(viz.animation(trace).data)),
        digest(pixels(base64.b64decode(viz.plots.png_base64(viz.plot_slot_grid(trace))))),
    )


@pytest.mark.parametrize("name", list(_BEFORE_VERIFY_ROWS))
def test_a_run_without_drafts_renders_exactly_as_before_verify_rows(name):
    import matplotlib
    import PIL

    made = {
        "continuous": continuous_trace,
        "static": static_trace,
        "stallfree": stallfree_trace,
    }
    trace = made[name]() if name in made else recorded(name.split()[1])
    assert not viz.grid.has_drafts(trace)
    frame, player, gif, grid = _renders(trace)
    want = _BEFORE_VERIFY_ROWS[name]
    assert (frame, player) == want[:2], "the HTML of a run without drafts changed"
    if {"pillow": PIL.__version__, "matplotlib": matplotlib.__version__} == _IMAGES_MADE_WITH:
        assert (gif, grid) == want[2:], "the pictures of a run without drafts changed"
