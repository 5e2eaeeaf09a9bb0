"""An independent benchmark client against ``batchlab serve``: NVIDIA's aiperf (the bench
extra), offline with the folder ``batchlab export-mlx`` writes as its tokenizer.

aiperf sends vLLM's ``ignore_eos`` to fix output lengths, as serving benchmarks do; every
answer must then be exactly the asked length by the server's own count, on both endpoints
(chat streamed, completions whole). The chat run's own bodies, sent again without ``ignore_eos``, show
that these prompts do end early by themselves, so the exact lengths are the extension's doing. The aiperf command line is the
one ``benchmarks/aiperf_side_by_side.py`` runs (imported from there).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from batchlab.model.export import export_mlx
from batchlab.serving.serverprocs import batchlab_spec, running

ROOT = Path(__file__).resolve().parents[1]
AIPERF_HOME = ROOT / ".venv-aiperf" / "bin" / "aiperf"  # scripts/setup.sh --test puts it there
AIPERF = str(AIPERF_HOME) if AIPERF_HOME.exists() else shutil.which("aiperf")
# Skipped where aiperf is missing, but never in CI: there it must fail, not hide.
pytestmark = [
    pytest.mark.slow,  # a server process and aiperf's own processes
    pytest.mark.skipif(
        AIPERF is None and os.environ.get("CI") != "true",
        reason="aiperf is not installed (bash scripts/setup.sh --test puts it in .venv-aiperf)",
    ),
]

REQUESTS, OSL = 16, 24
SETTINGS = SimpleNamespace(requests=REQUESTS, concurrency=8, isl=32, osl=OSL, seed=0)


def side_by_side():
    spec = importlib.util.spec_from_file_location(
        "aiperf_side_by_side", ROOT / "benchmarks/aiperf_side_by_side.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return side_by_side()


@pytest.fixture(scope="module")
def tokenizer_dir(lm, tmp_path_factory):
    return export_mlx(lm, tmp_path_factory.mktemp("smollm2-mlx"))


@pytest.fixture(scope="module")
def server():
    with running(batchlab_spec(8)) as handle:
        yield handle


def aiperf(bench, server, tokenizer_dir, tmp_path, endpoint, streaming, body):
    out = tmp_path / "aiperf"
    settings = SimpleNamespace(**vars(SETTINGS), streaming=streaming)
    command = bench.aiperf_args(server.base_url, "smollm2", tokenizer_dir, out, body, settings, endpoint)
    summary = bench.run_aiperf(command, out, timeout_s=600)
    assert len(summary["inputs"]) == REQUESTS
    for session in summary["inputs"]:  # what went over the wire
        (payload,) = session["payloads"]
        assert payload["stream"] is streaming
        assert all(payload[k] == v for k, v in body.items())
    return summary


@pytest.fixture(scope="module")
def chat_streamed(bench, server, tokenizer_dir, tmp_path_factory):
    """aiperf's chat run, streamed, with ``ignore_eos``: the first test reads its lengths, the
    control sends its very prompts again without it."""
    body = {"ignore_eos": True, "temperature": 0}
    return aiperf(bench, server, tokenizer_dir, tmp_path_factory.mktemp("chat"), "chat", True, body)


# Each endpoint once, one streamed and one whole: every combination of the two is the server's
# own test (test_server.py's vLLM length extensions); aiperf adds an independent client's count.
@pytest.mark.parametrize(
    "endpoint,streaming", [("chat", True), ("completions", False)], ids=["chat-streamed", "completions-whole"]
)
def test_ignore_eos_gives_aiperf_exactly_the_asked_length(
    bench, server, tokenizer_dir, tmp_path, endpoint, streaming, request
):
    if endpoint == "chat":
        summary = request.getfixturevalue("chat_streamed")
    else:
        body = {"ignore_eos": True, "temperature": 0}
        summary = aiperf(bench, server, tokenizer_dir, tmp_path, endpoint, streaming, body)
    figures = bench.aiperf_figures(summary, OSL)
    assert (figures["completed"], figures["failed"]) == (REQUESTS, 0), summary["error_summary"]
    assert figures["output_lengths"] == [OSL] and figures["fixed_lengths"]
    usage = [bench.record_value(r, "usage_completion_tokens") for r in summary["records"]]
    assert usage == [OSL] * REQUESTS
    assert summary["osl_mismatch_count"]["avg"] == 0
    if streaming:
        assert figures["ttft_ms_p50"] > 0 and figures["tpot_ms_p50"] > 0


def test_without_ignore_eos_the_same_prompts_end_early(server, chat_streamed):
    """The control: the very bodies aiperf sent, without ``ignore_eos`` and whole, sent again by
    hand: some answers end on EOS before the asked length, so the exact lengths above are the
    extension's doing, not prompts that never end."""

    def again(session):
        (payload,) = session["payloads"]
        body = {k: v for k, v in payload.items() if k not in ("ignore_eos", "stream_options")} | {
            "stream": False
        }
        reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        return answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]

    with ThreadPoolExecutor(SETTINGS.concurrency) as clients:  # as many at once as aiperf sent
        ended = list(clients.map(again, chat_streamed["inputs"]))
    assert all(n <= OSL for _, n in ended), ended
    assert any(reason == "stop" and n < OSL for reason, n in ended), ended
