"""A live dashboard for a shared server: ``/dashboard`` shows the class's requests joining
and leaving the decode slots, the queue, the KV blocks and the latencies, as the engine steps.

The page is one self-contained HTML document (no build step). It reads server-sent events
from ``/dashboard/events``: at most one event per engine step, and fewer when a page or its
network is slow (each event carries every step since the page's last one). The events are
made from the engine's trace, the same cells and colours as the notebooks' slot widget
(``batchlab.viz``), plus the OpenAI ``user`` field each client sent, which only the server
knows. ``/dashboard/summary`` gives the class's recent latencies as JSON, for a student to
compare with their own. Prompt text appears only when the server was started with
``show_prompts``.
"""

from __future__ import annotations

import asyncio
import collections
import html
import json
import re
import time

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, StreamingResponse

from .. import viz
from ..core.metrics import percentile
from ..core.trace import RequestRecord, Trace

WINDOW = 60  # steps on screen
EVENT_INTERVAL_S = 0.05  # a page gets at most this many events a second: 1 / this
IDLE_EVENT_S = 1.0  # with no new step, still refresh the numbers (and keep the stream alive)
STREAM_LIFETIME_S = 5.0  # then the page reconnects: a stopping server waits for open streams
RATE_WINDOW_S = 10.0  # tokens/s over this many seconds
RECENT_REQUESTS = 200  # requests kept for labels, the table and the class summary
TABLE_ROWS = 14
PROMPT_CHARS = 60


def _widget_style_and_legend(kind: str, size: int) -> tuple[str, str]:
    """The notebook widget's CSS and legend, taken from an empty frame of ``viz.frame_html``
    so the dashboard draws cells exactly as the widget does."""
    frame = viz.frame_html(Trace(kind, size), -1)
    style = re.search(r"<style>(.*?)</style>", frame, re.S)
    legend = re.search(r'<div class="bl-legend">.*?</div>', frame, re.S)
    if style is None or legend is None:
        raise RuntimeError("viz.frame_html no longer has a <style> and a legend to share")
    # each swatch with its words in one piece, so a narrow legend wraps between entries
    items = re.sub(
        r'(<span class="bl-swatch[^"]*"></span>[^<]*)', r'<span class="bl-item">\1</span>', legend.group(0)
    )
    return style.group(1), items


def _request_row(rid: str, client, prompt: str | None) -> dict:
    """One request for the page's table: who, state, TTFT and mean time between tokens
    (and the end of its prompt, when the server shows prompts)."""
    record: RequestRecord = client.record
    times = list(record.token_times_s)
    state = record.finish_reason or record.state_times[-1][1]
    row = {
        "id": rid,
        "user": client.user,
        "state": state,
        "tokens": len(times),
        "ttft_ms": None if record.first_token_s is None else (record.first_token_s - record.arrival_s) * 1000,
        "tbt_ms": (times[-1] - times[0]) / (len(times) - 1) * 1000 if len(times) > 1 else None,
    }
    if prompt is not None:
        row["prompt"] = prompt
    return row


