"""Workloads are deterministic, have the lengths and distributions they promise, are made
of the shipped real text, and the driver submits them on time and gets them done."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np
import pytest

import batchlab
from batchlab.core import metrics as M
from batchlab.measurement import driver as D
from batchlab.measurement import workloads as W
from batchlab.measurement.simulator import VirtualClock
from batchlab.core.trace import RequestRecord, StepRecord, Trace


@pytest.fixture(scope="module")
def tok(lm):
    return lm.tokenizer


def fingerprint(w: W.Workload):
    return [(r.id, list(r.prompt_ids), r.max_new_tokens, r.arrival_s, r.messages) for r in w]


QUICK = {
    "mixed": {},
    "high_variance": {"size": "quick"},
    "high_variance_poisson": {"size": "quick", "arrivals": "poisson", "rate": 1.0},
    "sharegpt": {"size": "quick"},
    "sharegpt_bursty": {"size": "quick", "arrivals": "bursty", "rate": 1.0, "cv": 3.0},
    "interference": {"size": "quick"},
    "echo": {"size": "quick"},
    "structured": {"size": "quick"},
}


def make(name, tok, **kw):
    kind = name.split("_poisson")[0].split("_bursty")[0]
    return W.make_workload(kind, tok, **{**QUICK[name], **kw})


# -- determinism ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(QUICK))
def test_same_seed_same_workload_other_seed_differs(tok, name):
    a, b = make(name, tok, seed=3), make(name, tok, seed=3)
    assert fingerprint(a) == fingerprint(b)
    c = make(name, tok, seed=4)
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]
    assert a.prompt_lens != c.prompt_lens


# -- prompts: real text, the chat template, exact lengths ---------------------------------------
def test_prompt_ids_are_the_chat_template_encoding_of_the_messages(tok):
    for name in QUICK:
        for r in make(name, tok):
            assert r.prompt_ids == tok.encode_chat(r.messages), r.id
            assert r.max_new_tokens >= 1


def test_prompts_are_an_instruction_then_shipped_paragraphs(tok):
    paragraphs = W.corpus_paragraphs()
    assert len(paragraphs) > 500
    whole = set(paragraphs)
    for r in make("sharegpt", tok):
        (message,) = r.messages
        assert message["role"] == "user"
        instruction, text = message["content"].split("\n\n", 1)
        assert instruction in W.INSTRUCTIONS
        *full, last = text.split("\n\n")
        assert all(p in whole for p in full), r.id
        assert last and any(p.startswith(last) for p in paragraphs), r.id
        assert len(text.split()) >= 3


@pytest.mark.parametrize("target", [38, 41, 50, 64, 100, 257, 512, 777, 1024])
def test_prompt_maker_hits_the_target_length_exactly(tok, target):
    rng = np.random.default_rng(target)
    ids, messages = W.PromptMaker(tok).make(target, rng)
    assert len(tok.encode_chat(messages)) == target
    assert ids == tok.encode_chat(messages)


def test_too_short_a_prompt_is_refused(tok):
    with pytest.raises(ValueError, match="too short"):
        W.PromptMaker(tok).make(20, np.random.default_rng(0))


# -- each workload's shape ----------------------------------------------------------------------
def test_mixed_is_small_fixed_and_in_range(tok):
    w = W.mixed(tok)
    assert len(w) == 16 and w.seed == 0
    assert all(40 <= n <= 300 for n in w.prompt_lens)
    assert all(4 <= n <= 64 for n in w.output_lens)
    assert w.arrivals == [0.0] * 16
    assert len(set(r.id for r in w)) == 16
    assert max(w.prompt_lens) - min(w.prompt_lens) > 100  # really mixed
    assert fingerprint(W.mixed(tok)) == fingerprint(w)


def test_high_variance_outputs_are_exponential(tok):
    w = W.high_variance(tok, size="full", mean_output=64, max_output=512)
    o = np.array(w.output_lens)
    assert len(w) == 256
    assert o.min() >= 1 and o.max() <= 512
    # ceil(Exponential(64)) has mean 64.5 and a standard deviation of about 64;
    # over 256 draws the sample mean is within 15 % (2.4 standard errors).
    assert abs(o.mean() - 64.5) < 0.15 * 64.5
    assert 0.75 < o.std() / o.mean() < 1.25  # coefficient of variation 1
    assert 0.27 < np.mean(o > 64) < 0.47  # P(X > mean) = 1/e = 0.37
    assert all(40 <= n <= 128 for n in w.prompt_lens)
    assert w.arrivals == [0.0] * 256
    assert len(W.high_variance(tok)) == 32


def test_sharegpt_lengths_are_lognormal_and_clipped(tok):
    w = W.sharegpt(tok, size="full")
    p, o = np.array(w.prompt_lens), np.array(w.output_lens)
    assert len(w) == 200
    assert p.min() >= 40 and p.max() <= 1024 and o.min() >= 4 and o.max() <= 512
    # log-length ~ Normal(log median, sigma): median within 15 %, spread near sigma
    # (clipping trims the tails a little, so the bands are a little wide).
    assert abs(np.median(p) / 128 - 1) < 0.15
    assert abs(np.median(o) / 64 - 1) < 0.15
    assert 0.5 < np.log(p).std() < 0.85
    assert 0.6 < np.log(o).std() < 0.95
    # a long right tail: mean above median
    assert p.mean() > np.median(p) and o.mean() > np.median(o)
    # Poisson arrivals at 0.5/s by default: 199 gaps, rate within 20 %
    a = np.array(w.arrivals)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert abs((len(a) - 1) / a[-1] / 0.5 - 1) < 0.2


def test_interference_long_prompts_arrive_while_the_batch_decodes(tok):
    speeds = W.Speeds(decode_step_s=0.1, prefill_tokens_per_s=250)
    w = W.interference(tok, size="quick", batch_size=16, speeds=speeds)
    short = [r for r in w if r.arrival_s == 0]
    long = [r for r in w if r.arrival_s > 0]
    assert len(short) == 15 and len(long) == 3  # one slot left for the long prompts
    assert all(r.prompt_len >= 512 for r in long)
    assert all(r.prompt_len < 100 for r in short)
    assert len({r.max_new_tokens for r in short}) == 1
    # at the given speeds: the short ones are decoding before the first long prompt comes...
    decoding_from = sum(r.prompt_len for r in short) / 250 + len(short) * 0.1
    assert long[0].arrival_s > decoding_from
    # ...each long one is prefilled and done before the next arrives...
    for a, b in zip(long, long[1:]):
        assert b.arrival_s > a.arrival_s + a.prompt_len / 250 + a.max_new_tokens * 0.1
    # ...and the short ones are still decoding when the last long one is done.
    last = long[-1]
    assert (
        decoding_from + short[0].max_new_tokens * 0.1
        > last.arrival_s + last.prompt_len / 250 + last.max_new_tokens * 0.1
    )
    full = W.interference(tok, size="full", batch_size=8)
    assert sum(r.arrival_s > 0 for r in full) > 3 and sum(r.arrival_s == 0 for r in full) == 7


# -- arrivals -----------------------------------------------------------------------------------
def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    t = W.arrival_times(4000, "poisson", rate=2.0, rng=np.random.default_rng(1))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert abs(len(gaps) / t[-1] / 2.0 - 1) < 0.05  # standard error 1.6 %
    assert 0.9 < gaps.std() / gaps.mean() < 1.1


def test_bursty_arrivals_have_the_rate_and_more_variable_gaps():
    t = W.arrival_times(4000, "bursty", rate=2.0, cv=3.0, rng=np.random.default_rng(1))
    gaps = np.diff(t)
    assert abs(len(gaps) / t[-1] / 2.0 - 1) < 0.15  # standard error 4.7 %
    assert 2.4 < gaps.std() / gaps.mean() < 3.6
    # clumps: most gaps far below the mean gap
    assert np.median(gaps) < 0.2 * gaps.mean()


def test_arrival_options_are_checked():
    assert list(W.arrival_times(3, "all")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        W.arrival_times(3, "poisson")
    with pytest.raises(ValueError):
        W.arrival_times(3, "uniform", rate=1.0)


def test_with_arrivals_head_capped(tok):
    w = W.mixed(tok)
    p = w.with_arrivals("poisson", rate=4.0)
    assert [r.prompt_ids for r in p] == [r.prompt_ids for r in w]
    assert p.arrivals[0] == 0 and all(b > a for a, b in zip(p.arrivals, p.arrivals[1:]))
    assert p.arrivals == w.with_arrivals("poisson", rate=4.0).arrivals
    assert "at once" in w.description and "at once" not in p.description  # it says how they arrive
    assert "arriving Poisson at 4/s" in p.description
    assert max(w.output_lens[:3]) > 5  # so capping changes something
    h = w.head(3).capped(5)
    assert [r.id for r in h] == [r.id for r in w][:3]
    assert h.output_lens == [min(n, 5) for n in w.output_lens[:3]]
    assert len(w) == 16  # the original is untouched
    s = w.summary()
    assert s["requests"] == 16 and s["prompt_tokens"] == sum(w.prompt_lens)


def test_bad_names_are_refused(tok):
    with pytest.raises(ValueError):
        W.make_workload("nope", tok)
    with pytest.raises(ValueError):
        W.high_variance(tok, size="huge")


# -- the driver on a stand-in engine (no model, a virtual clock: instant, exact timing) ------------
class ToyClock(VirtualClock):
    """The toy engine's clock: virtual seconds, like the simulator's. It records every wait
    the driver asks of it, as (from, until)."""

    def __init__(self):
        super().__init__()
        self.waits: list[tuple[float, float]] = []

    def advance_to(self, t):
        self.waits.append((self.now, t))
        super().advance_to(t)


class ToyEngine:
    """One token per running request per step; each step takes ``step_s`` on its clock.
    Times here are multiples of a power of two, so the clock's sums are exact."""

    def __init__(self, step_s=0.5, bounded=False):
        self.step_s = step_s
        self.time = self.clock = ToyClock()  # what the driver reads: ``clock``
        self.trace = Trace("toy", 4)
        self.bounded = bounded  # like a server's engine: few steps kept, done records dropped
        self.submitted_s: dict[str, float] = {}
        if bounded:
            self.trace.steps = collections.deque(maxlen=1000)
        self.live: dict[str, RequestRecord] = {}
        self.polled: set[str] = set()
        self.cancelled: list[str] = []
        self.idle_steps = collections.Counter()  # calls with nothing to do, by clock time

    def submit(self, prompt_ids, max_new_tokens, ignore_eos, temperature, request_id, arrival_s=None):
        assert ignore_eos is True
        self.submitted_s[request_id] = now = self.clock()
        rec = RequestRecord(
            request_id, len(prompt_ids), max_new_tokens, now if arrival_s is None else min(arrival_s, now)
        )
        self.trace.requests[request_id] = rec
        self.live[request_id] = rec
        return request_id

    def step(self):
        if self.bounded:  # forget what finished before this step
            for rid in [k for k, r in self.trace.requests.items() if r.finished_s is not None]:
                del self.trace.requests[rid]
        if not self.live:
            self.idle_steps[self.clock()] += 1  # a driver that does not wait would call on forever
            assert self.idle_steps[self.clock()] < 100, "the driver steps an idle engine instead of waiting"
            return False
        rec = StepRecord(len(self.trace.steps), self.clock())
        rec.passes = 1
        self.time.advance(self.step_s)
        now = self.clock()
        for rid, r in list(self.live.items()):
            r.token_times_s.append(now)
            r.output_ids.append(7)
            r.first_token_s = r.first_token_s or now
            rec.decoded.append(rid)
            if len(r.output_ids) == r.max_new_tokens:
                r.finished_s, r.finish_reason = now, "length"
                del self.live[rid]
        rec.end_s = self.clock()
        self.trace.steps.append(rec)
        return True

    def cancel(self, rid):
        r = self.live.pop(rid, None)
        if r is None:
            return False
        r.finished_s, r.finish_reason = self.clock(), "cancelled"
        self.cancelled.append(rid)
        return True


