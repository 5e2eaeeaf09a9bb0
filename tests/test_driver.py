"""driver.run_interleaved and metrics.median_range: engines timed side by side, fairly, on the
fake model (instant; the schedules are exact)."""

import pytest

from batchlab import make_engine
from batchlab.core import metrics
from batchlab.measurement import driver
from batchlab.measurement.driver import interleaved_order, run_interleaved, run_workload
from batchlab.core.fake import FakeModel, FakeRunner
from batchlab.core.trace import Trace
from batchlab.measurement.workloads import Workload, WorkloadRequest

LM = FakeModel()


@pytest.fixture(autouse=True)
def every_round(monkeypatch):
    """These tests count the rounds: the suite's cap on them (conftest) does not apply."""
    monkeypatch.delenv(driver.REPETITIONS_CAP, raising=False)


def test_the_rounds_can_be_capped_and_a_bad_cap_is_refused(monkeypatch):
    monkeypatch.setenv(driver.REPETITIONS_CAP, "1")
    assert driver.capped(3) == 1 and driver.capped(1) == 1
    traces = run_interleaved(
        {"x": lambda: make_engine("continuous", LM, runner=FakeRunner)}, small_workload(), 3
    )
    assert len(traces["x"]) == 1
    monkeypatch.setenv(driver.REPETITIONS_CAP, "5")
    assert driver.capped(3) == 3
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(driver.REPETITIONS_CAP, bad)
        with pytest.raises(ValueError, match="BATCHLAB_REPETITIONS"):
            driver.capped(3)


def small_workload(n=5, name="w"):
    return Workload(name, "", [WorkloadRequest(f"{name}-{i}", [1 + i, 2, 3, 4], 3 + i) for i in range(n)])


def recording(order, name, kind, **options):
    # a factory that notes when it is called, then makes a fresh fake engine
    def make():
        order.append(name)
        return make_engine(kind, LM, runner=FakeRunner, **options)

    return make


def test_runs_are_interleaved_one_trace_per_repetition():
    order = []
    engines = {
        "static": recording(order, "static", "static", max_batch_size=4),
        "continuous": recording(order, "continuous", "continuous", max_batch_size=4),
        "sequential": recording(order, "sequential", "sequential"),
    }
    traces = run_interleaved(engines, small_workload(), repetitions=3)
    assert order == ["static", "continuous", "sequential"] * 3  # A B C A B C A B C, not A A A B B B
    assert list(traces) == list(engines)
    for name, runs in traces.items():
        assert len(runs) == 3
        assert all(isinstance(t, Trace) for t in runs)
        assert len({id(t) for t in runs}) == 3  # a fresh engine (and trace) every round
        assert all(len(t.requests) == 5 and metrics.completed_requests(t) == 5 for t in runs)
    # the same engine on the same workload: the same schedule in every round
    plan = [[(s.prefill, s.decoded) for s in t.steps] for t in traces["continuous"]]
    assert plan[0] == plan[1] == plan[2]
    assert plan[0] != [[(s.prefill, s.decoded) for s in t.steps] for t in traces["static"]][0]


def test_a_workload_per_engine_and_a_peer_that_runs_itself():
    order = []
    big, small = small_workload(6, "big"), small_workload(2, "small")
    reference = run_workload(make_engine("sequential", LM, runner=FakeRunner), small, progress=False)

    def peer():  # e.g. mlx-lm's BatchGenerator: not an engine of ours, it returns its trace
        order.append("peer")
        return reference

    traces = run_interleaved(
        {"continuous": recording(order, "continuous", "continuous", max_batch_size=2), "peer": peer},
        {"continuous": big, "peer": small},
        repetitions=2,
    )
    assert order == ["continuous", "peer"] * 2
    assert all(set(t.requests) == {r.id for r in big} for t in traces["continuous"])
    assert traces["peer"] == [reference, reference]


def test_refuses_what_it_cannot_run():
    make = recording([], "x", "sequential")
    with pytest.raises(ValueError, match="repetitions"):
        run_interleaved({"x": make}, small_workload(), repetitions=0)
    with pytest.raises(ValueError, match="no workload for 'y'"):
        run_interleaved({"x": make, "y": make}, {"x": small_workload()})
    with pytest.raises(ValueError, match="no engines"):
        run_interleaved({}, small_workload())