class Dashboard:
    """What the page shows, updated at most once per new engine step whoever asks first.
    Everything runs on the server's event loop, so it needs no locks of its own."""

    def __init__(self, server, show_prompts: bool = False):
        self.server, self.show_prompts = server, show_prompts
        self.engine = server.loop.engine
        self.trace = self.engine.trace
        self.clients: collections.OrderedDict = collections.OrderedDict()  # recent, by submit
        self.prompts: dict[str, str] = {}  # their prompts' last words, with show_prompts only
        self.columns: collections.deque = collections.deque(maxlen=WINDOW)
        self.last_step = -1
        self._shared: tuple = (None, None)  # (when, the part of an update every page gets)
        self.style, self.legend = _widget_style_and_legend(self.trace.kind, self.trace.max_batch_size)
        server.on_submit.append(self.track)

    def track(self, rid: str, client) -> None:
        """Remember a submitted request (``Server.on_submit`` calls this)."""
        self.clients[rid] = client
        if self.show_prompts:
            text = self.server.lm.tokenizer.decode(client.prompt_ids, skip_special_tokens=True)
            self.prompts[rid] = text.strip()[-PROMPT_CHARS:]
        while len(self.clients) > RECENT_REQUESTS:
            self.prompts.pop(self.clients.popitem(last=False)[0], None)

    def hello(self) -> dict:
        """What never changes: the engine, its lanes and its KV pool."""
        return {
            "kind": self.trace.kind,
            "slots": self.trace.max_batch_size,
            "lanes": viz.lane_names(Trace(self.trace.kind, self.trace.max_batch_size)),
            "kv_blocks": self.trace.num_kv_blocks,
            "window": WINDOW,
            "show_prompts": self.show_prompts,
        }

    def refresh(self) -> None:
        """Turn the steps the engine added since the last refresh into columns."""
        steps = list(self.trace.steps)  # a copy: the engine thread appends meanwhile
        new = [s for s in steps[-WINDOW:] if s.index > self.last_step]
        for step in new:
            cells = viz.step_cells(Trace(self.trace.kind, self.trace.max_batch_size, [step]), 0)
            self.columns.append(
                {
                    "step": step.index,
                    "queued": step.queued,
                    "kv": step.kv_blocks_used,
                    "prefill": sum(n for _, _, n in step.prefill),
                    "cells": [[c.kind, c.request, c.prefill_tokens] for c in cells],
                }
            )
        if new:
            self.last_step = new[-1].index

    def _label(self, rid: str) -> dict:
        client = self.clients.get(rid)
        return {
            "user": client.user if client else None,
            "short": viz.short_label(rid),
            "color": viz.request_color(rid),
        }

    def stats(self) -> dict:
        """The numbers beside the grid: throughput, queue, KV blocks, slots, latencies."""
        now = self.engine.clock()
        steps = [s for s in list(self.trace.steps)[-2000:] if s.end_s > now - RATE_WINDOW_S]
        span = min(RATE_WINDOW_S, now - steps[0].start_s) if steps else RATE_WINDOW_S
        tokens = sum(len(t) for s in steps for t in s.emitted.values())
        last = self.columns[-1] if self.columns else None
        in_flight = [c for c in self.clients.values() if c.record.finished_s is None]  # queued or running
        return {
            "tokens_per_s": tokens / span if span > 0 else 0.0,
            "queued": self.engine.queue_depth(),
            "running": self.engine.num_running(),  # admitted, not finished (as /metrics)
            "in_flight": len(in_flight),
            "users": len({c.user for c in in_flight}),
            "kv_used": last["kv"] if last else 0,
            "slots_busy": self.engine.slots_busy(),
            **self.summary(),
        }

    def summary(self) -> dict:
        """The class's recent requests: how many finished, and the TTFT, time between tokens
        and tokens/s of each that has them (unfinished ones too)."""
        records = [c.record for c in self.clients.values()]
        ttft = [(r.first_token_s - r.arrival_s) * 1000 for r in records if r.first_token_s is not None]
        times = [list(r.token_times_s) for r in records]
        speeds = [(len(t) - 1) / (t[-1] - t[0]) for t in times if len(t) > 1 and t[-1] > t[0]]
        return {
            "finished": sum(r.finished_s is not None for r in records),
            "finished_users": len({c.user for c in self.clients.values() if c.record.finished_s is not None}),
            "ttft_ms_p50": percentile(ttft, 50),
            "ttft_ms_p90": percentile(ttft, 90),
            "tbt_ms_p50": percentile([1000 / s for s in speeds], 50),
            "tokens_per_s_per_request_p50": percentile(speeds, 50),
        }

    def update(self, after_step: int) -> dict:
        """One event: the columns after ``after_step``, the requests they name, the numbers
        and the table of recent requests. The numbers and the table are made once per step
        (or per idle second) for all pages."""
        when = (self.last_step, int(time.monotonic() / IDLE_EVENT_S))
        if self._shared[0] != when:
            recent = list(self.clients.items())[-TABLE_ROWS:][::-1]
            self._shared = (
                when,
                {
                    "stats": self.stats(),
                    "table": [_request_row(rid, c, self.prompts.get(rid)) for rid, c in recent],
                },
            )
        shared = self._shared[1]
        columns = [c for c in self.columns if c["step"] > after_step]
        named = {rid for c in columns for _, rid, _ in c["cells"] if rid is not None}
        named.update(row["id"] for row in shared["table"])
        return {"columns": columns, "requests": {rid: self._label(rid) for rid in named}, **shared}

    async def events(self):
        """The event stream of one page: a hello, then an update per step (or coalesced steps),
        and one every ``IDLE_EVENT_S`` when idle. It ends after ``STREAM_LIFETIME_S``; the
        page's EventSource reconnects by itself."""

        def event(name: str, data: dict) -> str:
            return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

        yield "retry: 500\n" + event("hello", self.hello())
        sent_step, sent_at = -1, 0.0
        ends = time.monotonic() + STREAM_LIFETIME_S
        while time.monotonic() < ends:
            self.refresh()
            now = time.monotonic()
            if self.last_step > sent_step or now - sent_at >= IDLE_EVENT_S:
                yield event("update", self.update(sent_step))
                sent_step, sent_at = self.last_step, now
            await asyncio.sleep(EVENT_INTERVAL_S)

    def page(self) -> str:
        return (
            _PAGE.replace("/*WIDGET_CSS*/", self.style)
            .replace("<!--LEGEND-->", self.legend)
            .replace("{{MODEL}}", html.escape(self.server.model_id))
        )


