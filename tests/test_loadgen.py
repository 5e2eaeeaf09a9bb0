"""The load generator against our real server (in-process, 127.0.0.1, stopped after).

References are independent of the server: ``batchlab.generate`` run alone on each prompt.
"""

import json

import pytest

import batchlab.model.load
from batchlab import cli, generate
from batchlab.serving.loadgen import run_loadgen
from batchlab.serving.launch import serve_in_thread
from batchlab.measurement.workloads import Workload, WorkloadRequest, mixed


@pytest.fixture(scope="module")
def server(lm):
    with serve_in_thread(lm, "stallfree", model_id="smollm2", max_batch_size=4, token_budget=64) as handle:
        yield handle


@pytest.fixture(scope="module")
def workload(lm):
    return mixed(lm.tokenizer, seed=3, num_requests=8, prompt_range=(40, 120), output_range=(3, 12))


@pytest.fixture
def session_model(monkeypatch, lm):
    """The CLI reuses the session's model (for the tokenizer) instead of loading its own."""
    monkeypatch.setattr(batchlab.model.load, "load_model", lambda path=None, dtype=None: lm)


def reference(lm, request):
    return generate(lm, request.prompt_ids, request.max_new_tokens).token_ids


def test_every_request_completes_with_the_engines_own_tokens(lm, server, workload):
    result = run_loadgen(
        server.base_url, workload, concurrency=4, progress=False, slo_ttft_s=1e9, slo_tpot_s=1e9
    )
    assert result.model == "smollm2"  # the first (only) id at /v1/models
    summary = result.summary()
    assert (summary["completed"], summary["failed"]) == (8, 0), summary["failures"]
    eos = lm.tokenizer.eos_token_ids
    for req, got in zip(workload, result.requests):
        ref = reference(lm, req)
        assert got.id == req.id and got.ok
        assert got.tokens_from == "usage"
        assert got.output_tokens == len(ref), req.id
        assert got.text == lm.tokenizer.decode([t for t in ref if t not in eos]), req.id
        assert got.finish_reason == ("stop" if ref[-1] in eos else "length")
        # one chunk per token that adds text (EOS adds none), and a gap between each two
        assert got.chunks == len([t for t in ref if t not in eos])
        assert len(got.itl_s) == got.chunks - 1
        assert 0 < got.ttft_s <= got.latency_s
        assert all(g >= 0 for g in got.itl_s)
        assert got.ttft_s + sum(got.itl_s) <= got.latency_s
        if got.output_tokens >= 2:
            assert got.tpot_s == pytest.approx((got.latency_s - got.ttft_s) / (len(ref) - 1))
    assert summary["output_tokens"] == sum(len(reference(lm, r)) for r in workload)
    assert summary["good_requests"] == 8  # SLOs nobody can miss
    assert summary["output_throughput"] == pytest.approx(summary["output_tokens"] / result.duration_s)
    assert summary["ttft_ms_p50"] <= summary["ttft_ms_p99"]
    strict = run_loadgen(server.base_url, workload.head(2), progress=False, slo_ttft_s=1e-6)
    assert strict.summary()["good_requests"] == 0  # an SLO nobody can meet


def test_rate_and_concurrency_shape_when_requests_are_sent(server, workload):
    small = workload.head(3).capped(3)
    arrivals = small.with_arrivals("poisson", rate=4.0, seed=5).arrivals  # what --rate 4 means
    paced = run_loadgen(server.base_url, small, rate=4.0, seed=5, progress=False)
    assert paced.summary()["completed"] == 3 and arrivals[1] > 0
    for due, got in zip(arrivals, paced.requests):
        assert got.sent_s >= due  # never before its Poisson arrival
    one = run_loadgen(server.base_url, small, concurrency=1, progress=False)
    for before, after in zip(one.requests, one.requests[1:]):  # one in flight at a time
        assert after.sent_s >= before.sent_s + before.latency_s


def test_bad_requests_are_counted_with_the_servers_reason(lm, server, workload):
    good = workload.requests[0]
    bad = [
        WorkloadRequest("wizard", good.prompt_ids, 4, messages=[{"role": "wizard", "content": "hi"}]),
        WorkloadRequest("empty", [], 4, messages=[{"role": "user", "content": 5}]),
    ]
    mixed_bag = Workload("mixed-bag", "", [bad[0], good, bad[1]])
    result = run_loadgen(server.base_url, mixed_bag, progress=False)
    failed = {r.id: r for r in result.requests if not r.ok}
    assert set(failed) == {"wizard", "empty"}
    assert failed["wizard"].error == "HTTP 400" and "role" in failed["wizard"].error_message
    assert failed["empty"].error == "HTTP 400" and "content" in failed["empty"].error_message
    assert result.summary()["failures"] == {"HTTP 400": 2}
    ok = next(r for r in result.requests if r.ok)
    assert ok.output_tokens == len(reference(lm, good))


