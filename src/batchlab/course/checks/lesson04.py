"""Checkers for lesson 4 (chunked prefill)."""

from __future__ import annotations

import math
from typing import Callable

from ...core.engine import make_engine
from ...core.fake import FakeModel
from ...core.scheduler import Scheduler
from ._core import (
    Differs,
    Verdict,
    mistakes,
    number_compare,
    optional_compare,
    run_cases,
    table,
    whole_number_compare,
)
from ._lineage import KINDS_OF_OURS, lineage_case
from ._pieces import memory_case, piece_case, prefill_chunks, random_rows
from .lesson02 import continuous_judge

__all__ = ["chunked_scheduler", "predict_long_ttft", "largest_chunk"]


def _n_chunks(prompt_len: int, prefill_step: int | None) -> int:
    return 1 if prefill_step is None else math.ceil(prompt_len / prefill_step)


HINTS = {"memory": "start a request (self.start) only if self.fits(req, n) says its KV memory is there"}
PLACED = "a request whose prompt is done awaits a slot, then place() sets it DECODING"


def _chunk_rules(prefill_step, chunks_of=None):
    limit = prefill_step or math.inf

    def rules(trace, B):
        """A chunk over prefill_step, or a token before the last chunk, fails; chunks cut, or
        passes run, otherwise than the lesson's rule only differ (``Differs``)."""
        chunks = prefill_chunks(trace)
        over = [(k, rid, n) for rid, mine in chunks.items() for k, _, n in mine if n > limit]
        if over:
            why = (
                f"more than prefill_step={prefill_step}: a chunk takes at most min(prefill_step, tokens left)"
            )
            return f"step {over[0][0]}: {over[0][1]}'s chunk has {over[0][2]} tokens, {why}"
        for step in trace.steps:
            if twice := sorted({r for r in step.decoded if step.decoded.count(r) > 1}):
                return f"step {step.index}: {twice[0]} got two decode rows: a request makes one token a step"
        for rid, mine in chunks.items():
            last = mine[-1][0]
            first = next((s.index for s in trace.steps if rid in s.emitted), None)
            if first is not None and first > last:
                return f"{rid}'s last chunk ran in step {last} but its first token came in step {first}"
        return _other_chunking(trace, chunks)

    def _other_chunking(trace, chunks):
        if chunks_of is not None:
            rid, want = chunks_of
            got = [(start, n) for _, start, n in chunks.get(rid, [])]
            if got != want:
                rule = "the lesson's rule takes min(prefill_step, tokens left) a chunk"
                return Differs(f"{rid}'s chunks (start, length) were {got}; {rule}: {want}")
        for step in trace.steps:
            if len(step.prefill) > 1:
                return Differs(
                    f"step {step.index} prefilled {len(step.prefill)} chunks; the lesson's rule one"
                )
            if step.passes != bool(step.prefill) + bool(step.decoded):
                return Differs(
                    f"step {step.index} ran {step.passes} pass(es); the lesson's chunk is a pass of its own"
                )
        return None

    return rules


def _judge(rows, prefill_step, batch=3, max_seq_len=None, chunks_of=None, seed=0, **pool):
    """A judge for ``piece_case``; ``chunks_of=(request id, [(start, length), ...])`` checks its chunks."""
    rules = _chunk_rules(prefill_step, chunks_of)
    pool.update(max_seq_len=max_seq_len, prefill_step=prefill_step)
    return continuous_judge(rules, HINTS, PLACED, rows, batch, seed, **pool)


def chunked_scheduler(cls) -> Verdict:
    """Check ``MyChunkedScheduler``: its lineage, its ``prefill_step``, chunks at the boundaries,
    decodes going on between chunks, outputs equal to a whole-prompt prefill's."""
    two = [(5, 12), (5, 12)]  # two short requests that decode while the long prompt prefills
    hint = "chunk(req): the next chunk takes min(self.prefill_step, req.prefill_left) tokens"

    def chunk_case(label, prompt_len, step, chunks, hint=hint):
        return piece_case(label, _judge(two + [(prompt_len, 3)], step, chunks_of=("r2", chunks)), hint)

    tight = random_rows(5, 10, (20, 120), (20, 50))
    halves, infinite = [(0, 128), (128, 128)], "self.prefill_step is infinity then"
    three = halves + [(256, 44)]
    cases = [
        chunk_case("a 300-token prompt in chunks of 128, two requests decoding", 300, 128, three),
        chunk_case("a 256-token prompt in chunks of 128: exactly two chunks", 256, 128, halves),
        chunk_case(
            "a 257-token prompt in chunks of 128: one token over, a third chunk of 1",
            257,
            128,
            halves + [(256, 1)],
        ),
        chunk_case("a 100-token prompt, shorter than one chunk of 128", 100, 128, [(0, 100)]),
        chunk_case("prefill_step=None: a 520-token prompt in one chunk", 520, None, [(0, 520)], infinite),
        chunk_case("chunks of 1 token: a 5-token prompt in 5 steps", 5, 1, [(i, 1) for i in range(5)]),
    ]
    one_token, capped = [(5, 12), (40, 1), (30, 4)], [(5, 12), (60, 10)]
    twelve, ten = random_rows(1, 12, (1, 90), (1, 12)), random_rows(2, 10, (1, 60), (1, 9))
    rows = [  # (label, workload, prefill_step, options)
        ("a request whose first token is also its last: it never takes a slot", one_token, 16, {}),
        ("a 60-token prompt in chunks of 16 with max_seq_len=64: 4 tokens", capped, 16, {"max_seq_len": 64}),
        ("a whole workload: 12 requests, 4 slots, chunks of 16", twelve, 16, {"batch": 4, "seed": 1}),
        ("a whole workload: 10 requests, 3 slots, chunks of 7 tokens", ten, 7, {"batch": 3, "seed": 2}),
    ]
    cases += [piece_case(label, _judge(w, step, **options)) for label, w, step, options in rows]
    label = "memory: 10 requests in chunks of 16 on a KV pool of 16 blocks (most must wait to start)"
    cases.append(memory_case(label, _judge(tight, 16, batch=4, seed=5, num_kv_blocks=16), False, hint))
    cases.append(
        piece_case(
            "prefill_step=0 or 2.5 is refused with a ValueError",
            _bad_steps,
            "__init__: raise ValueError unless prefill_step is None or an integer >= 1",
        )
    )
    return run_cases("chunked_scheduler", cls, [lineage_case(Scheduler, KINDS_OF_OURS), *cases])


