"""The OpenAI-compatible server, started on a free 127.0.0.1 port and stopped after.

Clients are real: the official ``openai`` package, LangChain's ``ChatOpenAI`` and raw
``httpx`` streams.
"""

import json
import random
import re
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest
import jsonschema
from openai import OpenAI
from pydantic import BaseModel
from pydantic import Field as PydanticField

from batchlab import generate
from batchlab.core.fake import FakeModel
from batchlab.core.policies import QueueFull
from batchlab.core.request import SamplingParams
from batchlab.core.structured import StructuredOutputs
from batchlab.serving.launch import serve_in_thread
from batchlab.serving.server import StopMatcher

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
    "My favourite colour is",
    "The best way to learn is",
    "In 1969,",
    "Dear friend,",
    "Cats and dogs",
    "The recipe needs",
    "Three facts about the Moon:",
    "Hello! I am",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(lm):
    with serve_in_thread(
        lm,
        "stallfree",
        model_id="smollm2",
        max_queue=8,  # > clients in the soak
        max_batch_size=4,
        token_budget=64,
    ) as handle:
        yield SimpleNamespace(url=handle.base_url, engine=handle.engine, loop=handle.loop)


def wait_until_idle(engine, seconds=20):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(s is None for s in engine.scheduler.slots) and engine.stats()["running"] == 0:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def references(lm):
    """Each prompt's greedy continuation from the engine run alone (what the server must send)."""
    refs = {}
    for prompt in PROMPTS:
        tokens = generate(lm, lm.tokenizer.encode(prompt), MAX_TOKENS).token_ids
        refs[prompt] = tokens
    return refs


def expected_text(lm, tokens, max_tokens):
    kept = [t for t in tokens[:max_tokens] if t not in lm.tokenizer.eos_token_ids]
    return lm.tokenizer.decode(kept)


