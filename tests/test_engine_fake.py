"""Scheduler and engine logic on the fake model: fast, and exact answers known."""

import random
import re
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from kinds import kind_configs
from waiting import happens_within, wait_for

from batchlab import EngineLoop, make_engine
from batchlab.core.engine import EngineFailing
from batchlab.core.fake import FakeModel, FakeRunner, reference_output, sequence_hash
from batchlab.core.request import SamplingParams, State

LM = FakeModel()
EOS = frozenset({LM.eos_id})


def workload(n, seed, prompt_range=(5, 300), new_range=(1, 64)):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(1, LM.vocab_size) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*new_range),
        )
        for _ in range(n)
    ]


def fake_engine(kind, **options):
    return make_engine(kind, LM, runner=FakeRunner, **options)


CONFIGS = kind_configs()  # every kind with every combination of its options' examples


def run_all(engine, requests):
    ids = [engine.submit(p, max_new_tokens=m) for p, m in requests]
    engine.run_until_idle()
    return ids, [engine.poll(i) for i in ids]


@pytest.mark.parametrize("kind,options", CONFIGS, ids=[f"{k}-{o}" for k, o in CONFIGS])
def test_every_kind_produces_the_reference_tokens(kind, options):
    requests = workload(20, seed=1)
    engine = fake_engine(kind, **options)
    _, results = run_all(engine, requests)
    ends_on_eos = 0
    for (prompt, max_new), (tokens, status, reason) in zip(requests, results):
        expected = reference_output(prompt, max_new, LM.vocab_size, EOS)
        assert tokens == expected
        assert status == "done"
        assert reason == ("stop" if expected[-1] in EOS else "length")
        ends_on_eos += reason == "stop"
    assert ends_on_eos > 0, "the workload should exercise EOS endings"
    check_trace_invariants(engine, options)
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks, (
        "every KV block is returned"
    )


def check_trace_invariants(engine, options):
    trace = engine.trace
    emitted = {rid: [] for rid in trace.requests}
    emitting_steps = {rid: [] for rid in trace.requests}  # the steps that gave it tokens
    decode_steps = {rid: [] for rid in trace.requests}
    for step in trace.steps:
        held = [s for s in step.slots if s is not None]
        assert len(held) == len(set(held)), f"step {step.index}: a request holds two slots"
        assert len(step.decoded) == len(set(step.decoded)), "a request decoded twice in a step"
        for rid, tokens in step.emitted.items():
            emitted[rid] += tokens
            emitting_steps[rid].append(step.index)
        for rid in step.decoded:
            decode_steps[rid].append(step.index)
        if engine.trace.kind == "stallfree":
            assert step.num_tokens <= options["token_budget"], f"step {step.index} over budget"
            assert step.passes == 1, "a stall-free step is one forward pass"
    for rid, record in trace.requests.items():
        assert emitted[rid] == record.output_ids, f"{rid}: tokens not emitted once and in order"
        steps, made = decode_steps[rid], emitting_steps[rid]
        # Once decoding, a request decodes in every step until it finishes: nobody stalls. In a
        # stall-free trace decoding starts the step after its first token (its prefill held a
        # slot); lesson 2's phases may leave a prefilled request waiting for a slot.
        first = made[0] + 1 if engine.trace.kind == "stallfree" else steps[0] if steps else made[-1] + 1
        assert steps == list(range(first, made[-1] + 1)), f"{rid}: tokens in steps {made}, rows in {steps}"


def test_stallfree_decodes_never_skip_a_step_while_a_long_prompt_prefills():
    engine = fake_engine("stallfree", max_batch_size=4, token_budget=16)
    short = [engine.submit([5] * 8, max_new_tokens=40, ignore_eos=True) for _ in range(3)]
    engine.step()
    engine.step()
    engine.submit(list(range(1, 60)) * 5, max_new_tokens=4)  # 295 prompt tokens
    engine.run_until_idle()
    prefill_steps = [s for s in engine.trace.steps if s.prefill and s.index > 2]
    assert len(prefill_steps) >= 295 // 16
    for step in prefill_steps:
        running = [
            r
            for r in short
            if r in step.slots
            and engine.trace.requests[r].finished_s
            and engine.trace.requests[r].finished_s >= step.end_s
        ]
        assert set(running) <= set(step.decoded)


