"""Checkers for lesson 7 (serving): the piece ``MyServer.events`` (each request's stream, on a scripted
engine loop), and the exercises ``stream_metrics``, ``parse_sse`` and ``goodput``."""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Callable

from ._core import Case, Verdict, WrongType, close, mistakes, number_compare, run_cases, show, table
from ._lineage import lineage_case

__all__ = ["stream_metrics", "parse_sse", "goodput", "server_events"]


def stream_metrics(fn: Callable) -> Verdict:
    """Check ``fn(sent_s, chunk_times_s, done_s, output_tokens) -> (ttft_s, itl_s, tpot_s)``."""

    def compare(sent, chunks, done, tokens, got, expected):
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return "return three things: (ttft_s, itl_s, tpot_s)"
        (ttft, itl, tpot), (e_ttft, e_itl, e_tpot) = got, expected
        if not isinstance(ttft, (int, float)) or not close(ttft, e_ttft, 1e-9):
            if isinstance(ttft, (int, float)) and close(ttft, chunks[0], 1e-9) and sent:
                return "TTFT is a duration: subtract the time the request was sent"
            return f"the TTFT is wrong (it should be {e_ttft:g} s)"
        if not isinstance(itl, (list, tuple)) or len(itl) != len(e_itl):
            n = len(itl) if isinstance(itl, (list, tuple)) else "not a list"
            why = f"one between each two of the {len(chunks)} chunks"
            return f"ITL should be a list of {len(e_itl)} gaps ({why}), got {n}"
        if not all(close(a, b, 1e-9) for a, b in zip(itl, e_itl)):
            return "the gaps are wrong: each is a chunk's time minus the previous chunk's"
        if e_tpot is None:
            return None if tpot is None else "with fewer than 2 tokens there is no TPOT: return None"
        if not isinstance(tpot, (int, float)):
            return f"TPOT should be a number, got {tpot!r}"
        if close(tpot, e_tpot, 1e-9):
            return None
        if close(tpot, (done - sent - ttft) / tokens, 1e-9):
            return f"divide by output_tokens - 1 = {tokens - 1}: the first token's time is the TTFT"
        if len(itl) and close(tpot, sum(itl) / len(itl), 1e-9):
            return "that is the mean ITL (chunks); TPOT counts the tokens from usage"
        return ""

    labels = [
        "sent at 10.0 s; 4 chunks at 10.5, 10.6, 10.7, 10.8 s; done at 10.8 s; 4 tokens",
        "uneven gaps: sent at 0; chunks at 1.0, 1.2, 2.0 s; done at 2.0 s; 3 tokens",
        "one chunk, one token: sent at 5.0, chunk at 5.25, done at 5.25 (no TPOT)",
        "the server packed 6 tokens into 3 chunks: sent at 0; chunks at 0.4, 0.6, 0.8; done at "
        "0.9 s; usage says 6 tokens",
    ]
    data = [  # (sent, chunks, done, tokens, the answer written out)
        (10.0, [10.5, 10.6, 10.7, 10.8], 10.8, 4, (0.5, [0.1, 0.1, 0.1], 0.1)),
        (0.0, [1.0, 1.2, 2.0], 2.0, 3, (1.0, [0.2, 0.8], 0.5)),
        (5.0, [5.25], 5.25, 1, (0.25, [], None)),
        (0.0, [0.4, 0.6, 0.8], 0.9, 6, (0.4, [0.2, 0.2], 0.1)),
    ]
    rows = [(label, *args) for label, args in zip(labels, data)]
    hint = "TPOT = (done_s - sent_s - TTFT) / (output_tokens - 1)"
    return table("stream_metrics", fn, rows, None, lambda *row: partial(compare, *row), hint)


def _event(content=None, role=None, finish=None, usage=None) -> str:
    delta = {key: v for key, v in (("role", role), ("content", content)) if v is not None}
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices}
    return "data: " + json.dumps({**body, "usage": usage} if usage else body)


USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