def test_openai_client_streams_a_chat_completion(lm, server):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(
        model="smollm2",
        messages=question,
        temperature=0,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    expected = generate(lm, question, 30)
    assert "".join(pieces) == expected.text == "The capital of France is Paris."
    assert reasons[-1] == "stop" and len([p for p in pieces if p]) > 3, "streamed in pieces"
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.prompt_tokens == len(lm.tokenizer.encode_chat(question))


def finished_counts(server) -> dict[str, int]:
    """/metrics' requests finished so far, by reason."""
    found = re.findall(
        r'batchlab_requests_finished_total\{reason="(\w+)"\} (\d+)', httpx.get(server.url + "/metrics").text
    )
    return {reason: int(n) for reason, n in found}


def test_completion_with_a_stop_string_is_cut_before_it(lm, server, references):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    full = expected_text(lm, references["Once upon a time"], MAX_TOKENS)
    stop = full.split()[3]  # a word in the middle of the answer
    assert wait_until_idle(server.engine)
    before = finished_counts(server)
    reply = client.completions.create(
        model="smollm2", prompt="Once upon a time", temperature=0, max_tokens=MAX_TOKENS, stop=[stop]
    )
    assert reply.choices[0].text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    assert wait_until_idle(server.engine)
    after = finished_counts(server)
    # the engine ended it as a completed "stop" too, not as a cancel (/metrics and goodput count it)
    assert after.get("stop", 0) == before.get("stop", 0) + 1, (before, after)
    assert after.get("cancelled", 0) == before.get("cancelled", 0), (before, after)


def test_stop_matcher_holds_back_a_possible_stop_string():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("Px") == ("", True)
    m = StopMatcher(["ab"])
    assert m.feed("xa") == ("x", False)
    assert m.feed("c") == ("ac", False)
    assert m.flush() == ""


@pytest.fixture(scope="module")
def fake_server():
    """A server on the fake model (no real model: quick), for what reaches the engine. Its
    engine's ``check_request`` records what it is handed (``handed``) and refuses the request
    with "seen" (the fake model has no detokenizer to stream with)."""
    handed = []

    def recording(prompt_ids, params=None, priority=0, **fields):
        handed.append((list(prompt_ids), params, priority, fields))
        raise ValueError("seen")

    with serve_in_thread(FakeModel(), "continuous", model_id="fake") as handle:
        handle.engine.check_request = recording
        yield SimpleNamespace(url=handle.base_url, handed=handed)


@pytest.mark.parametrize(
    "body, params, priority",
    [
        ({}, SamplingParams(temperature=1.0, max_new_tokens=512), 0),  # OpenAI's defaults, ours
        (
            {
                "max_tokens": 7,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 7,
                "seed": 3,
                "min_tokens": 2,
                "stop_token_ids": [4, 5],
                "priority": 2,
                "stop": ["never"],  # the server's, not the engine's
                "structured_outputs": {"regex": "[0-9]+"},
            },
            SamplingParams(
                0.5,
                0.9,
                7,
                3,
                max_new_tokens=7,
                min_new_tokens=2,
                stop_token_ids=(4, 5),
                structured_outputs={"regex": "[0-9]+"},
            ),
            2,
        ),
        (
            {
                "max_tokens": 3,
                "max_completion_tokens": 9,
                "min_tokens": 20,
                "ignore_eos": True,
                "temperature": 0,
            },
            SamplingParams(0.0, max_new_tokens=9, min_new_tokens=9, ignore_eos=True),
            0,
        ),
        (
            {"response_format": {"type": "json_object"}, "priority": -1},
            SamplingParams(1.0, max_new_tokens=512, structured_outputs=StructuredOutputs(json_object=True)),
            -1,
        ),
    ],
)
def test_the_server_hands_the_engine_one_sampling_params_as_the_body_asked(
    fake_server, body, params, priority
):
    fake_server.handed.clear()
    r = httpx.post(fake_server.url + "/v1/completions", json={"prompt": [1, 2, 3], **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "seen", r.text
    ((prompt, given, given_priority, loose),) = fake_server.handed
    assert (prompt, given_priority, loose) == ([1, 2, 3], priority, {}), (
        "one SamplingParams, no loose keywords"
    )
    assert isinstance(given, SamplingParams)
    # StructuredOutputs compare by identity: compare what they ask
    assert replace(given, structured_outputs=None) == replace(params, structured_outputs=None)
    spec, want = given.structured_outputs, params.structured_outputs
    assert (spec is None) == (want is None)
    if want is not None:
        assert (spec.form, spec.regex, spec.json_object) == (want.form, want.regex, want.json_object)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    before = server.engine.finished_by_reason.get("cancelled", 0)
    body = {"prompt": "Tell me a very long story", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            got = [line for line, _ in zip(lines, range(3))]
            assert got[0].startswith("data: ")
    assert wait_until_idle(server.engine, seconds=10), "the slot was not freed"
    assert server.engine.finished_by_reason.get("cancelled", 0) == before + 1


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", "{not json", None),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            "temperature",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "priority": "high"},
            "priority",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5},
            "temperature",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": -1}, "seed"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]},
            "stop",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
            "functions",
        ),
        ("/v1/completions", {"prompt": ""}, None),
        ("/v1/completions", {"prompt": [1, 2, 999999]}, None),
        ("/v1/completions", {"prompt": [5] * 9000}, None),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "suffix": " the end"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "top_k": -1}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [999999]}, None),
    ],
)
def test_bad_bodies_get_400_with_an_openai_error(server, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_a_full_queue_gets_429_and_others_are_not_disturbed(lm, server, references):
    prompt = lm.tokenizer.encode("Count to a thousand:")

    def fill(n):
        return [server.loop.submit(prompt, max_new_tokens=200, ignore_eos=True) for _ in range(n)]

    fillers = fill(4)  # the 4 slots
    try:
        deadline = time.monotonic() + 10
        while server.engine.queue_depth() > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        fillers += fill(8)  # the 8 queue places
        with pytest.raises(QueueFull):  # the engine's own bound, which the server obeys
            server.loop.submit(prompt, max_new_tokens=2)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for rid in fillers:
            server.loop.cancel(rid)
    assert wait_until_idle(server.engine)
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    reply = client.completions.create(
        model="smollm2", prompt="Water boils at", temperature=0, max_tokens=MAX_TOKENS
    )
    assert reply.choices[0].text == expected_text(lm, references["Water boils at"], MAX_TOKENS)


SOAK_REQUESTS = 120  # 15 a client, 3 in 7 of them abandoned; 300 took 128 s of CI time (a425d5d)


def test_soak_8_clients_random_disconnects(lm, server, references):
    """Nothing lost, nothing duplicated: every completed stream is exactly the greedy text,
    every abandoned one a prefix of it, and every slot is free at the end."""
    results, errors = [], []

    def client(seed):
        rng = random.Random(seed)
        with httpx.Client(timeout=60) as http:
            for _ in range(SOAK_REQUESTS // 8 + (seed < SOAK_REQUESTS % 8)):
                prompt, max_tokens = rng.choice(PROMPTS), rng.randint(1, MAX_TOKENS)
                leave_after = rng.choice([None] * 4 + [1, 2, 3])
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
                text, finish, chunks = "", None, 0
                try:
                    with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                        assert r.status_code == 200, r.status_code
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            choice = json.loads(line[6:])["choices"][0]
                            text += choice["text"]
                            finish = choice["finish_reason"] or finish
                            chunks += 1
                            if leave_after is not None and chunks >= leave_after:
                                break
                except Exception as e:  # surfaced below
                    errors.append(repr(e))
                results.append((prompt, max_tokens, text, finish, leave_after is not None and finish is None))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors[:3]
    assert len(results) == SOAK_REQUESTS
    abandoned = 0
    for prompt, max_tokens, text, finish, left in results:
        expected = expected_text(lm, references[prompt], max_tokens)
        if left:
            abandoned += 1
            assert expected.startswith(text)
        else:
            assert text == expected, (prompt, max_tokens)
            assert finish in ("stop", "length")
    assert abandoned > 0
    assert wait_until_idle(server.engine), "slots still busy after the soak"
    assert server.engine.queue_depth() == 0


def test_export_mlx_round_trips_through_mlx_lm(lm, tmp_path):
    """mlx-lm's own loader reads the exported folder and generates the same tokens."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from batchlab.model.export import export_mlx

    export_mlx(lm, tmp_path)
    model, wrapper = mlx_lm.load(str(tmp_path))
    chat = [{"role": "user", "content": "Name a planet."}]
    ids = wrapper.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert list(ids) == lm.tokenizer.encode_chat(chat)
    assert set(wrapper.eos_token_ids) == set(lm.tokenizer.eos_token_ids)
    theirs = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=12), range(12))]
    assert theirs == generate(lm, ids, 12, ignore_eos=True).token_ids


HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "body,param,says",
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        ],
                    }
                ]
            },
            "messages.0.content.1",
            ["'image_url'", "text only"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "messages.0.content.0",
            ["'input_audio'", "text only"],
        ),
        (
            {
                "messages": [
                    HI,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                ]
            },
            "messages.1",
            ["tool calls are not supported"],
        ),
        (
            {"messages": [HI, {"role": "tool", "tool_call_id": "c1", "content": "42"}]},
            "messages.1",
            ["tool calls are not supported"],
        ),
        (
            {"messages": [HI], "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
            ["tool calls are not supported"],
        ),
        ({"messages": [HI], "tool_choice": "required"}, "tool_choice", ["tool calls are not supported"]),
        ({"messages": [HI], "logprobs": True}, "logprobs", ["logprobs are not supported"]),
        ({"messages": [HI], "logprobs": True, "top_logprobs": 3}, "logprobs", ["not supported"]),
        ({"messages": [HI], "top_logprobs": 3}, "top_logprobs", ["not supported"]),
        ({"messages": [HI], "presence_penalty": 0.5}, "presence_penalty", ["not supported"]),
        ({"messages": [HI], "frequency_penalty": 1.0}, "frequency_penalty", ["not supported"]),
        ({"messages": [HI], "repetition_penalty": 1.2}, "repetition_penalty", ["not supported"]),
        ({"messages": [HI], "min_p": 0.1}, "min_p", ["not supported"]),
        ({"messages": [HI], "best_of": 3}, "best_of", ["not supported"]),
        (
            {"messages": [HI], "response_format": {"type": "xml"}},
            "response_format",
            ["'xml' is not supported"],
        ),
        (
            {"messages": [HI], "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            ["json_schema.schema must be"],
        ),
        (
            {
                "messages": [HI],
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
            },
            "response_format",
            ["json cannot be compiled", "nonsense"],
        ),
        (
            {"messages": [HI], "structured_outputs": {"regex": "(unclosed"}},
            "structured_outputs",
            ["regex cannot be compiled"],
        ),
        (
            {"messages": [HI], "structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            ["exactly one"],
        ),
        (
            {"messages": [HI], "structured_outputs": {"grammar": "x"}},
            "structured_outputs",
            ["unknown: grammar"],
        ),
        (
            {
                "messages": [HI],
                "structured_outputs": {"choice": ["a"]},
                "response_format": {"type": "json_object"},
            },
            "structured_outputs",
            ["not both"],
        ),
        ({"messages": [HI], "logit_bias": {"2": -100}}, "logit_bias", ["not supported"]),
        ({"messages": [HI], "stream_options": {"include_usage": True}}, "stream_options", ["stream: true"]),
    ],
)
def test_what_the_model_cannot_do_gets_a_400_saying_so(server, body, param, says):
    """Never silently ignored: images, audio, tool calls and logprobs are refused by name,
    and the refused request leaves nothing behind in the engine."""
    before = server.engine.stats()["finished"]
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    for words in says:
        assert words in err["message"], err["message"]
    assert server.engine.stats()["finished"] == before and server.engine.queue_depth() == 0


def test_content_parts_and_the_developer_role_read_like_plain_messages(lm, server):
    """OpenAI's content-part arrays (text parts joined in order) and the "developer" role
    (newer clients' "system") give exactly the answer of the plain-string form."""
    plain = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    parts = [
        {
            "role": "developer",
            "content": [
                {"type": "text", "text": "Answer in one "},
                {"type": "text", "text": "short sentence."},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": " of France?"},
            ],
        },
    ]
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    reply = client.chat.completions.create(model="smollm2", messages=parts, temperature=0, max_tokens=20)
    expected = generate(lm, plain, 20)
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(lm.tokenizer.encode_chat(plain))
    assert "system" in lm.tokenizer.decode(lm.tokenizer.encode_chat(plain)), (
        "the reference prompt carries the system turn"
    )


def test_langchain_chat_openai_invokes_and_streams(lm, server):
    """A second real client library: LangChain's ChatOpenAI, as a user would set it up.
    It sends list content as content parts and ``max_completion_tokens``; what it sent is
    captured, so the test shows which paths it took."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    sent = []

    def capture(request):
        sent.append(json.loads(request.read()))

    llm = ChatOpenAI(
        model="smollm2",
        base_url=server.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=24,
        http_client=httpx.Client(event_hooks={"request": [capture]}),
    )
    question = [
        SystemMessage("Answer in one short sentence."),
        HumanMessage(content=[{"type": "text", "text": "What is the capital of France?"}]),
    ]
    expected = generate(
        lm,
        [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        24,
    )

    reply = llm.invoke(question)
    assert reply.content == expected.text
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata["output_tokens"] == len(expected.token_ids)

    pieces = [chunk.content for chunk in llm.stream(question)]
    assert "".join(pieces) == expected.text
    assert len([p for p in pieces if p]) > 3, "streamed in pieces"

    assert [body["stream"] for body in sent] == [False, True]
    assert sent[0]["messages"][1]["content"] == [{"type": "text", "text": "What is the capital of France?"}]
    assert sent[0]["max_completion_tokens"] == 24


@pytest.fixture(scope="module")
def hi_greedy(lm):
    """The greedy answer to HI alone, 40 tokens past its EOS: the length tests' reference."""
    return generate(lm, lm.tokenizer.encode_chat([HI]), 40, ignore_eos=True).token_ids


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_length_extensions_fix_the_answer_length(lm, server, hi_greedy, path, stream):
    """What benchmark clients send to fix output lengths: ``ignore_eos`` runs to
    ``max_tokens`` past EOS; ``min_tokens`` keeps the answer from stopping early without
    putting a stop token inside it; ``stop_token_ids`` end it at a token of the client's
    choosing. The usage the server reports counts exactly those tokens."""
    ids = lm.tokenizer.encode_chat([HI])
    hi = {"prompt": ids} if path == "/v1/completions" else {"messages": [HI]}
    greedy = hi_greedy  # the reference, past its EOS
    natural = next(i for i, t in enumerate(greedy) if t in lm.tokenizer.eos_token_ids) + 1

    def ask(**extra):
        body = {**hi, "max_tokens": 40, "temperature": 0, "stream": stream, **extra}
        if not stream:
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]
        body["stream_options"] = {"include_usage": True}
        usage = finish = None
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    usage = event.get("usage") or usage
                    if event.get("choices"):
                        finish = event["choices"][0]["finish_reason"] or finish
        return usage["completion_tokens"], finish

    assert natural < 30 and ask() == (natural, "stop"), "the question ends on EOS by itself"
    assert ask(ignore_eos=True) == (40, "length")
    longer, finish = ask(min_tokens=natural + 5)
    assert longer >= natural + 5 and (finish == "stop" or longer == 40)
    stop = greedy[natural + 2]  # a token past the natural end: only ignore_eos reaches it
    assert ask(ignore_eos=True, stop_token_ids=[stop]) == (greedy.index(stop) + 1, "stop")


def sse_events(url, body):
    """The JSON events of a streamed answer, in order (the ``[DONE]`` line left out)."""
    events = []
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_count_the_tokens_behind_every_chunk(lm, server, path):
    """vLLM's ``stream_options.continuous_usage_stats`` (GuideLLM always sends it, aiperf
    with ``--per-chunk-usage``): with ``include_usage``, every chunk carries the usage so
    far, and its count is exactly the tokens whose text has been sent by then (checked
    against the reference's tokens, EOS included, since the answer runs past it with
    ``ignore_eos``). Without it only the last chunk has usage."""
    ids = lm.tokenizer.encode_chat([HI])
    reference = generate(lm, ids, 24, ignore_eos=True).token_ids
    assert set(reference) & lm.tokenizer.eos_token_ids, "the count must run across an EOS"
    hi = {"prompt": ids} if path == "/v1/completions" else {"messages": [HI]}
    body = {**hi, "max_tokens": 24, "temperature": 0, "stream": True, "ignore_eos": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = sse_events(server.url + path, {**body, "stream_options": options})
    text, counts = "", []
    for event in events[:-1]:
        usage = event["usage"]
        assert usage["prompt_tokens"] == len(ids)
        assert usage["total_tokens"] == len(ids) + usage["completion_tokens"]
        choice = event["choices"][0]
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        counts.append(usage["completion_tokens"])
        assert text == expected_text(lm, reference, counts[-1]), (counts[-1], text)
    assert counts == sorted(counts) and counts[-1] == 24
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 24
    plain = sse_events(server.url + path, {**body, "stream_options": {"include_usage": True}})
    assert [e for e in plain if "usage" in e] == [plain[-1]]
    assert [e for e in sse_events(server.url + path, body) if "usage" in e] == []


def test_a_speculating_server_streams_the_greedy_answer_and_counts_its_drafts(lm):
    """``num_speculative_tokens`` on the server (as ``batchlab serve --num-speculative-tokens``):
    an answer that repeats its prompt streams exactly mlx-lm's greedy tokens, several a step,
    and /metrics counts the drafts verified and kept."""
    listing = "red, green, blue, yellow, purple, orange, black, white"
    messages = [{"role": "user", "content": f"Repeat this list exactly: {listing}. {listing}."}]
    expected = generate(lm, lm.tokenizer.encode_chat(messages), 24, ignore_eos=True).token_ids
    with serve_in_thread(
        lm, "stallfree", max_batch_size=2, token_budget=32, num_speculative_tokens=4
    ) as handle:
        client = OpenAI(base_url=handle.base_url + "/v1", api_key="none")
        stream = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        counters = dict(
            re.findall(
                r"^(batchlab_spec_\w+_total) (\d+)$", httpx.get(handle.base_url + "/metrics").text, re.M
            )
        )
        steps = [s for s in handle.engine.trace.steps if s.emitted]
    assert text == lm.tokenizer.decode(expected)
    drafted, kept = (
        int(counters["batchlab_spec_draft_tokens_total"]),
        int(counters["batchlab_spec_accepted_tokens_total"]),
    )
    assert 0 < kept <= drafted, counters
    assert any(len(t) > 1 for s in steps for t in s.emitted.values()), "some step handed out several tokens"


class Person(BaseModel):
    name: str = PydanticField(max_length=20)
    age: int
    hobbies: list[str] = PydanticField(max_length=3)


def test_openai_parse_gets_a_pydantic_object_and_every_structured_form_matches(lm, server):
    """The ``openai`` client's ``chat.completions.parse`` with a pydantic model: the server
    enforces the schema it sends, so the answer parses (``jsonschema`` checks it too). Then
    vLLM's ``structured_outputs`` (a regex, a choice) on both endpoints, streamed and not, and
    ``json_object``: each answer matches its pattern by Python's ``re`` and ``json``."""
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    ask = [{"role": "user", "content": "Describe a person who likes sports, as JSON."}]
    done = client.chat.completions.parse(
        model="smollm2", messages=ask, response_format=Person, max_tokens=80, temperature=0
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person)
    jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())

    phone = r"[0-9]{3}-[0-9]{4}"
    forms = [
        ({"structured_outputs": {"regex": phone}}, lambda t: re.fullmatch(phone, t)),
        (
            {"structured_outputs": {"choice": ["red", "green", "blue"]}},
            lambda t: t in ("red", "green", "blue"),
        ),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ]
    for extra, matches in forms:
        for stream in (False, True):
            chat = client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Answer."}],
                max_tokens=60,
                temperature=0,
                stream=stream,
                extra_body=extra,
            )
            text = (
                "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
                if stream
                else chat.choices[0].message.content
            )
            assert matches(text), (extra, stream, text)
    for stream in (False, True):
        out = client.completions.create(
            model="smollm2",
            prompt="My phone number is",
            max_tokens=20,
            temperature=0,
            stream=stream,
            extra_body={"structured_outputs": {"regex": " " + phone}},
        )
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert re.fullmatch(" " + phone, text), (stream, text)