def test_static_batch_keeps_finished_rows_as_padding_and_admits_nobody_midway():
    engine = fake_engine("static", max_batch_size=2)
    engine.submit([3] * 10, max_new_tokens=2, ignore_eos=True)
    b = engine.submit([4] * 10, max_new_tokens=6, ignore_eos=True)
    c = engine.submit([6] * 10, max_new_tokens=1, ignore_eos=True)
    engine.run_until_idle()
    steps = engine.trace.steps
    first_c = next(s.index for s in steps if any(p[0] == c for p in s.prefill))
    last_b = max(s.index for s in steps if b in s.decoded)
    assert first_c > last_b, "c must wait for the whole first batch"
    assert sum(len(s.padding) for s in steps) == 4  # a sat idle for 4 of b's decode steps
    assert engine.stats()["padding_rows"] == 4


def test_continuous_refills_a_slot_as_soon_as_it_frees():
    engine = fake_engine("continuous", max_batch_size=1)
    a = engine.submit([3] * 4, max_new_tokens=3, ignore_eos=True)
    b = engine.submit([4] * 4, max_new_tokens=3, ignore_eos=True)
    engine.run_until_idle()
    rec = engine.trace.requests
    # b is prefilled while a decodes, waits for the slot, and takes it the step a leaves.
    assert "awaiting_slot" in [s for _, s in rec[b].state_times]
    a_done = next(s.index for s in engine.trace.steps if a in s.finished)
    b_first_decode = next(s.index for s in engine.trace.steps if b in s.decoded)
    assert b_first_decode == a_done + 1


CANCEL_CASES = [
    ("continuous", {"max_batch_size": 1, "prefill_step": 2}, State.QUEUED),
    ("continuous", {"max_batch_size": 1, "prefill_step": 2}, State.PREFILLING),
    ("continuous", {"max_batch_size": 1, "prefill_step": 2}, State.AWAITING_SLOT),
    ("continuous", {"max_batch_size": 1, "prefill_step": 2}, State.DECODING),
    ("stallfree", {"max_batch_size": 2, "token_budget": 3}, State.QUEUED),
    ("stallfree", {"max_batch_size": 2, "token_budget": 3}, State.PREFILLING),
    ("stallfree", {"max_batch_size": 2, "token_budget": 3}, State.DECODING),
    ("static", {"max_batch_size": 2}, State.QUEUED),
    ("static", {"max_batch_size": 2}, State.DECODING),
]


@pytest.mark.parametrize(
    "kind,options,state", CANCEL_CASES, ids=[f"{k}-{s.value}" for k, _, s in CANCEL_CASES]
)
def test_cancel_in_every_state_frees_everything_and_spares_the_others(kind, options, state):
    engine = fake_engine(kind, **options)
    keep = engine.submit([7] * 12, max_new_tokens=12, ignore_eos=True)
    victims = [engine.submit([8 + i] * 12, max_new_tokens=12, ignore_eos=True) for i in range(3)]
    engine.step()
    target = None
    for _ in range(100):
        states = {r.id: r.state for r in [*engine.scheduler.queue, *engine.scheduler.running]}
        target = next((r for r in victims if states.get(r) is state), None)
        if target or not engine.step():
            break
    assert target is not None, f"no request ever reached {state.value}"
    assert engine.cancel(target) is True
    assert engine.cancel(target) is False, "a second cancel does nothing"
    assert engine.poll(target)[1:] == ("done", "cancelled")
    engine.run_until_idle()
    tokens, status, reason = engine.poll(keep)
    assert (status, reason) == ("done", "length")
    assert tokens == reference_output([7] * 12, 12, LM.vocab_size, frozenset())
    for rid in victims:
        if rid != target:
            assert engine.poll(rid)[1:] == ("done", "length")
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
    assert engine.scheduler.slots == [None] * engine.scheduler.max_batch_size
    assert engine.cancel("no-such-id") is False