def _bad_steps(cls) -> str | None:
    for bad in (0, 2.5, -3):
        try:
            make_engine(cls, FakeModel(), prefill_step=bad)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as e:
            return f"prefill_step={bad!r} raised {type(e).__name__}: {e}; a bad option raises ValueError"
        return f"prefill_step={bad!r} was accepted: a chunk has at least one token, a whole number of them"
    return None


UP = "a last, shorter chunk is a step too (round up)"


def _long_ttft(p, step, rate, dec):
    return p / rate + (_n_chunks(p, step) - 1) * dec


def predict_long_ttft(fn: Callable) -> Verdict:
    """Check ``fn(prompt_len, prefill_step, prefill_tokens_per_s, decode_step_s) -> seconds``."""

    def judge(p, step, rate, dec):
        n, short = _n_chunks(p, step), step is not None and p % step
        known = [
            (p / rate + n * dec, f"that counts a decode pass per chunk: only {n - 1} come first"),
            (p / rate + (p // step - 1) * dec if short else None, "the number of chunks is off: " + UP),
            (p / rate, "that leaves out the decode passes that run between the chunks"),
        ]
        return number_compare(mistakes(*known))

    rows = [
        ("512 tokens, prefill_step=None (one chunk), 256 tokens/s, decode pass 0.1 s", 512, None, 256.0, 0.1),
        ("512 tokens in chunks of 128 (4 chunks), 256 tokens/s, decode pass 0.1 s", 512, 128, 256.0, 0.1),
        ("520 tokens in 9 chunks of 64 (the last of 8), 260 tokens/s, decode 0.1 s", 520, 64, 260.0, 0.1),
        ("100 tokens in chunks of 128 (1 chunk), 250 tokens/s, decode pass 0.1 s", 100, 128, 250.0, 0.1),
        ("512 tokens in chunks of 32 (16 chunks), 256 tokens/s, decode pass 0.05 s", 512, 32, 256.0, 0.05),
    ]
    hint = "all the prompt's tokens are prefilled once whatever the chunk size; "
    hint += "between two chunks comes one decode pass"
    return table("predict_long_ttft", fn, rows, _long_ttft, judge, hint)


def _largest(target, rate, dec, choices):
    return max((c for c in choices if c / rate + dec <= target), default=None)


def largest_chunk(fn: Callable) -> Verdict:
    """Check ``fn(tbt_target_s, prefill_tokens_per_s, decode_step_s, choices) -> int | None``."""

    def judge(target, rate, dec, choices):
        def diagnose(got, expected):
            if got == min((c for c in choices if c / rate + dec <= target), default=None):
                return "that is the smallest chunk that fits; we want the largest"
            if got == _largest(target, rate, 0.0, choices):
                return "that leaves out the decode pass: a decoding request waits for the chunk AND it"
            if got not in choices:
                return f"{got} is not one of the choices {sorted(choices)}"
            if got / rate + dec > target:
                return f"a chunk of {got} gives {got / rate + dec:.3f} s between tokens, over the target"
            return ""

        none = "no chunk size meets this target, so the answer is None"
        return optional_compare(whole_number_compare(diagnose), none, "a chunk size does fit this target")

    sizes = [32, 64, 128, 256]
    rows = [
        ("target 0.5 s, 256 tokens/s, decode pass 0.1 s, choices 32/64/128/256", 0.5, 256.0, 0.1, sizes),
        ("target 1.0 s, same machine", 1.0, 256.0, 0.1, sizes),
        ("target 5.0 s: every choice fits, so the largest", 5.0, 256.0, 0.1, sizes),
        ("target exactly met: 128 tokens at 256 tokens/s + 0.25 s decode = 0.75 s", 0.75, 256.0, 0.25, sizes),
        ("choices not in order: [256, 32, 128, 64], target 0.5 s", 0.5, 256.0, 0.1, [256, 32, 128, 64]),
        ("target 0.1 s with a 0.1 s decode pass: no chunk fits, None", 0.1, 256.0, 0.1, sizes),
        ("a slow machine: target 2.0 s, 44 tokens/s, decode pass 0.45 s", 2.0, 44.0, 0.45, sizes),
    ]
    return table("largest_chunk", fn, rows, _largest, judge, "the largest c with c / rate + decode <= target")