def test_an_engine_that_fails_stops_the_rounds():
    order = []

    def broken():
        order.append("broken")
        raise RuntimeError("no model")

    with pytest.raises(RuntimeError, match="no model"):
        run_interleaved({"ok": recording(order, "ok", "sequential"), "broken": broken}, small_workload())
    assert order == ["ok", "broken"]


def test_median_range():
    traces = run_interleaved(
        {"continuous": lambda: make_engine("continuous", LM, runner=FakeRunner, max_batch_size=4)},
        small_workload(),
        repetitions=3,
    )["continuous"]
    steps = [len(t.steps) for t in traces]
    assert metrics.median_range(traces, "steps") == (float(steps[0]), (float(steps[0]),) * 2)
    values = iter([3.0, 1.0, 2.0])
    assert metrics.median_range(traces, lambda t: next(values)) == (2.0, (1.0, 3.0))
    values = iter([None, 5.0, 1.0])  # undefined runs are left out
    assert metrics.median_range(traces, lambda t: next(values)) == (3.0, (1.0, 5.0))
    assert metrics.median_range(traces, lambda t: None) == (None, None)
    assert metrics.median_range([], "steps") == (None, None)


def test_ranges_overlap():
    assert metrics.ranges_overlap((1.0, 2.0), (2.0, 3.0))
    assert metrics.ranges_overlap((1.0, 5.0), (2.0, 3.0))
    assert not metrics.ranges_overlap((1.0, 2.0), (2.5, 3.0))
    assert not metrics.ranges_overlap((2.5, 3.0), (1.0, 2.0))
    assert not metrics.ranges_overlap(None, (1.0, 2.0))


def test_interleaved_order_is_rounds_of_every_name_in_order():
    """The one interleaving that run_interleaved, the bench and the micro-benchmarks use."""
    names = (n for n in "abc")  # any iterable, read once
    assert list(interleaved_order(names, 2)) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    assert list(interleaved_order({"x": 1, "y": 2}, 1)) == [(0, "x"), (0, "y")]
    assert list(interleaved_order("ab", 0)) == []


def test_after_step_lets_clients_poll_and_cancel_between_steps():
    """``after_step(engine, records)`` runs after every step: a client polling every request
    drains exactly the trace's tokens, and one cancelling a running request and a queued one
    ends them both as "cancelled" (the queued one never starts)."""
    lm = FakeModel(vocab_size=32, max_seq_len=256)
    reqs = [WorkloadRequest(f"r{i}", [1, 2, 3, 4], 6) for i in range(3)]
    polled, polls, cancelled = {}, [0], []

    def clients(engine, records):
        for rid, rec in records.items():
            if polled.get(rid, (None, "running"))[1] != "running":
                continue
            tokens, status, _ = engine.poll(rid)
            polls[0] += 1
            polled[rid] = (polled.get(rid, ([], ""))[0] + tokens, status)
            if (rid == "r0" and len(polled[rid][0]) >= 2 or rid == "r2") and engine.cancel(rid):
                cancelled.append(rid)

    engine = make_engine("continuous", lm, runner=FakeRunner, max_batch_size=2)
    trace = run_workload(engine, Workload("w", "", reqs), progress=False, after_step=clients)
    assert sorted(cancelled) == ["r0", "r2"] and polls[0] >= len(trace.steps)
    assert {rid: r.finish_reason for rid, r in trace.requests.items()} == {
        "r0": "cancelled",
        "r1": "length",
        "r2": "cancelled",
    }
    assert trace.requests["r2"].first_token_s is None and len(trace.requests["r0"].output_ids) == 2
    assert all(polled[rid] == (r.output_ids, "done") for rid, r in trace.requests.items())


