"""Faults, seen from the server: an engine step that fails, an engine loop that dies, and
``batchlab serve`` told to stop (SIGTERM) with streams open. No stream may hang.

The faults are injected: a runner wrapper that raises on a chosen forward pass, and an
engine whose ``step`` raises (which kills the loop thread whatever the engine catches).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from batchlab import generate
from batchlab.model.model_runner import ModelRunner
from batchlab.serving.launch import serve_in_thread
from waiting import wait_for


class FaultyRunner(ModelRunner):
    """The real runner, except that forward pass number ``fail_at`` (counted from 1; None:
    never) raises, as a broken kernel or an out-of-memory error would."""

    passes = 0
    fail_at: int | None = None

    def forward(self, chunks, head_rows=None):
        self.passes += 1
        if self.passes == self.fail_at:
            raise RuntimeError(f"injected fault in forward pass {self.passes}")
        return super().forward(chunks, head_rows)


def read_stream(url: str, body: dict, out: dict, first_token: threading.Event | None = None):
    """Stream a chat completion; record the text, the finish reason, any error event, whether
    [DONE] came, and when the stream ended."""
    out.update(text="", finish=None, error=None, done=False)
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            out["error"] = event["error"]
                            continue
                        choice = event["choices"][0]
                        out["text"] += choice["delta"].get("content", "")
                        out["finish"] = choice["finish_reason"] or out["finish"]
                        if out["text"] and first_token is not None:
                            first_token.set()
    except Exception as e:  # surfaced by the test
        out["exception"] = repr(e)
    out["ended"] = time.monotonic()


def start_stream(url, body, first_token=None):
    out = {}
    thread = threading.Thread(target=read_stream, args=(url, body, out, first_token), daemon=True)
    thread.start()
    return thread, out


def chat(question: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}


LONG = chat("Write a long story about a dragon.", 300)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_when_the_engine_loop_dies_every_stream_ends_and_health_says_503(lm):
    with serve_in_thread(lm, "stallfree", max_batch_size=1) as srv:
        started = threading.Event()
        streams = [start_stream(srv.base_url, LONG, started)]  # running
        assert started.wait(60)
        streams.append(start_stream(srv.base_url, LONG))  # queued behind it
        wait_for(lambda: srv.engine.queue_depth() > 0, 60, "the second request queueing")
        died = {}
        real_step = srv.engine.step

        def broken_step():
            real_step()
            died["at"] = time.monotonic()
            raise RuntimeError("injected: the engine loop's thread dies")

        srv.engine.step = broken_step
        for thread, _ in streams:
            thread.join(timeout=10)
        assert srv.loop.error is not None
        for thread, out in streams:
            assert not thread.is_alive(), "a stream hangs"
            assert "exception" not in out, out
            assert out["status"] == 200 and out["error"] is not None and out["done"], out
            assert "engine has stopped" in out["error"]["message"]
            assert out["ended"] >= died["at"], "the stream ended before the engine died"
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and "injected" in health.json()["error"]["message"]
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_forward_pass_ends_its_requests_with_an_error_event_and_others_go_on(lm):
    """The agreed engine behaviour: the requests in the failed pass finish with reason
    "error" and free their blocks; requests not in it (here: queued) continue; the server
    turns "error" into an error event and keeps serving, with the same greedy answers."""
    question = chat("What is the capital of France?", 12)
    expected = generate(lm, question["messages"], 12).text
    with serve_in_thread(lm, "stallfree", max_batch_size=1, runner=FaultyRunner) as srv:
        started = threading.Event()
        victim = start_stream(srv.base_url, LONG, started)
        assert started.wait(60)
        bystander = start_stream(srv.base_url, question)  # queued: not in the failing pass
        wait_for(lambda: srv.engine.queue_depth() > 0, 60, "the second request queueing")
        srv.engine.runner.fail_at = srv.engine.runner.passes + 2
        for thread, _ in (victim, bystander):
            thread.join(timeout=60)
        out = victim[1]
        assert out["error"] is not None and out["done"] and out["finish"] is None, out
        assert bystander[1]["text"] == expected and bystander[1]["error"] is None
        assert srv.engine.finished_by_reason.get("error") == 1
        assert httpx.get(srv.base_url + "/health").status_code == 200
        stats = srv.engine.stats()
        assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
        again = httpx.post(srv.base_url + "/v1/chat/completions", json=question, timeout=60)
        assert again.json()["choices"][0]["message"]["content"] == expected


def test_a_scheduler_that_raises_ends_its_requests_with_an_error_and_the_server_serves_on(lm):
    """A learner's scheduler with a bug one request shows (here: 13 new tokens asked): that step's
    requests end with an error event, the engine is left clean, and the server answers the next
    request as before, its loop alive and healthy."""
    from batchlab.core.scheduler import StallFreeScheduler

    class Buggy(StallFreeScheduler):
        kind = "buggy"

        def batches(self):
            if any(r.max_new_tokens == 13 for r in self.running):
                raise IndexError("a planner's bug")
            yield from super().batches()

    question = chat("What is the capital of France?", 12)
    expected = generate(lm, question["messages"], 12).text
    with serve_in_thread(lm, Buggy, max_batch_size=2) as srv:
        thread, out = start_stream(srv.base_url, chat("Tell me a story.", 13))
        thread.join(timeout=60)
        assert not thread.is_alive() and out["error"] is not None and out["done"], out
        assert srv.loop.error is None and isinstance(srv.engine.contained, IndexError)
        again = httpx.post(srv.base_url + "/v1/chat/completions", json=question, timeout=60)
        assert again.json()["choices"][0]["message"]["content"] == expected
        assert httpx.get(srv.base_url + "/health").status_code == 200
        stats = srv.engine.stats()
        assert stats["free_kv_blocks"] == stats["num_kv_blocks"]


def test_a_learners_stream_that_raises_ends_that_request_with_an_error_and_the_server_serves_on(lm, caplog):
    """A learner's ``events()`` with a bug one request shows (here: 13 new tokens asked, after its
    first token): that stream gets an error event naming the error, a whole answer a 500; the
    request is cancelled (its slot and blocks come back); other requests are answered as before."""
    from learner_pieces import MyServer

    class Buggy(MyServer):
        async def events(self, rid, stops):
            async for event in super().events(rid, stops):
                if self.clients[rid].record.max_new_tokens == 13:
                    raise KeyError("a stream's bug")
                yield event

    question = chat("What is the capital of France?", 12)
    expected = generate(lm, question["messages"], 12).text
    with caplog.at_level("ERROR", logger="batchlab"):
        with serve_in_thread(lm, "stallfree", server_class=Buggy, max_batch_size=2) as srv:
            thread, out = start_stream(srv.base_url, chat("Tell me a long story.", 13))
            thread.join(timeout=60)
            assert not thread.is_alive() and out["done"] and out["finish"] is None, out
            assert "Buggy.events() raised KeyError" in out["error"]["message"], out
            whole = httpx.post(
                srv.base_url + "/v1/chat/completions", json=chat("Tell me a story.", 13), timeout=60
            )
            assert whole.status_code == 500 and "raised KeyError" in whole.json()["error"]["message"]
            again = httpx.post(srv.base_url + "/v1/chat/completions", json=question, timeout=60)
            assert again.json()["choices"][0]["message"]["content"] == expected
            wait_for(
                lambda: not srv.engine.scheduler.running and not srv.engine.scheduler.queue,
                30,
                "the engine idle",
            )
            cancelled = [r for r in srv.engine.trace.requests.values() if r.finish_reason == "cancelled"]
            assert len(cancelled) == 2, [r.finish_reason for r in srv.engine.trace.requests.values()]
            stats = srv.engine.stats()
            assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
    assert any("Buggy.events() raised" in r.getMessage() for r in caplog.records)


class BrokenRunner(ModelRunner):
    """Every forward pass raises, as every masked pass did on the Mac path before its mask
    took the queries' dtype."""

    def forward(self, chunks, head_rows=None):
        raise ValueError("[scaled_dot_product_attention] Mask type must promote to output type float16.")