def toy_workload(arrivals, outputs):
    reqs = [W.WorkloadRequest(f"t{i}", [1, 2, 3], n, a) for i, (a, n) in enumerate(zip(arrivals, outputs))]
    return W.Workload("toy", "", reqs)


@pytest.mark.parametrize("clock", ["virtual", "real"])
def test_driver_submits_on_time_and_sleeps_when_idle(monkeypatch, clock):
    eng = ToyEngine(step_s=0.5)
    eng.submit([1], 1, True, 0.0, "old")  # an earlier run: not part of this run's trace
    eng.step()
    if clock == "real":  # a clock without advance_to: the driver sleeps, here on the toy clock
        eng.clock = lambda: eng.time()
        sleep = lambda s: eng.time.advance_to(eng.time() + s)  # noqa: E731
        monkeypatch.setattr(D, "time", SimpleNamespace(sleep=sleep))
    w = toy_workload([0.0, 0.0, 6.0, 0.75], [3, 2, 2, 4])
    t_start = eng.clock()
    tr = D.run_workload(eng, w, progress=False)
    assert set(tr.requests) == {"t0", "t1", "t2", "t3"}
    assert list(tr.requests) == ["t0", "t1", "t3", "t2"]  # in arrival order
    for r in w:
        rec = tr.requests[r.id]
        assert len(rec.token_times_s) == r.max_new_tokens
        due = rec.arrival_s  # the due time, not the submit time: arrivals keep their spacing
        assert due == t_start + r.arrival_s
        # submitted at or after due, and at most a step late
        assert due <= eng.submitted_s[r.id] <= due + eng.step_s
    # t3 (due 0.75) came while the second step ran: it was submitted when that step ended,
    # and its TTFT counts from 0.75, not from submission
    assert eng.submitted_s["t3"] == t_start + 1.0
    # between t3's end (3.0) and t2's arrival (6.0) the engine was idle: the driver waited
    # (here, once) until t2 was due, and stepped nothing
    t3_end, t2_due = tr.requests["t3"].finished_s, tr.requests["t2"].arrival_s
    assert (t3_end, t2_due) == (t_start + 3.0, t_start + 6.0)
    waits = eng.time.waits
    assert waits and waits[-1][1] == t2_due and all(t3_end <= a < b <= t2_due for a, b in waits)
    assert not [s for s in tr.steps if t3_end <= s.start_s < t2_due]
    assert tr.steps[0].index == 1 and all(s.start_s >= t_start for s in tr.steps)