def test_a_stop_string_ends_a_request_as_a_completed_stop_not_a_cancel():
    """The server meets stop strings (the engine sees only tokens) and says so with
    ``stop_string_met``: the request ends as "stop" in its poll, its trace and the metrics,
    counts as completed and in goodput, and frees its slot and blocks; a cancel stays 'cancelled'."""
    from batchlab.core import metrics

    engine = fake_engine("stallfree", max_batch_size=2, token_budget=16)
    stopped, cancelled, plain = (
        engine.submit([5 + i] * 8, max_new_tokens=20, ignore_eos=True) for i in range(3)
    )
    for _ in range(4):
        engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["queued"] == 1, "running: admitted, not queued"
    assert engine.stop_string_met(stopped) is True
    assert engine.stop_string_met(stopped) is False and engine.stop_string_met("no-such-id") is False
    assert engine.cancel(cancelled) is True
    engine.run_until_idle()
    assert engine.poll(stopped)[1:] == ("done", "stop")
    assert engine.poll(cancelled)[1:] == ("done", "cancelled")
    assert engine.poll(plain)[1:] == ("done", "length")
    records = engine.trace.requests
    assert (records[stopped].finish_reason, records[cancelled].finish_reason) == ("stop", "cancelled")
    assert metrics.completed_requests(engine.trace) == 2, "the stopped and the plain one; not the cancel"
    loose = metrics.SLO(ttft_s=1e9, max_tbt_s=1e9)
    assert metrics.goodput(engine.trace, loose)["good_requests"] == 2
    assert engine.stats()["finished"] == {"stop": 1, "cancelled": 1, "length": 1}
    assert engine.stats()["running"] == 0
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


def test_completed_requests_count_answers_only():
    """'shed' and 'error' are not completed, like 'cancelled'; 'stop' and 'length' are."""
    from batchlab.core import metrics
    from batchlab.core.trace import RequestRecord, Trace

    reasons = ["stop", "length", "cancelled", "shed", "error", None]
    records = {}
    for i, reason in enumerate(reasons):
        r = RequestRecord(f"r{i}", prompt_len=3, max_new_tokens=4, arrival_s=0.0)
        r.finished_s, r.finish_reason = (None, None) if reason is None else (1.0, reason)
        records[r.id] = r
    assert metrics.completed_requests(Trace("t", 2, [], records)) == 2


def test_poll_drains_once_then_forgets():
    engine = fake_engine("continuous", max_batch_size=2)
    rid = engine.submit([1, 2, 3], max_new_tokens=5, ignore_eos=True)
    engine.step()
    first, status, _ = engine.poll(rid)
    # one step = the prefill (samples token 1), placement, and a decode pass (token 2)
    assert status == "running" and len(first) == 2
    assert engine.poll(rid)[0] == []
    engine.run_until_idle()
    rest, status, reason = engine.poll(rid)
    assert first + rest == reference_output([1, 2, 3], 5, LM.vocab_size, frozenset())
    assert (status, reason) == ("done", "length")
    assert engine.poll(rid) == ([], "unknown", None)


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(prompt_ids=[]), "empty"),
        (dict(prompt_ids="hello"), "token ids"),
        (dict(prompt_ids=[1, 2, 10_000]), "[0, 64)"),
        (dict(prompt_ids=[1] * 4096), "maximum sequence length is 4096"),
        (dict(prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
        (dict(prompt_ids=[1], temperature=-1.0), "temperature"),
        (dict(prompt_ids=[1], top_p=0.0), "top_p"),
        (dict(prompt_ids=[1], top_p=1.5), "top_p"),
        (dict(prompt_ids=[1], top_k=-2), "top_k"),
        (dict(prompt_ids=[1], seed=-1), "seed"),
    ],
)
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(bad, message):
    engine = fake_engine("stallfree", max_batch_size=2, token_budget=8)
    good = engine.submit([9, 9], max_new_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        engine.submit(**bad)
    engine.run_until_idle()
    assert engine.poll(good)[0] == reference_output([9, 9], 4, LM.vocab_size, frozenset())


def test_max_new_tokens_is_cut_at_the_maximum_sequence_length():
    engine = make_engine("continuous", LM, runner=FakeRunner, max_seq_len=20)
    rid = engine.submit([1] * 15, max_new_tokens=100, ignore_eos=True)
    engine.run_until_idle()
    tokens, _, reason = engine.poll(rid)
    assert len(tokens) == 5 and reason == "length"


def test_a_request_larger_than_the_kv_pool_is_refused():
    engine = fake_engine("continuous", max_batch_size=2, num_kv_blocks=4, kv_block_size=4)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        engine.submit([1] * 10, max_new_tokens=10)


def test_requests_wait_for_kv_blocks_instead_of_failing():
    engine = fake_engine("stallfree", max_batch_size=4, token_budget=8, num_kv_blocks=4, kv_block_size=4)
    ids = [engine.submit([i + 1] * 6, max_new_tokens=6, ignore_eos=True) for i in range(3)]
    engine.run_until_idle()
    for i, rid in enumerate(ids):
        assert engine.poll(rid)[0] == reference_output([i + 1] * 6, 6, LM.vocab_size, frozenset())
    assert max(s.kv_blocks_used for s in engine.trace.steps) <= 4


@pytest.mark.parametrize(
    "kind,options,message",
    [
        ("turbo", {}, "unknown engine kind"),
        ("sequential", {"max_batch_size": 4}, "max_batch_size does not apply"),
        ("static", {"prefill_step": 16}, "prefill_step does not apply"),
        ("continuous", {"token_budget": 64}, "token_budget does not apply"),
        ("stallfree", {"prefill_step": 16}, "prefill_step does not apply"),
        ("stallfree", {"max_batch_size": 8, "token_budget": 4}, "token_budget must be"),
        ("continuous", {"prefill_step": 0}, "prefill_step must be"),
        ("static", {"max_batch_size": 0}, "max_batch_size must be"),
    ],
)
def test_make_engine_rejects_options_that_do_not_apply(kind, options, message):
    with pytest.raises(ValueError, match=message):
        fake_engine(kind, **options)


def _client(
    loop, seed, results, errors, cancels, count=6, long=400, tokens_before_cancel=1, vocab=LM.vocab_size
):
    """Submit ``count`` requests one after another and read each to its end; a third are
    cancelled at once, a third once ``tokens_before_cancel`` tokens have arrived (both
    ``long`` enough not to have finished first)."""
    rng = random.Random(seed)
    try:
        for k in range(count):
            how = ("keep", "at once", "after a token")[k % 3]
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 40))]
            max_new = rng.randint(1, 20) if how == "keep" else long
            rid = loop.submit(prompt, max_new_tokens=max_new)
            got = []
            if how == "at once":
                cancels.append(loop.cancel(rid))
            while True:
                tokens, status, reason = loop.poll(rid)
                got += tokens
                if how == "after a token" and len(got) >= tokens_before_cancel:
                    cancels.append(loop.cancel(rid))
                    how = "keep"
                if status == "done":
                    break
                time.sleep(0.0005)
            results[rid] = (prompt, max_new, got, reason)
    except Exception as e:  # surfaced by the test
        errors.append(e)