def parse_sse(fn: Callable) -> Verdict:
    """Check ``fn(lines) -> list[str]``: the non-empty ``delta.content`` texts up to ``data: [DONE]``."""
    e, done, blank = _event, "data: [DONE]", ""
    role = e("", role="assistant")
    plain = [role, blank, e("Hel"), blank, e("lo"), blank, e(finish="stop"), blank, done, blank]
    paris = [role, e("Paris"), e(".", finish="stop"), e(usage=USAGE), done]
    emoji, ping = [role, e(" 🙂"), e(' "ok"'), done], [role, e("a"), ": ping", e("b"), done]
    streams = [
        ("a plain stream: role, 'Hel', 'lo', finish, [DONE]", plain, ["Hel", "lo"]),
        ("the role chunk's content '' is not a delta", [role, e(" world"), done], [" world"]),
        ("a keep-alive comment line ': ping' between chunks", ping, ["a", "b"]),
        ("a usage chunk (empty choices) after the finish", paris, ["Paris", "."]),
        ("text with emoji and a quote: ' 🙂' and ' \"ok\"'", emoji, [" 🙂", ' "ok"']),
        ("lines after data: [DONE] are ignored", [e("x"), done, e("late")], ["x"]),
    ]

    def compare(got, expected):
        if not isinstance(got, list):
            return f"return a list of strings, not a {type(got).__name__}"
        if got == expected:
            return None
        if "" in got:
            return "an empty string is in your list: skip chunks whose content is empty"
        if any(not isinstance(g, str) for g in got):
            return "every item should be the text (a str), not the parsed chunk"
        if got[: len(expected)] == expected:
            return "you kept reading after 'data: [DONE]'"
        return ""

    hint = "json.loads each 'data: ' line up to '[DONE]'; take choices[0]['delta'].get('content')"
    return table("parse_sse", fn, streams, None, lambda lines: compare, hint)


def goodput(fn: Callable) -> Verdict:
    """Check ``fn(requests, duration_s, slo_ttft_s, slo_tpot_s) -> float``: good requests per second."""

    def r(ok=True, ttft=0.5, tpot=0.1):
        return {"ok": ok, "ttft_s": ttft, "tpot_s": tpot}

    slo = (1.0, 0.2)  # TTFT <= 1 s, TPOT <= 0.2 s
    sets = [
        ("4 requests, all within the objectives; 2 s", [r(), r(), r(ttft=0.9), r(tpot=0.2)], 2.0, *slo, 2.0),
        ("one misses TTFT, one TPOT; 10 s", [r(), r(ttft=1.5), r(tpot=0.3), r()], 10.0, *slo, 0.2),
        ("a request cut off mid-stream (ok False); 4 s", [r(), r(ok=False, ttft=0.3), r()], 4.0, *slo, 0.5),
        ("exactly on the limits counts as good; 1 s", [r(ttft=1.0, tpot=0.2)], 1.0, *slo, 1.0),
        ("a one-token answer (TPOT None); 5 s", [r(tpot=None), r(ttft=2.0, tpot=None)], 5.0, *slo, 0.2),
    ]

    def count(reqs, strict=False, any_ok=False, none_misses=False, either=False):
        """Good requests under a rule with one of the usual mistakes switched on."""
        within = (lambda v, lim: v < lim) if strict else (lambda v, lim: v <= lim)
        n = 0
        for q in reqs:
            if (q["ok"] or any_ok) and q["ttft_s"] is not None:
                ttft_ok = within(q["ttft_s"], 1.0)
                tpot_ok = (not none_misses) if q["tpot_s"] is None else within(q["tpot_s"], 0.2)
                n += (ttft_ok or tpot_ok) if either else (ttft_ok and tpot_ok)
        return n

    def judge(reqs, d, *slo):
        good = count(reqs)
        known = [
            (good / len(reqs), "that is the share of good requests; divide their number by duration_s"),
            (good if d != 1 else None, f"that is the number of good requests ({good}); divide by duration_s"),
            (count(reqs, strict=True) / d, "a request exactly at a limit meets it: compare with <=, not <"),
            (count(reqs, none_misses=True) / d, "a tpot_s of None (one token) should not count as a miss"),
            (count(reqs, either=True) / d, "a request must meet BOTH objectives to be good"),
            (count(reqs, any_ok=True) / d, "count only requests with ok True"),
        ]
        return number_compare(mistakes(*known, rel=1e-9), rel=1e-9)

    hint = "good = ok and both objectives met; goodput = good / duration_s"
    return table("goodput", fn, sets, None, judge, hint)