def test_driver_timeout_cancels_what_is_still_running():
    eng = ToyEngine(step_s=0.5)
    tr = D.run_workload(eng, toy_workload([0.0, 0.0, 50.0], [2, 1000, 1]), progress=False, timeout_s=5.0)
    assert tr.requests["t0"].finish_reason == "length"
    assert tr.requests["t1"].finish_reason == "cancelled"
    # cancelled at the first look at the clock past the timeout, at the end of a step
    assert 5.0 < tr.requests["t1"].finished_s <= 5.0 + eng.step_s
    assert "t2" not in tr.requests  # never due before the timeout
    assert eng.cancelled == ["t1"]


def test_driver_works_with_an_engine_that_forgets_done_requests():
    eng = ToyEngine(step_s=0.01, bounded=True)
    eng.submit([1], 1, True, 0.0, "old")
    eng.step()
    tr = D.run_workload(eng, toy_workload([0.0, 0.0], [3, 2]), progress=False)
    eng.step()
    assert not eng.trace.requests  # the engine dropped the finished ones...
    assert [len(tr.requests[r].token_times_s) for r in ("t0", "t1")] == [3, 2]  # ...we did not
    assert len(tr.steps) == 3 and all("old" not in s.decoded for s in tr.steps)


def test_driver_stops_an_engine_that_steps_without_running_anything():
    class Stuck(ToyEngine):
        def step(self):  # "has work", runs nothing: a scheduler whose batches() yields nothing
            self.trace.steps.append(StepRecord(len(self.trace.steps), self.clock()))
            return True

    with pytest.raises(D.EngineStuck, match="stepped 50 times in a row without running"):
        D.run_workload(Stuck(), toy_workload([0.0], [3]), progress=False)