def _check_results(results, cancels):
    cancelled = 0
    for prompt, max_new, got, reason in results.values():
        expected = reference_output(prompt, max_new, LM.vocab_size, EOS)
        if reason == "cancelled":
            cancelled += 1
            assert got == expected[: len(got)], "a cancelled stream is a prefix of the answer"
        else:
            assert got == expected
    assert cancelled == sum(cancels) and cancelled > 0, (cancelled, cancels)


def test_concurrent_clients_lose_and_duplicate_nothing():
    engine = fake_engine("stallfree", max_batch_size=4, token_budget=32)
    results, errors, cancels = {}, [], []
    with EngineLoop(engine) as loop:
        threads = [
            threading.Thread(target=_client, args=(loop, s, results, errors, cancels)) for s in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a client hangs"
    assert not errors
    assert len(results) == 48
    _check_results(results, cancels)
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


@pytest.mark.parametrize(
    "kind,options", [("stallfree", {"token_budget": 24}), ("continuous", {"prefill_step": 8})]
)
def test_stress_readers_while_the_loop_serves_preempts_and_cancels(kind, options):
    """Thread discipline: while the loop serves many clients in a KV pool small enough to
    preempt, with cancels, other threads read ``stats()`` and ``queue_depth()`` without
    pause. Every read succeeds and is consistent, every output is right, every block comes
    back, and the run really preempted (a stress test that saw no preemption fails)."""
    engine = fake_engine(kind, max_batch_size=4, num_kv_blocks=16, kv_block_size=8, **options)
    results, errors, cancels, reads, read_errors = {}, [], [], [0], []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                stats = engine.stats()
                depth = engine.queue_depth()
                assert 0 <= stats["free_kv_blocks"] <= stats["num_kv_blocks"] == 16
                assert stats["queued"] >= 0 and depth >= 0
                reads[0] += 1
            except Exception as e:
                read_errors.append(e)
                return

    with EngineLoop(engine) as loop:
        readers = [threading.Thread(target=reader) for _ in range(2)]
        clients = [
            threading.Thread(target=_client, args=(loop, 100 + s, results, errors, cancels, 6, 80, 40))
            for s in range(6)
        ]
        for t in readers + clients:
            t.start()
        for t in clients:
            t.join(timeout=120)
        stop.set()
        for t in readers:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in clients + readers), "a thread hangs"
    assert not errors and not read_errors, (errors, read_errors)
    assert reads[0] > 0
    assert len(results) == 36
    _check_results(results, cancels)
    assert engine.scheduler.num_preemptions > 0, "the pool never ran short: nothing was stressed"
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.queue