def add_dashboard(app: FastAPI, server, show_prompts: bool = False) -> Dashboard:
    """Add ``/dashboard`` (the page), ``/dashboard/events`` (its event stream) and
    ``/dashboard/summary`` (the class's recent latencies, JSON) to ``app``. All three are
    open to anyone who can reach the server, like ``/health``: they show no prompt text
    unless ``show_prompts``."""
    board = Dashboard(server, show_prompts)

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard_page():
        return board.page()

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events():
        return StreamingResponse(
            board.events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.get("/dashboard/summary")
    async def dashboard_summary():
        board.refresh()
        return board.stats()

    return board


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchlab · {{MODEL}}</title>
<link rel="icon" href="data:,">
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
/*WIDGET_CSS*/
html,body{margin:0;height:100%;background:#fff}
body{display:flex;flex-direction:column;overflow:hidden}
.bl-root{font-size:13px}
header{display:flex;gap:18px;align-items:baseline;padding:6px 12px;border-bottom:1px solid #ddd;
  white-space:nowrap;overflow:hidden}
header h1{font-size:16px;margin:0}
header .hint{color:#666;overflow:hidden;text-overflow:ellipsis}
header code{background:#f3f3f3;padding:0 4px;border-radius:3px}
#status{margin-left:auto;color:#999}
#status.live{color:#2a7}
main{flex:1;display:flex;min-height:0}
#left{flex:1;min-width:0;padding:6px 8px;display:flex;flex-direction:column}
#rows{flex:1;min-height:0}
.row{display:flex;align-items:center;height:var(--row);gap:6px}
.row .name{width:64px;flex:none;text-align:right;color:#555;font-size:11px}
.row .who{width:120px;flex:none;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;
  font-size:12px;font-weight:600;border-left:6px solid transparent;padding-left:4px}
.row .track{display:flex;gap:1px;flex:1;min-width:0;height:100%;overflow:hidden;
  justify-content:flex-end}
.bl-root .row .bl-cell{flex:none;width:var(--col);height:calc(var(--row) - 2px);border-radius:2px}
.row.meter .track{align-items:flex-end;border-bottom:1px solid #ccc}
.row.meter .bar{flex:none;width:var(--col);background:#9aa7b8}
.row.meter .who{font-weight:400;color:#333;border:0}
.row[data-prefill-lane] .name{font-style:italic}
#steps{color:#999;font-size:11px;text-align:right;padding-right:2px}
aside{width:372px;flex:none;border-left:1px solid #ddd;padding:6px 10px;overflow:hidden;
  display:flex;flex-direction:column;gap:6px}
.numbers{display:grid;grid-template-columns:1fr 1fr 1fr;gap:4px}
.numbers div{background:#f6f6f6;border-radius:4px;padding:3px 6px}
.numbers b{display:block;font-size:18px;font-variant-numeric:tabular-nums}
.numbers span{color:#666;font-size:11px}
#kvbar{height:8px;background:#eee;border-radius:4px;overflow:hidden}
#kvbar div{height:100%;background:#4e79a7;width:0}
table{border-collapse:collapse;width:100%;font-size:12px;font-variant-numeric:tabular-nums}
th{text-align:left;color:#666;font-weight:400;border-bottom:1px solid #ddd}
td{padding:1px 3px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:110px}
td.num,th.num{text-align:right}
td .dot{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;
  vertical-align:middle}
td.prompt{color:#666;max-width:0;width:100%}
.bl-legend{line-height:22px}
.bl-legend .bl-item{white-space:nowrap}
</style></head>
<body class="bl-root batchlab-dashboard">
<header><h1>batchlab · {{MODEL}}</h1><span class="hint" id="hint"></span><span id="status">connecting…</span></header>
<main>
  <div id="left"><div id="rows"></div><div id="steps"></div></div>
  <aside>
    <div class="numbers">
      <div><b id="tps">–</b><span>tokens/s (10 s)</span></div>
      <div><b id="queued">–</b><span>queued</span></div>
      <div><b id="slots">–</b><span>slots busy</span></div>
      <div><b id="ttft">–</b><span>TTFT p50 (ms)</span></div>
      <div><b id="tbt">–</b><span>TBT p50 (ms)</span></div>
      <div><b id="users">–</b><span>users with open requests</span></div>
    </div>
    <div><span id="kvtext">KV blocks</span><div id="kvbar"><div></div></div></div>
    <!--LEGEND-->
    <table><thead><tr id="thead"><th>user</th><th>id</th><th>state</th><th class="num">TTFT ms</th>
      <th class="num">TBT ms</th><th class="num">tok</th></tr></thead><tbody id="recent"></tbody></table>
  </aside>
</main>
<script>
"use strict";
const $ = id => document.getElementById(id);
let config = null, lanes = [], labels = {}, meters = {}, lastStep = -1;
const scale = {prefill: 64, queued: 8, kv: 1};

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}

function fmt(v, digits) { return v === null || v === undefined ? "–" : v.toFixed(digits); }

function addLane(name, attr, value) {
  const row = el("div", "row");
  row.setAttribute(attr, value);
  row.append(el("div", "name", name), el("div", "who"), el("div", "track"));
  $("rows").append(row);
  lanes.push(row);
  return row;
}

function addMeter(key, name) {
  const row = el("div", "row meter");
  row.dataset.meter = key;
  row.append(el("div", "name", name), el("div", "who"), el("div", "track"));
  $("rows").append(row);
  meters[key] = row;
}

function layout() {
  const rows = lanes.length + Object.keys(meters).length;
  const height = $("rows").clientHeight;
  const row = Math.max(10, Math.min(28, Math.floor(height / Math.max(rows, 1))));
  const track = lanes.length ? lanes[0].querySelector(".track").clientWidth : 600;
  const col = Math.max(4, Math.floor(track / config.window) - 1);
  document.body.style.setProperty("--row", row + "px");
  document.body.style.setProperty("--col", col + "px");
}

function start(hello) {
  if (config && JSON.stringify(config) === JSON.stringify(hello)) return;  // a reconnect: keep the grid
  config = hello;
  lanes = []; meters = {}; labels = {}; lastStep = -1;
  scale.queued = Math.max(8, hello.slots); scale.kv = hello.kv_blocks || 1;
  $("rows").replaceChildren();
  hello.lanes.forEach((name, i) => i < hello.slots ? addLane(name, "data-slot", i)
                                                    : addLane(name, "data-prefill-lane", i - hello.slots));
  addMeter("prefill", "prefill tok");
  addMeter("queued", "queue");
  addMeter("kv", "KV blocks");
  $("hint").replaceChildren("students: base_url ", el("code", null, location.origin + "/v1"),
    " · api_key from the teacher · send user=\\"your name\\"");
  $("thead").querySelectorAll(".prompt").forEach(th => th.remove());
  if (hello.show_prompts) $("thead").append(el("th", "prompt", "prompt"));
  layout();
}

function label(rid) {
  const r = labels[rid];
  return r ? (r.user || "#" + r.short) : rid;
}

function cell(kind, rid, n, step, lane) {
  const c = el("div", "bl-cell bl-" + kind);
  c.dataset.kind = kind;
  c.dataset.step = step;
  if (rid !== null) {
    c.dataset.request = rid;
    if (labels[rid]) c.style.setProperty("--c", labels[rid].color);
    c.title = `step ${step} · ${lane} · ${label(rid)} (${rid}) · ${kind}` + (n ? ` · ${n} prompt tokens` : "");
  }
  return c;
}

function push(track, node) {
  track.append(node);
  while (track.childElementCount > config.window) track.firstElementChild.remove();
}

function addColumn(col) {
  if (col.step <= lastStep) return;
  lastStep = col.step;
  while (lanes.length < col.cells.length) {
    const j = lanes.length - config.slots;
    addLane("prefill " + j, "data-prefill-lane", j);
    $("rows").append(...Object.values(meters));
    layout();
  }
  lanes.forEach((row, i) => {
    const [kind, rid, n] = col.cells[i] || ["idle", null, 0];
    push(row.querySelector(".track"), cell(kind, rid, n, col.step, row.firstChild.textContent));
    const who = row.querySelector(".who");
    who.textContent = rid === null ? "" : label(rid);
    who.style.borderLeftColor = rid === null ? "transparent" : labels[rid].color;
    if (rid === null) delete who.dataset.request; else who.dataset.request = rid;
  });
  for (const [key, row] of Object.entries(meters)) {
    const bar = el("div", "bar"), track = row.querySelector(".track");
    bar.dataset.value = col[key];
    bar.title = `step ${col.step}: ${col[key]} ${row.firstChild.textContent}`;
    push(track, bar);
    if (col[key] > scale[key]) scale[key] = col[key];  // the bars' scale only grows
    for (const b of track.children) b.style.height = (100 * b.dataset.value / scale[key]) + "%";
    row.querySelector(".who").textContent = col[key];
  }
  $("steps").textContent = `step ${col.step}`;
  document.body.dataset.step = col.step;
}

function update(data) {
  Object.assign(labels, data.requests);
  data.columns.forEach(addColumn);
  const s = data.stats;
  $("tps").textContent = fmt(s.tokens_per_s, 1);
  $("queued").textContent = s.queued;
  $("slots").textContent = `${s.slots_busy}/${config.slots}`;
  $("ttft").textContent = fmt(s.ttft_ms_p50, 0);
  $("tbt").textContent = fmt(s.tbt_ms_p50, 0);
  $("users").textContent = s.users;
  $("kvtext").textContent = `KV blocks in use: ${s.kv_used} of ${config.kv_blocks}`;
  $("kvbar").firstChild.style.width = (100 * s.kv_used / (config.kv_blocks || 1)) + "%";
  $("recent").replaceChildren(...data.table.map(r => {
    const tr = el("tr");
    tr.dataset.request = r.id;
    const who = el("td", null, r.user || "–");
    const dot = el("span", "dot");
    dot.style.background = labels[r.id] ? labels[r.id].color : "#ccc";
    who.prepend(dot);
    tr.append(who, el("td", null, r.id), el("td", null, r.state.replace("_", " ")),
              el("td", "num", fmt(r.ttft_ms, 0)), el("td", "num", fmt(r.tbt_ms, 0)),
              el("td", "num", r.tokens));
    if (config.show_prompts) tr.append(el("td", "prompt", r.prompt || ""));
    return tr;
  }));
}

function connect() {
  const source = new EventSource("/dashboard/events");
  source.addEventListener("hello", e => { start(JSON.parse(e.data)); $("status").textContent = "live"; $("status").className = "live"; });
  source.addEventListener("update", e => update(JSON.parse(e.data)));
  source.onerror = () => { $("status").textContent = "reconnecting…"; $("status").className = ""; };
}
window.addEventListener("resize", () => config && layout());
connect();
</script>
</body></html>
"""