# -- the piece: MyServer.events, each request's stream ----------------------------------------------
STEP_S = 0.002  # the scripted engine's step: the checker's driver steps it this often
WAIT_S = 1.5  # after the script ends, how long a stream may still take to end (> HEARTBEAT_S)
_RID = "r"


class _Busy(BaseException):
    """Raised in a poll when the stream polls on and on with no engine step between (not an
    ``Exception``, so the learner's ``except Exception`` does not swallow it)."""


class _ScriptedLoop:
    """What a server's stream sees of an engine loop, on a script: step ``k`` makes the tokens of
    ``script[k]`` and sets that item's status and reason. ``poll`` drains like an engine's;
    ``cancel`` ends the request as 'cancelled', ``stop_string_met`` as 'stop'. The checker's driver
    calls ``step``."""

    def __init__(self, scripts: dict[str, list]):
        self.scripts, self.made = scripts, 0
        self.pending = {rid: [] for rid in scripts}
        self.state = {rid: ("running", None) for rid in scripts}
        self.cancels: list[str] = []
        self.stopped: list[str] = []  # stop_string_met
        self.polls = self.polls_since_step = 0
        self.listeners: list = []
        self.error = None  # ServerBase.unavailable reads it

    def add_listener(self, fn) -> None:
        self.listeners.append(fn)

    def step(self) -> None:
        for rid, script in self.scripts.items():
            if self.made < len(script) and self.state[rid][0] == "running":
                tokens, status, reason = script[self.made]
                self.pending[rid] += tokens
                self.state[rid] = (status, reason)
        self.made += 1
        self.polls_since_step = 0
        for fn in self.listeners:
            fn()

    def poll(self, rid: str):
        self.polls += 1
        self.polls_since_step += 1
        if self.polls_since_step > 200:
            raise _Busy(
                "events() polled 200 times with no engine step in between: wait for the next step "
                "between polls (await self.next_progress().wait()); polling again at once, or blocking "
                "in time.sleep, keeps the event loop from every other stream"
            )
        if rid not in self.state:
            return [], "unknown", None
        tokens, self.pending[rid] = self.pending[rid], []
        return tokens, *self.state[rid]

    def cancel(self, rid: str) -> bool:
        self.cancels.append(rid)
        if self.state.get(rid, ("done",))[0] != "running":
            return False
        self.state[rid] = ("done", "cancelled")
        return True

    def stop_string_met(self, rid: str) -> bool:
        self.stopped.append(rid)
        if self.state.get(rid, ("done",))[0] != "running":
            return False
        self.state[rid] = ("done", "stop")
        return True

    def ended(self) -> bool:
        return self.made >= max(len(s) for s in self.scripts.values())


def _stream_run(cls, tokenizer, scripts, stops=(), take=None, close_at=None, leave_waiting=False, rids=None):
    """Streams of ``cls`` for every request of ``scripts`` on one server and one event loop (a
    thread of its own: a notebook's kernel runs a loop already). ``take``: the consumer leaves
    after that many pieces; ``leave_waiting``: it leaves while the stream waits; ``close_at``: the
    server closes after that step; ``rids``: the streams (default: one a request). Returns what
    each stream yielded, how it ended, the cancels."""
    import asyncio
    from types import SimpleNamespace

    loop = _ScriptedLoop(scripts)
    server = cls(SimpleNamespace(tokenizer=tokenizer), loop, "model")
    rids = list(rids or scripts)
    got = {rid: {"events": [], "end": None} for rid in rids}

    async def drive():
        streams = [asyncio.ensure_future(_consume(server, rid, stops, take, got[rid])) for rid in rids]
        await asyncio.sleep(STEP_S)
        while not loop.ended() and not all(s.done() for s in streams):
            loop.step()
            if close_at is not None and loop.made == close_at:
                server.close("closing")
            if leave_waiting and loop.made == 2:
                await asyncio.sleep(STEP_S)
                for s in streams:
                    s.cancel()  # the client went away while its stream waited for a step
            await asyncio.sleep(STEP_S)
        done, waiting = await asyncio.wait(streams, timeout=WAIT_S)
        for s in waiting:
            s.cancel()
        for s in done:
            if not s.cancelled() and s.exception() is not None:
                raise s.exception()
        return bool(waiting)

    stuck = _in_own_loop(drive)
    return {
        "streams": got,
        "cancels": sorted(set(loop.cancels)),
        "stopped": sorted(set(loop.stopped)),
        "polls": loop.polls,
        "steps": loop.made,
        "stuck": stuck,
    }