def test_engine_loop_sleeps_when_idle_and_stops_cleanly():
    engine = fake_engine("continuous", max_batch_size=2)
    calls = []  # the thread of each call to step: a loop that polls an idle engine calls it on and on
    real_step = engine.step
    engine.step = lambda: calls.append(threading.current_thread()) or real_step()
    loop = EngineLoop(engine).start()
    wait_for(lambda: calls, 30, "the loop's first step")
    thread = calls[0]
    assert thread is not threading.current_thread() and thread.is_alive()
    # Nothing to do: the loop must now wait to be woken. Showing that nothing happens takes a
    # bounded wait; a loop that spins calls step again within microseconds and fails at once.
    assert not happens_within(lambda: len(calls) > 1, 0.2), "an idle loop must not call step again"
    assert not engine.trace.steps, "an idle engine records no step"
    rid = loop.submit([1, 2], max_new_tokens=3, ignore_eos=True)
    done = []
    wait_for(lambda: done.append(loop.poll(rid)) or done[-1][1] == "done", 30, "the request finishing")
    assert done[-1][2] == "length" and len(engine.trace.steps) >= 1
    assert set(calls) == {thread}, "every step ran in the loop's thread"
    loop.stop()
    assert not thread.is_alive(), "stop returns once the loop's thread has ended"
    assert loop.error is None


class FailingRunner(FakeRunner):
    """A fake runner whose ``fail_on``-th pass (1-based) raises, like a broken kernel."""

    fail_on = 3

    def run(self, chunks):
        if len(self.passes) + 1 == self.fail_on:
            self.passes.append(chunks)
            raise RuntimeError("injected fault")
        return super().run(chunks)


def test_a_failed_pass_ends_its_requests_with_error_and_everyone_else_goes_on(caplog):
    engine = make_engine("continuous", LM, runner=FailingRunner, max_batch_size=2)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}
    for rid, prompt in prompts.items():
        engine.submit(prompt, max_new_tokens=6, ignore_eos=True, request_id=rid)
    with caplog.at_level("ERROR", logger="batchlab"):
        engine.run_until_idle()
    failed = engine.runner.passes[FailingRunner.fail_on - 1]
    victims = {c.req_id for c in failed}
    assert victims and victims < set(prompts), "the fault hit some requests, not all"
    for rid, prompt in prompts.items():
        tokens, status, reason = engine.poll(rid)
        if rid in victims:
            assert (status, reason) == ("done", "error")
        else:
            assert (tokens, status, reason) == (
                reference_output(prompt, 6, LM.vocab_size, frozenset()),
                "done",
                "length",
            )
    assert len([r for r in caplog.records if "forward pass" in r.getMessage()]) == 1
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
    assert engine.stats()["finished"]["error"] == len(victims)
    # the engine still serves, with the same answers as before
    again = engine.submit(prompts["a"], max_new_tokens=6, ignore_eos=True)
    engine.run_until_idle()
    assert engine.poll(again)[0] == reference_output(prompts["a"], 6, LM.vocab_size, frozenset())


class DecodeFailingRunner(FakeRunner):
    """A fake runner in which every pass that carries a decode row raises, as every masked
    pass did on the Mac path before its attention mask took the queries' dtype: a request's
    first token (from its prefill) comes, then nothing."""

    def run(self, chunks):
        if any(len(c.tokens) == 1 for c in chunks):
            raise ValueError("[scaled_dot_product_attention] Mask type must promote to output type")
        return super().run(chunks)


@pytest.mark.parametrize("kind", ["continuous", "stallfree"])
def test_an_engine_whose_passes_keep_failing_says_so_once(kind, caplog):
    engine = make_engine(kind, LM, runner=DecodeFailingRunner, max_batch_size=4)
    ids = [engine.submit([1 + i, 2, 3], max_new_tokens=6, ignore_eos=True) for i in range(6)]
    with caplog.at_level("WARNING", logger="batchlab"), pytest.raises(EngineFailing) as raised:
        engine.run_until_idle()
    assert "Mask type must promote" in str(raised.value) and "bug in the engine" in str(raised.value)
    said = [r.getMessage() for r in caplog.records if "failing" in r.getMessage()]
    assert len(said) == 1, said  # once, however many passes failed
    assert engine.passes_failed >= 2 and engine.passes_failed >= engine.passes_ok
    # nothing was lost before the error: every request has ended, with reason "error"
    assert {engine.poll(i)[1:] for i in ids} == {("done", "error")}
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