def test_driver_refuses_duplicate_ids():
    w = toy_workload([0, 0], [1, 1])
    w.requests[1].id = "t0"
    with pytest.raises(ValueError, match="unique"):
        D.run_workload(ToyEngine(), w, progress=False)


# -- the real engine ------------------------------------------------------------------------------
def test_quick_mixed_subset_on_a_real_continuous_engine(lm):
    w = W.mixed(lm).head(3).capped(6)
    eng = batchlab.make_engine("continuous", lm, max_batch_size=4)
    tr = D.run_workload(eng, w, progress=False)
    assert list(tr.requests) == [r.id for r in w]
    for r in w:
        rec = tr.requests[r.id]
        assert rec.finish_reason == "length"
        assert len(rec.output_ids) == len(rec.token_times_s) == r.max_new_tokens
        assert rec.prompt_len == r.prompt_len
    s = M.summarize(tr)
    assert s["completed"] == 3 and s["output_tokens"] == sum(w.output_lens)
    assert s["slot_occupancy"] == pytest.approx(eng.stats()["slot_occupancy"])
    assert 0 < s["scheduler_share"] < 1  # a share of step time: passes and the rest both timed
    # a second run on the same engine: its trace has only its own steps and requests
    w2 = W.Workload("again", "", [W.WorkloadRequest("late", w.requests[0].prompt_ids[:40], 2, 0.0)])
    tr2 = D.run_workload(eng, w2, progress=False)
    assert list(tr2.requests) == ["late"] and len(tr2.requests["late"].output_ids) == 2
    assert tr2.steps[0].index == len(tr.steps)


