"""``batchlab demo``: watch an engine batch requests, live, in an 80×24 terminal.

The screen is redrawn in place after every engine step (no scrolling log): the engine
and its options, the decode slots (a letter per request: capital = decoding, small =
its prompt being prefilled, "." = idle), the queue, every request's answer so far, and
one line saying why slots are idle or requests wait ("cut": an answer that reached its
token limit). Requests arrive two every third
step, so slots fill, empty and refill. The run ends with a one-paragraph summary.
"""

from __future__ import annotations

import string
import sys
import textwrap
import unicodedata
from typing import TextIO

from .core import metrics
from .core.engine import make_engine
from .model.load import load_model

WIDTH, HEIGHT = 80, 24

QUESTIONS = [
    ("What is the capital of France?", 24),
    ("Write a haiku about the sea.", 40),
    ("Name three primary colours.", 20),
    ("Explain what a CPU does in one sentence.", 48),
    ("Say hello in Spanish.", 8),
    ("What is 12 times 12?", 16),
    ("Give me a tip for learning to cook.", 56),
    ("Why is the sky blue? Be brief.", 40),
    ("Suggest a name for a cat.", 12),
    ("What does a compiler do?", 48),
    ("List two planets.", 16),
    ("How many legs does a spider have?", 12),
]


def columns(ch: str) -> int:
    """Terminal columns a character takes: 2 for wide East Asian ones, 0 for combining."""
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in "WF" else 1


def one_line(text: str) -> str:
    """A model's text as one line: whitespace runs become one space, control characters "?"."""
    return "".join(ch if ch.isprintable() else "?" for ch in " ".join(text.split()))


def fit(text: str, width: int, pad: bool = False) -> str:
    """``text`` in at most ``width`` columns (too long: it ends in "…"), padded to
    exactly ``width`` if asked."""
    used = sum(map(columns, text))
    if used <= width:
        return text + " " * (width - used) * pad
    out, used = [], 0
    for ch in text:
        if used + columns(ch) > width - 1:
            break
        out.append(ch)
        used += columns(ch)
    return "".join(out) + "…" + " " * (width - 1 - used) * pad


def describe(engine) -> str:
    """The engine and the options it runs with, in one line (from its kind's options)."""
    s = engine.scheduler
    parts = [f"{s.kind} engine", f"{s.max_batch_size} slots"]
    for name, (_, option) in type(s).option_specs().items():
        value = getattr(s, name, None)
        if option is None or name == "max_batch_size" or value is None:
            continue
        parts.append(
            f"{name.replace('_', ' ')} " + ("whole prompt" if value == float("inf") else f"{value:g}")
        )
    parts.append(f"{engine.stats()['num_kv_blocks']} KV blocks")
    return ", ".join(parts)


def explain(rectangular: bool, idle: int, waiting: int, slots: int) -> str:
    """Why slots are idle or requests wait, right now."""
    s = "s" if idle != 1 else ""
    if idle and not waiting:
        return f"{idle} slot{s} idle: no request is waiting for one."
    if waiting and not idle:
        return f"{waiting} waiting: all {slots} slots are busy; a request waits for a free one."
    if idle and waiting:
        if rectangular:
            return (
                f"{idle} slot{s} idle while {waiting} wait: static batching refills only "
                f"when the whole batch is done."
            )
        return f"{idle} slot{s} idle, {waiting} waiting: they are admitted at the next step."
    return f"All {slots} slots busy and nobody waiting: the engine is fully used."


class ShownRequest:
    """What the screen shows of one request: its question and its answer so far."""

    def __init__(self, letter: str, question: str, detokenizer, eos: frozenset[int]):
        self.letter, self.question, self.answer = letter, question, ""
        self.detok, self.eos = detokenizer, eos
        self.state, self.tokens = "queued", 0

    def add(self, tokens: list[int]) -> None:
        # No flush at the end: a cut can leave half a UTF-8 character held back, which
        # would show as "�"; it is dropped instead.
        for t in tokens:
            self.tokens += 1
            if t not in self.eos:
                self.answer += self.detok.add(t)