def test_one_failed_pass_among_many_is_not_a_failing_engine():
    engine = make_engine("continuous", LM, runner=FailingRunner, max_batch_size=2)
    for i in range(4):
        engine.submit([1 + i, 2, 3], max_new_tokens=6, ignore_eos=True)
    engine.run_until_idle()  # raises nothing: one pass of many failed
    assert engine.passes_failed == 1 and engine.failing is None


class Words(FakeModel):
    """The fake model, with a tokenizer that can write its answers (for the command line)."""

    @property
    def tokenizer(self):
        return SimpleNamespace(
            vocab_size=self.vocab_size,
            eos_token_ids=frozenset({self.eos_id}),
            decode=lambda ids, skip_special_tokens=False: " ".join(map(str, ids)),
        )


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--input", "{missing}"], "No such file"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--temperature", "nan"], "temperature"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_generate_refuses_bad_input_with_a_message_and_writes_nothing(tmp_path, monkeypatch, flags, says):
    from batchlab import cli

    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"id": "q", "prompt_ids": [1, 2, 3]}\n')
    monkeypatch.setattr("batchlab.model.load.load_model", lambda model=None: Words())
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(inputs), "--output", str(out), "--max-new-tokens", "4"]
    argv += [f.format(missing=tmp_path / "missing.jsonl") for f in flags]
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert says in str(stopped.value) and "batchlab generate" in str(stopped.value)
    assert not out.exists()


def test_generate_exits_nonzero_when_its_engine_is_failing(tmp_path, monkeypatch, capsys):
    from batchlab import cli
    from batchlab.core import engine as engine_module

    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(f'{{"id": "q{i}", "prompt_ids": [{i + 1}, 2, 3]}}\n' for i in range(4)))

    monkeypatch.setattr("batchlab.model.load.load_model", lambda model=None: Words())
    real = engine_module.make_engine
    monkeypatch.setattr(
        engine_module, "make_engine", lambda *a, **k: real(*a, runner=DecodeFailingRunner, **k)
    )
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(inputs), "--output", str(out), "--engine", "continuous"]
    status = cli.main(argv + ["--max-new-tokens", "5", "--ignore-eos"])
    assert status == 1
    assert "bug in the engine" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 4, "every answer is written before the error"


def _prompt_ending_early(within: int):
    """A prompt whose fake answer ends on EOS within ``within`` tokens."""
    rng = random.Random(5)
    while True:
        prompt = [rng.randrange(1, LM.vocab_size) for _ in range(6)]
        answer = reference_output(prompt, within, LM.vocab_size, EOS)
        if answer[-1] == LM.eos_id and len(answer) >= 2:
            return prompt, answer


@pytest.mark.parametrize("kind", ["sequential", "continuous", "stallfree"])
def test_min_new_tokens_keeps_stop_tokens_out_until_it_is_reached(kind):
    prompt, answer = _prompt_ending_early(6)
    engine = fake_engine(kind)
    rid = engine.submit(prompt, max_new_tokens=30, min_new_tokens=len(answer) + 4)
    engine.run_until_idle()
    tokens, status, reason = engine.poll(rid)
    assert tokens[: len(answer) - 1] == answer[:-1], "the same answer up to where EOS came"
    assert len(tokens) >= len(answer) + 4 and LM.eos_id not in tokens[: len(answer) + 4]
    assert reason == ("stop" if tokens[-1] == LM.eos_id else "length")