def test_speeds_measure_on_the_real_model(lm, monkeypatch):
    # what the speeds are is this machine's business (benchmarks/step_profile.py times
    # prefill and decode passes); what is checked is that they are read off the runs made
    traces, real_run = [], D.run_workload
    monkeypatch.setattr(D, "run_workload", lambda *a, **kw: traces.append(real_run(*a, **kw)) or traces[-1])
    sp = D.measure_speeds(lm, batch_size=2)
    decode, prefill = traces
    assert sp.decode_step_s == M.decode_step_s(decode, 2) > 0
    last = [s for s in prefill.steps if s.prefill][-1]
    assert sp.prefill_tokens_per_s == pytest.approx(256 / last.forward_s) and last.forward_s > 0


@pytest.mark.parametrize("length", [256, 520])
def test_speeds_measure_times_prefill_at_the_length_asked(tok, monkeypatch, length):
    # the fake model keeps this instant; what is checked is which prompt the rate comes from
    from batchlab.core import engine as E
    from batchlab.core.fake import FakeModel, FakeRunner

    fake = FakeModel(vocab_size=tok.vocab_size)
    real_make, real_run = E.make_engine, D.run_workload
    monkeypatch.setattr(
        D, "make_engine", lambda kind, lm, **kw: real_make(kind, fake, runner=FakeRunner, **kw)
    )
    traces = []
    monkeypatch.setattr(D, "run_workload", lambda *a, **kw: traces.append(real_run(*a, **kw)) or traces[-1])
    kwargs = {} if length == 256 else {"prefill_tokens": length}  # 256 is the default
    sp = D.measure_speeds(tok, batch_size=2, **kwargs)
    prefill = traces[-1]
    assert [r.prompt_len for r in prefill.requests.values()] == [length, length]
    last = [s for s in prefill.steps if s.prefill][-1]
    assert [n for _, _, n in last.prefill] == [length]
    assert sp.prefill_tokens_per_s == pytest.approx(length / last.forward_s)


# -- chat: the decode-heavy standard workload ------------------------------------------------
def test_chat_is_deterministic_real_prompts_and_long_high_variance_outputs(tok):
    a, b, c = W.chat(tok, seed=0), W.chat(tok, seed=0), W.make_workload("chat", tok, seed=1)
    assert fingerprint(a) == fingerprint(b) and a.prompt_lens != c.prompt_lens
    assert len(a) == 32 and len(W.chat(tok, size="full")) == 128
    for r in a:
        assert r.prompt_ids == tok.encode_chat(r.messages), r.id
        assert 40 <= len(r.prompt_ids) <= 128
    o = np.array(W.chat(tok, size="full").output_lens)
    assert o.min() >= 1 and o.max() <= 256
    # ceil(Exponential(72)) clipped at 256: mean about 71; over 128 draws within 20 %
    assert abs(o.mean() - 71) < 0.2 * 71
    assert 0.7 < o.std() / o.mean() < 1.3  # high variance: coefficient of variation near 1
    assert np.mean(a.output_lens) >= 64  # the bench's seed: answers average >= 64 tokens
    with pytest.raises(ValueError, match="size"):
        W.chat(tok, size="huge")


def test_the_driver_admits_a_request_due_at_a_rounded_virtual_time():
    """A virtual clock that starts at 0.7 and waits until 0.7 + 0.1 reads 0.8, and
    0.8 - 0.7 < 0.1 in floating point: the driver must still see the request as due (it
    once waited for that time forever)."""
    from batchlab.core.fake import FakeModel, FakeRunner

    clock = VirtualClock(0.7)
    engine = batchlab.make_engine("continuous", FakeModel(), runner=FakeRunner, clock=clock)
    wl = W.Workload("rounded", "one request due at 0.1 s", [W.WorkloadRequest("r", [1, 2, 3], 2, 0.1)])
    trace = D.run_workload(engine, wl, progress=False, max_idle_steps=5)
    assert trace.requests["r"].finish_reason == "length"


