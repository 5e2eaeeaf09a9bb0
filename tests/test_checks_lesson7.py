"""Lesson 7's checkers name the case and the mistake (the reference solutions passing and the
learner copy failing are tested for every lesson in test_exercises.py)."""

import json

import batchlab  # noqa: F401  (first: OpenBLAS before mlx)
from batchlab import checks


def test_tpot_over_all_tokens_is_diagnosed():
    def off_by_one(sent, chunks, done, n):
        ttft = chunks[0] - sent
        return ttft, [b - a for a, b in zip(chunks, chunks[1:])], (done - sent - ttft) / n

    verdict = checks.stream_metrics(off_by_one)
    assert not verdict and verdict.passed == 0
    assert "case 1 of 4: sent at 10.0 s" in verdict.message
    assert "divide by output_tokens - 1 = 3" in verdict.message


def test_ttft_without_the_send_time_is_diagnosed():
    verdict = checks.stream_metrics(
        lambda sent, chunks, done, n: (chunks[0], [b - a for a, b in zip(chunks, chunks[1:])],
                                       (done - chunks[0]) / (n - 1) if n > 1 else None))
    assert "TTFT is a duration" in verdict.message
    assert verdict.passed == 2  # the two streams sent at time 0 are right


def test_parse_sse_that_keeps_empty_deltas_and_reads_past_done():
    def naive(lines):
        out = []
        for line in lines:
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    out.append(choice["delta"].get("content", ""))
        return out

    verdict = checks.parse_sse(naive)
    assert not verdict
    assert "case 1 of 6: a plain stream" in verdict.message
    assert "skip chunks whose content is empty" in verdict.message
    assert "case 6 fails too: lines after data: [DONE] are ignored" in verdict.message


def test_goodput_mistakes_are_named():
    strict = checks.goodput(lambda q, d, a, b: sum(
        r["ok"] and r["ttft_s"] < a and (r["tpot_s"] is None or r["tpot_s"] < b) for r in q) / d)
    assert "compare with <=, not <" in strict.message and strict.passed == 3
    share = checks.goodput(lambda q, d, a, b: sum(
        r["ok"] and r["ttft_s"] <= a and (r["tpot_s"] is None or r["tpot_s"] <= b) for r in q) / len(q))
    assert "share of good requests" in share.message
    none_misses = checks.goodput(lambda q, d, a, b: sum(
        r["ok"] and r["ttft_s"] <= a and r["tpot_s"] is not None and r["tpot_s"] <= b for r in q) / d)
    assert "case 5 of 5" in none_misses.message and "should not count as a miss" in none_misses.message