async def _consume(server, rid, stops, take, got):
    """One client of ``server.events(rid, stops)``: ``got`` gets its events and how it ended."""
    import inspect

    stream = server.events(rid, list(stops))
    if inspect.iscoroutine(stream):  # an async def without a yield: the stub, say
        await stream  # (raises NotImplementedError while not written)
        raise WrongType("events() must yield its events (an async generator), not return them")
    try:
        async for event in stream:
            got["events"].append(_event_of(event))
            if take is not None and len(got["events"]) >= take:
                await stream.aclose()  # the client went away
                got["end"] = "left"
                return
        got["end"] = "ended"
    except Exception as e:  # noqa: BLE001 -- a StreamEnded, or the learner's bug: judged below
        if type(e).__name__ != "StreamEnded":
            raise
        got["end"] = f"StreamEnded {getattr(e, 'status', '?')}"


def _in_own_loop(main):
    """``asyncio.run(main())`` in a thread of its own; what it returns, or what it raised, here."""
    import asyncio
    import threading

    outcome = {}

    def run():
        try:
            outcome["value"] = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 -- raised again in the checker's thread
            outcome["error"] = e

    worker = threading.Thread(target=run, name="batchlab-stream-check", daemon=True)
    worker.start()
    worker.join()
    if "error" in outcome:
        error = outcome["error"]
        raise WrongType(str(error)) if isinstance(error, _Busy) else error
    return outcome["value"]


def _event_of(event):
    """A yielded (text, finish reason, tokens so far), as a tuple; else a WrongType that says what came."""
    if not (isinstance(event, tuple) and len(event) == 3 and isinstance(event[0], str)):
        raise WrongType(
            f"events() yielded {show(event)}: yield (new text, finish reason or None, tokens so far)"
        )
    return event


def _pieces(stream):
    return [text for text, _, _ in stream["events"] if text]