def test_stop_token_ids_end_a_request_also_past_eos():
    prompt, answer = _prompt_ending_early(6)
    longer = reference_output(prompt, 20, LM.vocab_size, frozenset())
    stop = longer[len(answer) + 2]
    engine = fake_engine("continuous")
    rid = engine.submit(prompt, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    engine.run_until_idle()
    assert engine.poll(rid) == (longer[: longer.index(stop) + 1], "done", "stop")


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 2.5}, "min_new_tokens"),
        ({"stop_token_ids": [LM.vocab_size]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ],
)
def test_bad_stop_settings_are_refused_and_change_nothing(bad, says):
    engine = fake_engine("continuous")
    with pytest.raises(ValueError, match=says):
        engine.submit([1, 2, 3], max_new_tokens=4, **bad)
    assert engine.queue_depth() == 0 and not engine.step()


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"max_new_tokens": 2.0}, "max_new_tokens"),
        ({"max_new_tokens": "8"}, "max_new_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"request_id": "taken"}, "already in use"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_serves_the_others(bad, says):
    engine = fake_engine("continuous", max_batch_size=2)
    kept = engine.submit([4, 5, 6], max_new_tokens=5, ignore_eos=True, request_id="taken")
    with pytest.raises(ValueError, match=says):
        engine.submit([1, 2, 3], **{"max_new_tokens": 4, **bad})
    engine.run_until_idle()
    assert engine.poll(kept) == (reference_output([4, 5, 6], 5, LM.vocab_size, frozenset()), "done", "length")
    assert engine.stats()["finished"] == {"length": 1}, "the refused request left nothing behind"


def _raising_planner(trigger_len):
    """The continuous kind, except that planning raises while a request with a ``trigger_len``-token
    prompt is running: a learner's planner with a bug that only one request shows."""
    from batchlab.core.scheduler import ContinuousScheduler

    class Raises(ContinuousScheduler):
        kind = "raises-on-one"

        def batches(self):
            if any(r.prompt_len == trigger_len for r in self.running):
                raise ZeroDivisionError("a planner's bug, shown by one request")
            yield from super().batches()

    return Raises


def test_a_step_whose_scheduler_raises_ends_what_it_held_and_leaves_the_engine_clean():
    engine = fake_engine(_raising_planner(7), max_batch_size=2)
    bystander = engine.submit([1, 2, 3], max_new_tokens=20, ignore_eos=True)
    engine.step()
    culprit = engine.submit([5] * 7, max_new_tokens=4, ignore_eos=True)
    queued = engine.submit([4, 4], max_new_tokens=3, ignore_eos=True)
    with pytest.raises(ZeroDivisionError):
        for _ in range(10):
            engine.step()
    assert isinstance(engine.contained, ZeroDivisionError)
    for rid in (bystander, culprit, queued):
        tokens, status, reason = engine.poll(rid)
        assert (status, reason) == ("done", "error"), rid
    s = engine.scheduler
    assert not s.running and not s.queue and all(slot is None for slot in s.slots)
    assert s.blocks.num_free == s.blocks.num_blocks
    assert engine.finished_by_reason.get("error") == 3
    after = engine.submit([9, 8, 7], max_new_tokens=5, ignore_eos=True)  # the engine serves on
    engine.run_until_idle()
    tokens, status, reason = engine.poll(after)
    assert (status, reason) == ("done", "length")
    assert tokens == reference_output([9, 8, 7], 5, LM.vocab_size, frozenset())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_engine_loop_serves_on_after_a_scheduler_error_but_not_after_its_own():
    engine = fake_engine(_raising_planner(7), max_batch_size=2)
    with EngineLoop(engine) as loop:
        culprit = loop.submit([5] * 7, max_new_tokens=4, ignore_eos=True)
        seen = []
        wait_for(lambda: seen.append(loop.poll(culprit)) or seen[-1][1] == "done", 30, "the culprit ending")
        assert seen[-1][2] == "error"
        later = loop.submit([3, 1, 4], max_new_tokens=6, ignore_eos=True)
        got = []
        wait_for(lambda: got.append(loop.poll(later)) or got[-1][1] == "done", 30, "a later request")
        assert got[-1][2] == "length" and sum((t for t, _, _ in got), []) == reference_output(
            [3, 1, 4], 6, LM.vocab_size, frozenset()
        )
        assert loop.error is None
    broken = fake_engine("continuous", max_batch_size=2)  # an error not contained by step ends the loop
    broken.step = lambda: (_ for _ in ()).throw(RuntimeError("the engine itself is broken"))
    loop = EngineLoop(broken).start()
    wait_for(lambda: loop.error is not None, 30, "the loop ending")
    assert "itself is broken" in str(loop.error)
    loop.stop()


# -- one SamplingParams from the client to the request ------------------------------------------


class SoftRunner(FakeRunner):
    """Logits that leave a real choice (a seeded spread, by a hash of the sequence): a sampled
    request's tokens depend on its temperature, top-k, top-p and seed."""

    def logits_row(self, sequence):
        return np.random.default_rng(sequence_hash(sequence)).normal(0, 2, LM.vocab_size).astype(np.float32)


ASKED = dict(
    max_new_tokens=14, temperature=0.9, top_p=0.95, top_k=20, min_new_tokens=3, stop_token_ids=[5, 9]
)
SOFT_PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [1, 6, 1, 8], [9, 9, 8, 2, 4, 4, 3]]