# -- echo: the answer is in the prompt (speculative decoding by prompt lookup) ---------------------
def test_echo_asks_for_a_passage_of_the_corpus_back_and_has_room_to_echo_it(tok):
    a = W.make_workload("echo", tok, size="full")
    assert fingerprint(a) == fingerprint(W.echo(tok, size="full"))
    assert len(a) == 16 and all(48 <= n <= 64 for n in a.output_lens) and set(a.arrivals) == {0.0}
    assert len(W.echo(tok)) == 8 and all(16 <= n <= 24 for n in W.echo(tok).output_lens)
    paragraphs = W.corpus_paragraphs()
    instructions = set()
    for r in a:
        assert r.prompt_ids == tok.encode_chat(r.messages) and 112 <= r.prompt_len <= 160
        instruction, text = r.messages[0]["content"].split("\n\n", 1)
        instructions.add(instruction)
        first = text.split("\n\n")[0]
        assert any(first in p for p in paragraphs), r.id  # real text, from the shipped corpus
        assert len(tok.encode(text)) > r.max_new_tokens, r.id  # the whole answer can be an echo
    assert instructions == set(W.ECHO_INSTRUCTIONS)
    assert "prompt lookup" in W.echo.__doc__
    with pytest.raises(ValueError, match="size"):
        W.echo(tok, size="huge")


# -- structured: each answer must be a JSON record of one schema (structured output) ------------
@pytest.fixture(scope="module")
def text():
    """The course model's tokenizer alone (no model: this tier runs without it)."""
    from batchlab.model.load import load_tokenizer

    return load_tokenizer()


def test_structured_asks_for_a_json_record_of_a_passage_and_carries_its_schema(text):
    import json

    import jsonschema

    from batchlab.core.structured import StructuredOutputs, compile_constraint

    a = W.make_workload("structured", text, size="full")
    assert fingerprint(a) == fingerprint(W.structured(text, size="full"))
    assert len(a) == 16 and set(a.output_lens) == {96} and set(a.arrivals) == {0.0}
    quick = W.structured(text)
    assert len(quick) == 8 and set(quick.output_lens) == {64}
    assert W.structured(text, num_requests=3, max_new_tokens=20).output_lens == [20] * 3
    paragraphs = W.corpus_paragraphs()
    for r in a:
        assert r.structured_outputs == {"json": W.STRUCTURED_SCHEMA}, r.id
        assert r.prompt_ids == text.encode_chat(r.messages) and 64 <= r.prompt_len <= 112
        instruction, passage = r.messages[0]["content"].split("\n\n", 1)
        assert instruction == W.STRUCTURED_INSTRUCTION
        assert any(passage.split("\n\n")[0] in p for p in paragraphs), r.id  # real text, shipped
    # the schema is a JSON Schema that jsonschema reads, and says what the instruction asks
    jsonschema.Draft202012Validator.check_schema(W.STRUCTURED_SCHEMA)
    record = {"title": "Lambdas", "topic": "Python", "keywords": ["lambda", "expression"], "sentences": 3}
    jsonschema.validate(record, W.STRUCTURED_SCHEMA)
    for wrong in (
        {**record, "author": "me"},  # nothing else
        {k: v for k, v in record.items() if k != "topic"},  # every field
        {**record, "keywords": ["k"] * 6},  # up to 5 keywords
        {**record, "keywords": ["k" * 25]},  # each at most 24 characters
        {**record, "title": "t" * 61},
        {**record, "sentences": 101},
        {**record, "sentences": "3"},
    ):
        assert not jsonschema.Draft202012Validator(W.STRUCTURED_SCHEMA).is_valid(wrong), wrong
    # ...and the engine's grammar library compiles it for this tokenizer
    compile_constraint(StructuredOutputs(**a.requests[0].structured_outputs), text)
    json.dumps(a.requests[0].structured_outputs)  # vLLM's form: plain JSON, as a server gets it
    free = a.without_constraints()
    assert all(r.structured_outputs is None for r in free) and fingerprint(free) == fingerprint(a)
    assert all(r.structured_outputs is not None for r in a)  # the original is left alone
    with pytest.raises(ValueError, match="size"):
        W.structured(text, size="huge")


def test_shared_prefix_shares_the_system_prompt_and_asks_distinct_questions(tok):
    """Lesson 8's workload: one system prompt for all, no two questions the same (two paragraphs
    of the text can open with the same sentence: seed 0 drew such a pair once)."""
    for seed in range(3):
        w = W.shared_prefix(tok, num_requests=32, seed=seed)
        systems = {r.messages[0]["content"] for r in w}
        questions = [r.messages[1]["content"] for r in w]
        assert len(systems) == 1 and len(set(questions)) == len(questions) == 32
        assert len({tuple(r.prompt_ids) for r in w}) == 32
    with pytest.raises(ValueError, match="num_requests: at most"):
        W.shared_prefix(tok, num_requests=100_000)