def _stream_problem(got, expected) -> str | None:
    """The first way the learner's streams differ from ours: text, pieces, counts, reasons, how
    each ended, the requests cancelled, polling without waiting."""
    if got["stuck"]:
        return (
            f"a stream was still open {WAIT_S:g} s after its request ended: poll again after each step "
            "(and after a heartbeat of HEARTBEAT_S, so a missed wake-up cannot hang it), and end the "
            "stream once the status is not 'running'"
        )
    for rid, want in expected["streams"].items():
        mine, who = got["streams"][rid], f"request {rid!r}: " if len(expected["streams"]) > 1 else ""
        if want["end"] != mine["end"]:
            return who + _end_problem(mine["end"], want["end"])
        text, right = "".join(t for t, _, _ in mine["events"]), "".join(t for t, _, _ in want["events"])
        if text != right:
            return who + _text_problem(text, right)
        if _pieces(mine) != _pieces(want):
            return who + (
                f"the text came as {len(_pieces(mine))} pieces, not one per token that adds text "
                f"({len(_pieces(want))}): yield each token's text on its own, so a client can time every token"
            )
        counts = [(t, n) for t, _, n in mine["events"] if t]
        if counts != [(t, n) for t, _, n in want["events"] if t]:
            return who + "each piece's count is the tokens made so far, those without text (EOS) included"
        reasons = [r for _, r, _ in mine["events"] if r is not None]
        right_reasons = [r for _, r, _ in want["events"] if r is not None]
        if reasons != right_reasons:
            return (
                who
                + f"the finish reasons yielded were {reasons}, not {right_reasons} (only the last event has one)"
            )
        if mine["events"] and want["events"] and mine["events"][-1][2] != want["events"][-1][2]:
            return who + (
                f"the last event counts {mine['events'][-1][2]} tokens, not {want['events'][-1][2]}: "
                "every token counts, EOS and those that come with the final status too"
            )
    if got["stopped"] != expected["stopped"]:
        return _stop_problem(got, expected)
    if got["cancels"] != expected["cancels"]:
        missing = [r for r in expected["cancels"] if r not in got["cancels"]]
        if missing:
            return (
                f"request(s) {missing} were never cancelled: a stream that ends before its request does "
                "(a client gone, the server closing) must cancel it, or it holds its slot "
                "to the end (try/finally)"
            )
        return f"you cancelled {got['cancels']}, which had ended by themselves (or were not this stream's)"
    if got["polls"] > len(expected["streams"]) * (got["steps"] + 2):  # one poll a step each, and the ends
        return (
            f"{got['polls']} polls for {got['steps']} engine steps: wait for the next step between polls "
            "(await self.next_progress().wait()) instead of polling again at once"
        )
    return None


def _stop_problem(got, expected) -> str:
    """The streams told the engine of a met stop string (``stop_string_met``) where ours did not,
    or the other way round."""
    if wrongly := sorted(set(expected["stopped"]) & set(got["cancels"])):
        return (
            f"request(s) {wrongly} met a stop string and you cancelled them: call "
            "self.loop.stop_string_met(rid) instead, so the engine records an answer ('stop') and "
            "counts it as completed, not as 'cancelled'"
        )
    if missing := [r for r in expected["stopped"] if r not in got["stopped"]]:
        return f"request(s) {missing} met a stop string: tell the engine with self.loop.stop_string_met(rid)"
    return f"you called stop_string_met for {got['stopped']}, whose text met no stop string"


def _end_problem(mine, want) -> str:
    says = {
        "ended": "ended by itself",
        "left": "was left by its client",
        None: "did not end",
        "StreamEnded 500": "raised StreamEnded(..., 500)",
        "StreamEnded 503": "raised StreamEnded(..., 503)",
    }
    return f"the stream {says.get(mine, mine)}, where ours {says.get(want, want)}"


def _text_problem(text, right) -> str:
    if "\ufffd" in text:
        return "the text has '\\ufffd' (half a character): detokenize with the detokenizer's add(), and flush() at the end"
    if "<|" in text:
        return f"the text {text!r} shows a special token: an EOS token adds no text"
    if right.startswith(text):
        return f"the text {text!r} stops short of {right!r}"
    if text.startswith(right):
        return (
            f"the text {text!r} goes past {right!r}: nothing after a stop string, or after the request ended"
        )
    return f"the text {text!r} is not {right!r}"


def _show_streams(value) -> str:
    streams = value["streams"]
    parts = [f"{rid}: {show(s['events'])} ({s['end']})" for rid, s in streams.items()]
    return "; ".join(parts) + f"; cancelled {value['cancels']}; stop_string_met {value['stopped']}"


HELD = "one token can end inside a character: the detokenizer's add() holds it back, flush() at the end"
BEFORE = "yield the text of a poll's tokens before you look at its status"
STOPPED = (
    "StopMatcher.feed says when a stop string is found: call self.loop.stop_string_met(rid) then, and end "
    "the stream with 'stop'"
)
CLEANUP = "wrap the loop in try/finally: if the stream is closed before its request ended, cancel the request"
OWN = "keep a stream's state (its detokenizer, its count) in the generator's own variables, not on self"
FAILED = "reason 'error': raise StreamEnded(message, 500); self.unavailable() (server closing): StreamEnded(it, 503)"


