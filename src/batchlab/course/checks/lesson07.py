"""Checkers for lesson 7 (serving): ``stream_metrics``, ``parse_sse`` and ``goodput``."""

from __future__ import annotations

import json
from functools import partial
from typing import Callable

from ._core import Verdict, close, mistakes, number_compare, table

__all__ = ["stream_metrics", "parse_sse", "goodput"]


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