def test_a_server_whose_every_pass_fails_says_so_in_its_log_and_on_health(lm, caplog):
    with caplog.at_level("ERROR", logger="batchlab"):
        with serve_in_thread(lm, "stallfree", max_batch_size=2, runner=BrokenRunner) as srv:
            assert httpx.get(srv.base_url + "/health").status_code == 200
            for _ in range(2):  # each ends with an error, and the server still answers
                r = httpx.post(srv.base_url + "/v1/chat/completions", json=chat("Hi", 4), timeout=60)
                assert r.status_code == 500, r.text
            health = httpx.get(srv.base_url + "/health")
            assert health.status_code == 503 and "bug in the engine" in health.text, health.text
    said = [r.getMessage() for r in caplog.records if "the engine is failing" in r.getMessage()]
    assert len(said) == 1, said


def test_a_request_the_engine_reports_as_error_gets_an_error_event_or_a_500(lm):
    """The server's side of the agreed contract, whatever the engine does today: when
    poll reports finish reason "error", a stream gets an error event (then [DONE]) after
    the text so far, a non-streamed request a 500; the server goes on serving."""
    question = chat("What is the capital of France?", 12)
    expected = generate(lm, question["messages"], 12).text
    with serve_in_thread(lm, "stallfree", max_batch_size=2) as srv:
        real_poll, polls = srv.loop.poll, {}

        def poll_that_fails_third_time(rid):
            tokens, status, reason = real_poll(rid)
            polls[rid] = polls.get(rid, 0) + 1
            return (tokens, "done", "error") if polls[rid] == 3 else (tokens, status, reason)

        srv.loop.poll = poll_that_fails_third_time
        thread, out = start_stream(srv.base_url, question)
        thread.join(timeout=60)
        assert out["error"] is not None and out["done"] and out["finish"] is None, out
        assert "failed while running this request" in out["error"]["message"]
        assert expected.startswith(out["text"])
        polls.clear()
        r = httpx.post(srv.base_url + "/v1/chat/completions", json=question, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        srv.loop.poll = real_poll
        assert httpx.get(srv.base_url + "/health").status_code == 200
        r = httpx.post(srv.base_url + "/v1/chat/completions", json=question, timeout=60)
        assert r.json()["choices"][0]["message"]["content"] == expected


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a real server process on the real model
def test_sigterm_under_load_ends_every_stream_and_the_process_exits(tmp_path):
    """``batchlab serve`` with 4 long streams open gets SIGTERM: it stops admitting, ends
    each stream with a final chunk or an error event, and the process exits (awaited with a
    deadline of 120 s, so a hang fails; how fast it exits is not asserted)."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchlab.cli", "serve", "--port", str(port), "--batch-size", "4"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        started = [threading.Event() for _ in range(4)]
        streams = [
            start_stream(url, chat(f"Write a long story about dragon number {k + 1}.", 300), ev)
            for k, ev in enumerate(started)
        ]
        assert all(ev.wait(120) for ev in started), "the streams did not start"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)  # a deadline, not a speed claim: a hang fails here
        for thread, _ in streams:
            thread.join(timeout=5)
        for thread, out in streams:
            assert not thread.is_alive() and "exception" not in out, out
            assert out["done"] and (out["error"] is not None or out["finish"] is not None), out
            assert out["text"], "each stream had started"
        # uvicorn shuts down in order, then re-raises the signal it caught (so the exit
        # status says "terminated by SIGTERM", as a supervisor expects)
        assert proc.returncode in (0, -signal.SIGTERM)
        assert "Finished server process" in (tmp_path / "serve.log").read_text()
        with pytest.raises(httpx.TransportError):  # nothing admitted any more
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