def test_an_idle_engine_skips_to_the_next_arrival_instead_of_sleeping(monkeypatch):
    """Requests an hour apart on a real engine: while it is idle, its ``EngineClock`` jumps to
    the next arrival (the driver never sleeps), and every request is still submitted when due,
    on the engine's clock, with its tokens and timestamps in order after it."""

    def no_sleep(seconds):
        raise AssertionError(f"the driver slept {seconds:.1f} s on an idle engine")

    monkeypatch.setattr(driver.time, "sleep", no_sleep)
    hour = 3600.0
    reqs = [WorkloadRequest(f"r{i}", [1, 2, 3, 4], 3, arrival_s=i * hour) for i in range(3)]
    engine = make_engine("continuous", LM, runner=FakeRunner, max_batch_size=2)
    trace = run_workload(engine, Workload("w", "", reqs), progress=False)
    t0 = trace.steps[0].start_s
    for i, r in enumerate(reqs):
        rec = trace.requests[r.id]
        assert rec.arrival_s == pytest.approx(t0 + i * hour, abs=1.0), (r.id, rec.arrival_s - t0)
        assert rec.arrival_s <= rec.first_token_s <= rec.finished_s < rec.arrival_s + hour
        assert rec.finish_reason == "length" and len(rec.output_ids) == 3
    assert engine.clock() >= 2 * hour  # the engine's own time (0 when made) went past the last arrival
    assert engine.scheduler.clock is engine.clock


def test_a_constrained_request_is_submitted_with_its_constraint_and_eos_honoured():
    """A request with ``structured_outputs`` goes to ``submit`` with them and without
    ``ignore_eos`` (its answer ends at EOS once complete); one without is submitted as always,
    EOS ignored, unless the run asks ``stop_at_eos``. On the adversarial fake model (EOS its
    favourite token, every other choice random) the constrained answers are JSON of their
    schema, by jsonschema; the free request runs its full length, or stops at once at EOS."""
    import json

    import jsonschema

    from batchlab.core.fake import AdversarialRunner
    from batchlab.model.load import load_tokenizer

    tok = load_tokenizer()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "w": {"enum": ["a", "b"]}},
        "required": ["n", "w"],
        "additionalProperties": False,
    }
    spec = {"json": schema}
    reqs = [
        WorkloadRequest("json-0", tok.encode("Give me a record."), 40, structured_outputs=spec),
        WorkloadRequest("free", tok.encode("Say anything."), 6),
        WorkloadRequest("json-1", tok.encode("Another record, please."), 40, structured_outputs=spec),
    ]
    for stop_at_eos in (False, True):
        engine = make_engine("stallfree", FakeModel(text=tok), runner=AdversarialRunner, max_batch_size=4)
        calls, submit = {}, engine.submit

        def recording(prompt_ids, request_id=None, **params):
            calls[request_id] = params
            return submit(prompt_ids, request_id=request_id, **params)

        engine.submit = recording
        trace = run_workload(engine, Workload("w", "", reqs), progress=False, stop_at_eos=stop_at_eos)
        for rid in ("json-0", "json-1"):
            assert calls[rid]["ignore_eos"] is False and calls[rid]["structured_outputs"] == spec
            rec = trace.requests[rid]
            assert rec.finish_reason == "stop" and rec.output_ids[-1] in tok.eos_token_ids
            text = tok.decode([t for t in rec.output_ids if t not in tok.eos_token_ids])
            jsonschema.validate(json.loads(text), schema)
        assert "structured_outputs" not in calls["free"]
        assert calls["free"]["ignore_eos"] is (not stop_at_eos)
        free = trace.requests["free"]
        if stop_at_eos:  # EOS is the model's favourite: the free answer is EOS alone
            assert (free.finish_reason, len(free.output_ids)) == ("stop", 1)
        else:
            assert (free.finish_reason, len(free.output_ids)) == ("length", 6)


def test_priorities_for_some_requests_leave_the_others_at_zero():
    """Lesson 8's "Going further" gives priorities to a few requests only: the rest submit at 0."""
    work = small_workload()
    first = work.requests[0].id
    engine = make_engine("continuous", LM, runner=FakeRunner, max_batch_size=2)
    trace = run_workload(engine, work, progress=False, priorities={first: 3})
    assert len(trace.requests) == len(work.requests)
    assert trace.requests[first].priority == 3
    assert {r.priority for rid, r in trace.requests.items() if rid != first} == {0}