def frame(
    title: str,
    model: str,
    record,
    requests: dict[str, ShownRequest],
    rectangular: bool,
    slots: int,
    finished: int,
) -> list[str]:
    """The whole screen after one step: at most ``HEIGHT`` lines of at most ``WIDTH`` columns."""
    letters = {rid: r.letter for rid, r in requests.items()}
    prefilling = {rid for rid, *_ in record.prefill} - set(record.decoded)
    cells = [
        "." if rid is None else letters[rid].lower() if rid in prefilling else letters[rid]
        for rid in record.slots
    ]
    queued = [r.letter for r in requests.values() if r.state == "queued"]
    idle = cells.count(".")
    header = [
        fit(title, WIDTH),
        fit(
            f"{model} · step {record.index} · {record.end_s:.1f} s · "
            f"{len(queued)} in the queue · {finished} of {len(requests)} answered",
            WIDTH,
        ),
        "",
        fit(f"slots [{' '.join(cells)}]   capital = decoding, small = prefilling, . = idle", WIDTH),
        fit(f"queue {' '.join(queued) or '(empty)'}", WIDTH),
        fit(explain(rectangular, idle, len(queued), slots), WIDTH),
        "",
    ]
    room = HEIGHT - len(header)
    running = [r for r in requests.values() if r.state == "running"][:room]
    done = [r for r in requests.values() if r.state in ("done", "cut")]
    latest = done[max(0, len(done) - (room - len(running))) :] if room > len(running) else []
    shown = sorted(running + latest, key=lambda r: r.letter)  # running, then the latest answers
    rows = []
    for r in shown:
        head = f"{r.letter} {r.state:<8}{r.tokens:>3}  {fit(r.question, 26, pad=True)} → "
        rows.append(head + fit(one_line(r.answer), WIDTH - sum(map(columns, head))))
    return header + rows


def summary(engine, requests: int) -> str:
    """One paragraph on what the run showed."""
    stats = metrics.summarize(engine.trace)
    s = engine.scheduler
    what = s.description or f"a {type(s).__name__} runs the steps"
    text = (
        f"The {s.kind} engine answered {requests} requests with "
        f"{stats['output_tokens']} tokens in {stats['steps']} steps "
        f"({stats['elapsed_s']:.1f} s, {stats['output_tokens_per_s']:.1f} tokens/s). "
        f"Slots were busy in {100 * stats['slot_occupancy']:.0f}% of decode steps; "
        f"the median request waited {stats['ttft_p50_s']:.1f} s for its first token. "
        f"Here: {what}. Compare: batchlab demo --engine "
        f"{'static' if s.kind != 'static' else 'stallfree'}."
    )
    return textwrap.fill(text, WIDTH)


def play(lm, kind, requests: int = 10, out: TextIO = sys.stdout, **options) -> str:
    """Run the demo on ``lm`` and return the summary; ``kind`` is a kind name, a
    scheduler class or module:Class; ``options`` go to ``make_engine``.
    On a terminal every step redraws the screen; otherwise only the last screen is written."""
    if not 1 <= requests <= len(string.ascii_uppercase):
        raise ValueError(f"--requests must be between 1 and {len(string.ascii_uppercase)}")
    if options.get("max_batch_size") is None:
        options["max_batch_size"] = 4
    if not 1 <= options["max_batch_size"] <= len(string.ascii_uppercase):
        raise ValueError("--batch-size must be between 1 and 26 for the demo")
    engine = make_engine(kind, lm, **options)
    title = f"batchlab demo · {describe(engine)}"
    slots = engine.scheduler.max_batch_size
    live = out.isatty()
    work = [QUESTIONS[i % len(QUESTIONS)] for i in range(requests)]
    shown: dict[str, ShownRequest] = {}
    finished, screen, step = 0, [], 0
    if live:
        out.write("\x1b[2J")
    while True:
        if work and step % 3 == 0:  # two new requests every third step
            for question, max_new in work[:2]:
                rid = engine.submit(
                    lm.tokenizer.encode_chat([{"role": "user", "content": question}]), max_new_tokens=max_new
                )
                shown[rid] = ShownRequest(
                    string.ascii_uppercase[len(shown)],
                    question,
                    lm.tokenizer.detokenizer(),
                    lm.tokenizer.eos_token_ids,
                )
            del work[:2]
        step += 1
        if not engine.step():
            if not work:
                break
            continue
        record = engine.trace.steps[-1]
        in_slots = set(record.slots)
        for rid, r in shown.items():
            if r.state in ("done", "cut"):
                continue
            tokens, status, reason = engine.poll(rid)
            r.add(tokens)
            if status != "running":  # "cut": it reached its token limit
                r.state, finished = "cut" if reason == "length" else "done", finished + 1
            elif rid in in_slots:
                r.state = "running"
        screen = frame(title, lm.info.name, record, shown, engine.scheduler.rectangular, slots, finished)
        if live:
            out.write("\x1b[H\x1b[J" + "\n".join(screen) + "\n")
            out.flush()
    text = summary(engine, requests)
    if not live:
        out.write("\n".join(screen) + "\n")
    out.write("\n" + text + "\n")
    engine.raise_if_failing()  # after the summary: what did happen is shown first
    return text


def run_demo(kind, model: str | None, requests: int = 10, **options) -> int:
    print("loading the model ...", flush=True)
    play(load_model(model), kind, requests, **options)
    return 0
