"""A shared classroom server: the API key, refusing to listen openly without one, and the
per-user limit. The server is real (the course's model, 127.0.0.1, a free port); clients
are the official ``openai`` package and raw ``httpx``."""

import json

import httpx
import openai
import pytest
from openai import OpenAI

from batchlab import cli
from batchlab.serving.launch import check_exposure, serve_in_thread

KEY = "class-key-7f3a"
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3, "temperature": 0}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
COUNTING = {
    "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "max_tokens": 400,
    "temperature": 0,
    "stream": True,
}  # runs long: a request that stays unfinished while the test looks


@pytest.fixture(scope="module")
def server(lm):
    with serve_in_thread(
        lm,
        "stallfree",
        model_id="smollm2",
        api_key=KEY,
        max_running_per_user=1,
        max_batch_size=4,
        token_budget=64,
    ) as handle:
        yield handle


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/v1/completions", {**COMPLETION, "stream": True}),
]


@pytest.mark.parametrize(
    "headers",
    [{}, bearer("wrong-key"), bearer(KEY + "x"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}],
    ids=["none", "wrong", "longer", "no-scheme", "basic"],
)
def test_v1_routes_refuse_a_missing_or_wrong_key(server, headers):
    before = submitted(server.engine)
    for method, path, body in ROUTES:
        r = httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, body, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert submitted(server.engine) == before  # nothing refused reached the engine


def submitted(engine) -> int:
    stats = engine.stats()
    return sum(stats["finished"].values()) + stats["running"]


def test_every_v1_route_of_the_app_needs_the_key(server):
    """Routes added later under /v1 must carry the key check too (the app's OpenAPI
    schema lists them all)."""
    paths = httpx.get(server.base_url + "/openapi.json", timeout=30).json()["paths"]
    v1 = [(method, path) for path, methods in paths.items() if path.startswith("/v1") for method in methods]
    assert ("post", "/v1/chat/completions") in v1 and len(v1) >= 3
    for method, path in v1:
        r = httpx.request(method.upper(), server.base_url + path, json={}, timeout=30)
        assert r.status_code == 401, path


def test_the_right_key_gets_answers_and_streams(server):
    for method, path, body in ROUTES:
        r = httpx.request(method, server.base_url + path, json=body, headers=bearer(KEY), timeout=120)
        assert r.status_code == 200, (path, r.text)
        if body and body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
    client = OpenAI(base_url=server.base_url + "/v1", api_key=KEY)
    stream = client.chat.completions.create(model="smollm2", stream=True, **CHAT)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server.base_url + "/v1", api_key="wrong").models.list()


def test_health_and_dashboard_stay_open(server):
    for path in ("/health", "/dashboard", "/dashboard/summary"):
        assert httpx.get(server.base_url + path, timeout=30).status_code == 200, path


def test_the_per_user_limit_answers_429_and_frees_with_the_request(server):
    url = server.base_url + "/v1/completions"
    with httpx.stream(
        "POST", url, json={**COUNTING, "user": "alice"}, headers=bearer(KEY), timeout=120
    ) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a dropped iterator would close the stream
        next(lines)  # alice's request is running
        again = httpx.post(url, json={**COMPLETION, "user": "alice"}, headers=bearer(KEY), timeout=120)
        assert again.status_code == 429
        body = again.json()["error"]
        assert body["type"] == "rate_limit_error" and "'alice'" in body["message"]
        assert "1 unfinished" in body["message"]
        other = httpx.post(url, json={**COMPLETION, "user": "bob"}, headers=bearer(KEY), timeout=120)
        assert other.status_code == 200, other.text  # bob is not alice
    # closing alice's stream cancels her request, which frees her place
    for _ in range(100):
        later = httpx.post(url, json={**COMPLETION, "user": "alice"}, headers=bearer(KEY), timeout=120)
        if later.status_code != 429:
            break
    assert later.status_code == 200, later.text


def test_a_bad_user_field_is_a_400(server):
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={**COMPLETION, "user": "x" * 300},
        headers=bearer(KEY),
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "user"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_key(host):
    check_exposure(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "classroom.local"])
def test_listening_beyond_this_machine_needs_a_key_or_insecure(host):
    with pytest.raises(ValueError, match="without an API key.*--api-key KEY.*--insecure"):
        check_exposure(host, None)
    check_exposure(host, KEY)
    check_exposure(host, None, insecure=True)


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="API key is empty"):
        check_exposure("127.0.0.1", " ")


def test_serve_in_thread_refuses_before_binding(lm):
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0"):
        serve_in_thread(lm, host="0.0.0.0")


def test_batchlab_serve_refuses_before_loading_the_model(monkeypatch):
    import batchlab.model.load

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the host was checked")

    monkeypatch.setattr(batchlab.model.load, "load_model", no_model)
    monkeypatch.delenv("BATCHLAB_API_KEY", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--host", "0.0.0.0"])
    assert "refusing to listen on 0.0.0.0 without an API key" in str(e.value.code)


def test_serve_flags_are_parsed(monkeypatch):
    monkeypatch.setenv("BATCHLAB_API_KEY", "from-env")
    args = cli.build_parser().parse_args(["serve", "--max-running-per-user", "2", "--show-prompts"])
    assert (args.api_key, args.max_running_per_user, args.show_prompts, args.insecure) == (
        "from-env",
        2,
        True,
        False,
    )
    args = cli.build_parser().parse_args(
        ["loadgen", "--base-url", "http://x", "--user", "ann", "--api-key", "k"]
    )
    assert (args.user, args.api_key) == ("ann", "k")
    assert json.dumps(vars(args))  # plain values only