def _stream_scripts(tokenizer) -> dict[str, list]:
    """The checker's scripts, one item a step: an answer one token a step then EOS, emoji, an
    answer cut inside an emoji."""
    eos = min(tokenizer.eos_token_ids)
    answer = tokenizer.encode(" The capital of France is Paris. It is on the Seine.")
    emoji, cut = tokenizer.encode("I love 🍕 and ☕."), tokenizer.encode("I love 🍕")[:-1]
    return {
        "one_a_step": [([t], "running", None) for t in answer] + [([eos], "done", "stop")],
        "emoji": [([t], "running", None) for t in emoji] + [([eos], "done", "stop")],
        "two_steps": [(answer[:4], "running", None), (answer[4:] + [eos], "done", "stop")],
        "cut": [(cut, "done", "length")],
    }


def _case_maker(tokenizer, Server):
    """``case(label, scripts, hint, **how)``: a Case whose answer is our Server's run. After a
    stream of the learner's hung or held the event loop, the later cases are not run."""
    gave_up: list[str] = []  # a stream that hung or held the event loop: the later cases are not run

    def case(label, scripts, hint="", **how):
        def call(f):
            if gave_up and f is not Server:
                raise WrongType(f"not run: in case {gave_up[0]} a stream {gave_up[1]}")
            try:
                run = _stream_run(f, tokenizer, scripts, **how)
            except WrongType as e:
                if "polled" in str(e):
                    gave_up.extend((label, "held the event loop"))
                raise
            if run["stuck"]:
                gave_up.extend((label, "never ended"))
            return run

        return Case(label, call, call(Server), _stream_problem, hint, _show_streams)

    return case


def _stream_cases(case, s: dict) -> list:
    """The checker's cases, built with ``case`` on the scripts ``s``."""
    one = s["one_a_step"]
    return [
        case(
            "one token a step, then EOS: a piece per token with the tokens so far, 'stop' last",
            {_RID: one},
        ),
        case(
            "'I love 🍕 and ☕.': an emoji is 3 tokens; no piece holds half a character",
            {_RID: s["emoji"]},
            HELD,
        ),
        case("several tokens a step, the last ones with 'done'", {_RID: s["two_steps"]}, BEFORE),
        case("max tokens reached ('length') inside an emoji: the rest is flushed", {_RID: s["cut"]}, HELD),
        case(
            "a stop string ('Paris'): the text before it, 'stop', and the engine told at once",
            {_RID: one},
            STOPPED,
            stops=["Paris"],
        ),
        case(
            "a stop string over two tokens ('capital of'): no part of it is sent",
            {_RID: one},
            STOPPED,
            stops=["capital of"],
        ),
        case(
            "cancelled elsewhere (reason 'cancelled'): the stream ends with 'stop'",
            {_RID: one[:3] + [([], "done", "cancelled")]},
        ),
        case(
            "the engine fails the request (reason 'error'): StreamEnded, 500",
            {_RID: one[:3] + [([], "done", "error")]},
            FAILED,
        ),
        case(
            "the server closes mid-stream: StreamEnded, 503, and the request cancelled",
            {_RID: one},
            FAILED,
            close_at=4,
        ),
        case("the client leaves after 2 pieces: the request is cancelled", {_RID: one}, CLEANUP, take=2),
        case(
            "the client leaves while its stream waits for a step: the request is cancelled",
            {_RID: one},
            CLEANUP,
            leave_waiting=True,
        ),
        case(
            "two requests at once on one server: each stream has its own text",
            {"a": one, "b": s["emoji"]},
            OWN,
        ),
        case(
            "an id the engine does not know: the stream ends at once, no text",
            {_RID: one[:2]},
            rids=["zzz"],
        ),
    ]


def server_events(cls: Any, tokenizer) -> Verdict:
    """Check ``MyServer.events(rid, stops)``: each request's stream, on a scripted engine loop."""
    from ...serving.server import Server, ServerBase

    cases = [lineage_case(ServerBase, (Server,))]
    cases += _stream_cases(_case_maker(tokenizer, Server), _stream_scripts(tokenizer))
    return run_cases("server_events", cls, cases)