def test_a_full_queue_is_counted_as_429(lm, workload):
    with serve_in_thread(lm, "stallfree", max_batch_size=1, token_budget=64, max_queue=1) as tiny:
        result = run_loadgen(tiny.base_url, workload.head(6), progress=False)
    summary = result.summary()
    assert summary["completed"] + summary["failed"] == 6
    assert summary["completed"] >= 1 and summary["failures"].get("HTTP 429", 0) >= 1, summary
    assert set(summary["failures"]) == {"HTTP 429"}
    assert all("queue is full" in r.error_message for r in result.requests if not r.ok)


def test_a_server_that_is_not_there_is_counted_not_raised(workload):
    result = run_loadgen("http://127.0.0.1:9", workload.head(3), model="any", progress=False)
    assert result.summary()["failures"] == {"disconnected": 3}
    assert result.summary()["completed"] == 0 and result.summary()["ttft_ms_p50"] is None


def test_cli_writes_the_json_round_trip(lm, server, tmp_path, capsys, session_model):
    out = tmp_path / "load.json"
    assert (
        cli.main(
            [
                "loadgen",
                "--base-url",
                server.base_url,
                "--workload",
                "mixed",
                "--requests",
                "3",
                "--concurrency",
                "2",
                "--slo-ttft",
                "60",
                "--slo-tpot",
                "10",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "Successful requests" in printed and "P99 ITL (ms)" in printed
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 3 and data["summary"]["failed"] == 0
    assert data["settings"]["concurrency"] == 2 and data["settings"]["slo_ttft_s"] == 60
    sent = cli.loadgen_workload("mixed", lm.tokenizer, "quick", 3, 0)
    rows = data["requests"]
    assert [r["id"] for r in rows] == [r.id for r in sent]
    for row, req in zip(rows, sent):
        assert row["output_tokens"] == len(reference(lm, req))
        assert len(row["itl_s"]) == row["chunks"] - 1


def test_ignore_eos_in_the_body_runs_every_answer_to_its_max_tokens(lm, server, tmp_path, session_model):
    """``extra_body={"ignore_eos": True}`` (``batchlab loadgen --ignore-eos``): a question that
    ends on EOS by itself runs on to exactly its ``max_tokens``, counted by the server."""
    hi = [{"role": "user", "content": "hi"}]
    ids = lm.tokenizer.encode_chat(hi)
    short = Workload("hi", "", [WorkloadRequest("hi", ids, 30, messages=hi)])
    natural = len(generate(lm, ids, 30).token_ids)
    assert natural < 30, "the reference ends on EOS before max_tokens"
    plain = run_loadgen(server.base_url, short, progress=False).requests[0]
    assert (plain.output_tokens, plain.finish_reason) == (natural, "stop")
    fixed = run_loadgen(server.base_url, short, progress=False, extra_body={"ignore_eos": True})
    assert (fixed.requests[0].output_tokens, fixed.requests[0].finish_reason) == (30, "length")
    assert fixed.settings["extra_body"] == {"ignore_eos": True}
    out = tmp_path / "load.json"
    argv = ["loadgen", "--base-url", server.base_url, "--requests", "1", "--ignore-eos", "--json", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["extra_body"] == {"ignore_eos": True}
    assert [r["output_tokens"] for r in data["requests"]] == [r["max_tokens"] for r in data["requests"]]


def test_cli_refuses_more_requests_than_the_workload_has(session_model):
    with pytest.raises(SystemExit, match="--requests must be between 1 and"):
        cli.main(
            ["loadgen", "--base-url", "http://127.0.0.1:9", "--workload", "sharegpt", "--requests", "1000"]
        )


def test_mlx_lm_server_serves_the_same_load(lm, workload, tmp_path):
    """The peer for real: mlx_lm.server on our exported weights, two requests through the
    same load generator, with the same OpenBLAS as ours."""
    from batchlab.model.export import export_mlx
    from batchlab.serving.serverprocs import mlx_lm_spec, running

    export_mlx(lm, tmp_path)
    two = workload.head(2)
    with running(mlx_lm_spec(tmp_path, batch_size=2), ready_within_s=120) as peer:
        assert peer.blas is not None and "openblas" in peer.blas
        result = run_loadgen(peer.base_url, two, model=peer.spec.model, progress=False)
    assert result.summary()["completed"] == 2, result.summary()["failures"]
    eos = lm.tokenizer.eos_token_ids
    for req, got in zip(two, result.requests):
        assert got.tokens_from == "usage" and 1 <= got.output_tokens <= req.max_new_tokens
        assert len(got.itl_s) == got.chunks - 1 and got.ttft_s <= got.latency_s
        ref = reference(lm, req)  # same weights, greedy: the same opening words
        assert got.text.split()[:2] == lm.tokenizer.decode([t for t in ref if t not in eos]).split()[:2]


def test_a_stream_cut_mid_way_is_counted_as_disconnected(workload):
    """A server that sends one chunk and then drops the connection."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    chunk = (
        b'data: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", '
        b'"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}\n\n'
    )

    def serve_badly():
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n" + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
                )

    thread = threading.Thread(target=serve_badly, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    result = run_loadgen(
        f"http://127.0.0.1:{port}", workload.head(2), model="m", concurrency=1, progress=False
    )
    thread.join(timeout=10)
    listener.close()
    assert result.summary()["failures"] == {"disconnected": 2}, [r.error_message for r in result.requests]