def soft_run(kind, asks, **options):
    """Each prompt of ``SOFT_PROMPTS`` submitted with its keywords from ``asks(i)`` (and priority
    ``i % 2``) on the soft model: every request's (tokens, status, reason) and priority."""
    engine = make_engine(kind, LM, runner=SoftRunner, **options)
    ids = [engine.submit(p, priority=i % 2, **asks(i)) for i, p in enumerate(SOFT_PROMPTS)]
    engine.run_until_idle()
    return [(engine.poll(rid), engine.trace.requests[rid].priority) for rid in ids]


@pytest.mark.parametrize("kind", ["sequential", "continuous", "stallfree"])
def test_a_request_given_one_sampling_params_makes_the_tokens_of_the_same_keywords(kind):
    loose = soft_run(kind, lambda i: {**ASKED, "seed": i})
    given = soft_run(kind, lambda i: {"params": SamplingParams(**{**ASKED, "seed": i})})
    assert given == loose
    # the comparison can fail: what the params ask changes the tokens
    assert soft_run(kind, lambda i: {"params": SamplingParams(**{**ASKED, "seed": i + 50})}) != loose
    assert soft_run(kind, lambda i: {"params": SamplingParams(max_new_tokens=14)}) != loose
    assert any(reason == "stop" for (_, _, reason), _ in loose) and all(len(t) >= 3 for (t, _, _), _ in loose)


def test_a_learners_front_takes_one_sampling_params_too():
    """Lesson 6's front hands ``submit``'s keywords to ``check_request`` as they come, so the
    server's ``params=`` (and ``priority=``) reach it unchanged."""
    from learner_pieces import MyEngine

    loose = soft_run("stallfree", lambda i: {**ASKED, "seed": i})
    given = soft_run(
        "stallfree", lambda i: {"params": SamplingParams(**ASKED, seed=i)}, engine_class=MyEngine
    )
    assert given == loose


@pytest.mark.parametrize(
    "asks, says",
    [
        (
            dict(params=SamplingParams(max_new_tokens=4), max_new_tokens=4),
            "give params= or the keywords max_new_tokens, not both",
        ),
        (dict(params=SamplingParams(), temperature=0.5, top_k=3), "not both"),
        (dict(params={"max_new_tokens": 4}), "params must be a SamplingParams"),
        (dict(max_new_tokens=4, max_tokens=4), "a request has no parameter max_tokens"),
        (dict(stop_token_ids=[LM.vocab_size]), f"stop_token_ids must be token ids in [0, {LM.vocab_size})"),
        (
            dict(params=SamplingParams(stop_token_ids=[LM.vocab_size])),
            "stop_token_ids must be token ids in [0,",
        ),
    ],
)
def test_check_request_refuses_params_with_loose_keywords_and_unknown_names(asks, says):
    engine = fake_engine("continuous")
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.check_request([1, 2, 3], **asks)
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.submit([1, 2, 3], **asks)
    assert engine.queue_depth() == 0 and not engine.step()


def test_check_request_returns_what_enqueue_makes_the_request_of():
    """A learner's front passes check_request's answer to enqueue untouched (lesson 6)."""
    engine = fake_engine("continuous")
    params = SamplingParams(max_new_tokens=5000, min_new_tokens=2, ignore_eos=True, stop_token_ids=[7])
    prompt = [1 + i % 60 for i in range(4089)]
    checked = engine.check_request(prompt, params, priority=3)
    assert checked.params is params and checked.prompt_ids == prompt
    assert checked.max_new_tokens == 7, "cut so that prompt + output fits the maximum sequence length"
    assert checked.stop_ids == {7}, "ignore_eos: only its stop tokens end it"
    with engine._lock:
        req = engine.enqueue("r", checked, None)
    assert (req.max_new_tokens, req.sampling, req.priority, req.min_new_tokens) == (7, params, 3, 2)
    assert req.stop_ids == {7} and req.constraint is None
    engine.run_until_idle()
    assert engine.poll("r")[1] == "done"
