"""An OpenAI-compatible HTTP server on top of the poll interface.

One ``EngineLoop`` runs the engine in its own thread. Each HTTP request submits to
it and then polls for new tokens whenever an engine step ends (the loop wakes the
waiting streams), so no client ever blocks the scheduler and the scheduler never waits
for a client. A client that goes away cancels its request, which frees its slot at the
next engine step. If the engine fails, or the server is shutting down, every open
stream ends with an error event instead of hanging.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .dashboard import add_dashboard
from .loop import EngineLoop
from ..model.load import LoadedModel
from ..core.policies import Admission, AdmissionBase, QueueFull
from ..core.trace import RequestRecord

DEFAULT_MAX_TOKENS = 512
# A waiting stream wakes when an engine step ends; it also looks at least this often, so
# no stream can hang on a lost wake-up.
HEARTBEAT_S = 1.0


class ContentPart(BaseModel):
    """One part of a message's content in OpenAI's array form; only text parts are read."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # "developer" is what newer OpenAI clients send for "system"; tool and function
    # messages parse only so that they get a clear refusal (see chat_turns)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None
    tool_calls: list | None = None
    function_call: dict | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the usage
    # vLLM's extension (GuideLLM sends it, aiperf with --per-chunk-usage): with include_usage,
    # every chunk also carries the usage so far
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's API does;
    known fields of the wrong type or out of range are a 400."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    priority: int = 0  # vLLM's extension: lower is served first and preempted last
    user: str | None = Field(None, max_length=256)  # who sent it: the dashboard's label, per-user limits
    logprobs: bool | int | None = None  # refused (see refusal), never silently ignored
    top_logprobs: int | None = None
    # vLLM's extensions that benchmark clients send (vllm bench serve, GuideLLM, aiperf):
    ignore_eos: bool = False  # keep going past EOS (fixed output lengths)
    min_tokens: int = Field(0, ge=0)  # no stop token before this many tokens
    stop_token_ids: list[int] | None = None  # more tokens that end the answer
    top_k: int = Field(0, ge=0)  # sample among the k most likely (0: all)
    # fields that would change the answer and that this server does not do: refused unless
    # they ask for nothing (see refusal)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    best_of: int | None = None
    response_format: dict | None = None
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None


class Unsupported(ValueError):
    """A well-formed request asking for what this server does not do: a 400 naming ``param``."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


NO_TOOLS = "tool calls are not supported: this server only generates text"
# Known fields this server does not implement, with the values that ask for nothing
UNSUPPORTED_UNLESS = {
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_p": (0.0,),
    "best_of": (None, 1),
}


def refusal(req: SamplingFields) -> Unsupported | None:
    """Why the server cannot serve this request as asked, if it cannot (rather than
    ignoring a field that would change the answer's form)."""
    if req.logprobs is not None and req.logprobs is not False:
        return Unsupported("logprobs are not supported by this server", "logprobs")
    if req.top_logprobs:
        return Unsupported("top_logprobs are not supported by this server", "top_logprobs")
    for field, neutral in UNSUPPORTED_UNLESS.items():
        if getattr(req, field) not in neutral:
            return Unsupported(f"{field} is not supported by this server (only {neutral[0]!r})", field)
    if req.response_format is not None and req.response_format.get("type") != "text":
        return Unsupported("response_format: this server writes plain text only", "response_format")
    if req.stream_options is not None and not req.stream:  # as vLLM: it would be silently unused
        return Unsupported("stream_options can only be given with stream: true", "stream_options")
    if req.logit_bias:  # {} and null ask for nothing
        return Unsupported("logit_bias is not supported by this server", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            return Unsupported("echo is not supported by this server: it sends the answer only", "echo")
        if req.suffix:
            return Unsupported("suffix (insertion) is not supported by this server", "suffix")
    if isinstance(req, ChatRequest):
        for field in ("tools", "functions"):
            if getattr(req, field):
                return Unsupported(NO_TOOLS, field)
        for field in ("tool_choice", "function_call"):
            if getattr(req, field) not in (None, "none"):
                return Unsupported(NO_TOOLS, field)
    return None


def vllm_extensions(req: SamplingFields, max_new: int) -> dict:
    """The engine's arguments for vLLM's ``ignore_eos``, ``min_tokens`` and ``stop_token_ids``,
    only those the request sets (an engine of a learner's may not know them)."""
    given = {
        "ignore_eos": req.ignore_eos,
        "min_new_tokens": min(req.min_tokens, max_new),
        "stop_token_ids": list(req.stop_token_ids or ()),
    }
    return {k: v for k, v in given.items() if v}


def chat_turns(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them: role "developer" read as "system",
    content-part arrays joined into one text. Raises ``Unsupported`` for tool calls and
    for parts that are not text (images, audio, files)."""
    turns = []
    for i, message in enumerate(messages):
        if message.role in ("tool", "function") or message.tool_calls or message.function_call:
            raise Unsupported(NO_TOOLS, f"messages.{i}")
        content = message.content
        if isinstance(content, list):
            for k, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise Unsupported(
                        f"content part type {part.type!r} is not supported: this model reads text only",
                        f"messages.{i}.content.{k}",
                    )
            content = "".join(part.text for part in content)
        role = "system" if message.role == "developer" else message.role
        turns.append({"role": role, "content": content or ""})
    return turns


class StreamEnded(Exception):
    """A stream that cannot go on: its request failed in the engine, the engine stopped,
    or the server is shutting down. ``status`` is the HTTP status a non-streamed answer gets."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    echo: bool = False  # the prompt in front of the answer: refused (see refusal)
    suffix: str | None = None  # text after the insertion point: refused


def error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
):
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": code}},
    )


class Unauthorized(Exception):
    """A /v1 request without the server's API key."""


class TooManyRunning(Exception):
    """A user already has as many unfinished requests as ``--max-running-per-user`` allows."""


async def require_key(request: Request) -> None:
    """A FastAPI dependency that lets a request through only with ``Authorization: Bearer
    <api_key>`` (compared in constant time, so response times leak nothing about the key).
    Without a key (``AppState.api_key`` is None) it lets everything through."""
    api_key = app_state(request).api_key
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise Unauthorized


AUTH = Depends(require_key)  # on every /v1 route


def check_exposure(host: str, api_key: str | None, insecure: bool = False) -> None:
    """Refuse to listen beyond this machine without an API key (unless ``insecure``)."""
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty; give a real key, e.g. --api-key $(openssl rand -hex 8)")
    if api_key or insecure:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        loopback = False
    if not loopback:
        raise ValueError(
            f"refusing to listen on {host} without an API key: anyone who can reach this machine "
            "could use the model and read what others send. Give --api-key KEY (clients then send "
            "'Authorization: Bearer KEY'), or --insecure if the network is yours alone."
        )


@dataclass
class Client:
    """Who sent a request (the OpenAI ``user`` field) and what: per-user limits and the
    dashboard read it. ``record`` is the engine's record, kept after the engine forgets it."""

    user: str | None
    prompt_ids: list[int]
    record: RequestRecord


class StopMatcher:
    """Finds stop strings in streamed text. Text that might be the start of a stop
    string is held back until we know, so a stop string is never half-sent."""

    def __init__(self, stops: list[str]):
        self.stops, self.buffer = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to send, whether a stop string was found)."""
        self.buffer += text
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buffer = self.buffer[: min(hits)], ""
            return out, True
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if self.buffer.endswith(s[:k])), default=0
        )
        out = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


class ServerBase:
    """The server's mechanism, with no stream in it: the engine loop, who sent what, the
    wake-up of waiting streams, ``submit`` and shutdown. What a request's stream sends,
    and when, is :meth:`events`, which a subclass writes (ours: :class:`Server`; lesson 7
    has the learner write theirs)."""

    def __init__(
        self, lm: LoadedModel, loop: EngineLoop, model_id: str, max_running_per_user: int | None = None
    ):
        self.lm, self.loop, self.model_id = lm, loop, model_id
        self.started = int(time.time())
        if max_running_per_user is not None and max_running_per_user < 1:
            raise ValueError("max_running_per_user must be at least 1")
        self.max_running_per_user = max_running_per_user
        self.clients: dict[str, Client] = {}  # unfinished requests: who sent them
        self.on_submit: list[Callable[[str, Client], None]] = []  # e.g. the dashboard's
        self.closing: str | None = None  # why the server refuses new work and ends streams
        self._progress = asyncio.Event()  # replaced by a fresh one each time it is set
        self._aio: asyncio.AbstractEventLoop | None = None

    def unavailable(self) -> str | None:
        """Why the server cannot take a request now (503), or None."""
        if self.loop.error is not None:
            return f"the engine has stopped: {self.loop.error!r}"
        return self.closing

    def close(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and end every open stream with an error event (from any
        thread, including a signal handler)."""
        self.closing = reason
        self._notify()

    def next_progress(self) -> asyncio.Event:
        """The event that is set when the next engine step ends (or the server closes): a
        stream awaits it between polls, so it neither busy-polls nor blocks the event loop.
        Take it before polling, so a step that ends between the poll and the wait still
        wakes the stream."""
        if self._aio is None:  # the first stream: from now on, every step wakes the streams
            self._aio = asyncio.get_running_loop()
            self.loop.add_listener(self._notify)
        return self._progress

    def _notify(self) -> None:
        """Wake every waiting stream; called from the engine's thread (or a signal handler)."""
        if self._aio is None:
            return
        try:
            self._aio.call_soon_threadsafe(self._wake_streams)
        except RuntimeError:  # the event loop has closed: no stream is left to wake
            pass

    def _wake_streams(self) -> None:
        event, self._progress = self._progress, asyncio.Event()
        event.set()

    def submit(self, prompt_ids: list[int], req: SamplingFields) -> str:
        """Raises ValueError for a request the engine refuses (too long, bad ids...),
        QueueFull when the engine's admission policy has no room, and TooManyRunning when
        the user already has ``max_running_per_user`` unfinished requests (requests without
        a ``user`` count as one user)."""
        self.clients = {rid: c for rid, c in self.clients.items() if c.record.finished_s is None}
        limit = self.max_running_per_user
        if limit is not None and sum(c.user == req.user for c in self.clients.values()) >= limit:
            who = f"user {req.user!r}" if req.user is not None else "requests without a user"
            raise TooManyRunning(
                f"{who} already has {limit} unfinished request(s), the most this "
                "server allows per user; wait for one to finish"
            )
        max_new = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
        rid = self.loop.submit(
            prompt_ids,
            max_new_tokens=max_new,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            priority=req.priority,
            **vllm_extensions(req, max_new),
        )
        client = self.clients[rid] = Client(req.user, prompt_ids, self.loop.engine.trace.requests[rid])
        for listener in self.on_submit:
            listener(rid, client)
        return rid

    async def events(self, rid: str, stops: list[str]) -> AsyncIterator[tuple[str, str | None, int]]:
        """Yield (new text, finish reason or None, tokens so far) until request ``rid`` ends."""
        raise NotImplementedError(
            f"{type(self).__name__} must write events(rid, stops): poll the request, yield one piece of "
            "text per token, wait for the engine's next step between polls, and cancel the request "
            "if the stream is closed before it ends"
        )
        yield  # (an async generator)


class Server(ServerBase):
    """Our server: :meth:`ServerBase` plus the stream of each request."""

    async def events(self, rid: str, stops: list[str]) -> AsyncIterator[tuple[str, str | None, int]]:
        """Yield (new text, finish reason or None, tokens so far) until the request ends:
        one piece per token that adds text, so a client can time every token (ITL).
        Raises ``StreamEnded`` if the request fails, the engine stops or the server closes.
        If the consumer goes away (a disconnect cancels this generator), cancel the request."""
        detok, stopper = self.lm.tokenizer.detokenizer(), StopMatcher(stops)
        eos, count, done = self.lm.tokenizer.eos_token_ids, 0, False
        try:
            while True:
                progress = self.next_progress()
                tokens, status, reason = self.loop.poll(rid)
                for token in tokens:  # one piece per token, as OpenAI's servers stream
                    count += 1
                    sent, hit = stopper.feed(detok.add(token) if token not in eos else "")
                    if hit:
                        self.loop.stop_string_met(rid)
                        done = True
                        yield sent, "stop", count
                        return
                    if sent:
                        yield sent, None, count
                if reason == "error":
                    done = True
                    raise StreamEnded("the engine failed while running this request", 500)
                if status != "running":
                    sent, hit = stopper.feed(detok.flush())
                    done = True
                    reason = "stop" if hit or reason == "cancelled" else reason
                    yield sent + ("" if hit else stopper.flush()), reason, count
                    return
                if self.unavailable():
                    raise StreamEnded(self.unavailable(), 503)
                try:
                    await asyncio.wait_for(progress.wait(), HEARTBEAT_S)
                except asyncio.TimeoutError:  # (Python 3.10: not yet the builtin TimeoutError)
                    pass
        finally:
            if not done:
                self.loop.cancel(rid)


@dataclass
class AppState:
    """What the HTTP handlers share, kept on ``app.state.batchlab`` by :func:`create_app`:
    the ``Server`` (model, engine loop, model id, per-user limit) and the API key."""

    server: Server
    api_key: str | None = None


def app_state(request: Request) -> AppState:
    """The ``AppState`` of the app that received ``request``."""
    return request.app.state.batchlab


async def _unauthorized(request: Request, exc: Unauthorized):
    """A 401 that tells the client how to send the key."""
    response = error(
        401,
        "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
        code="invalid_api_key",
    )
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


async def _bad_request(request: Request, exc: RequestValidationError):
    """A 400 in OpenAI's error form naming the first bad field (FastAPI's default is a 422)."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return error(400, "the request body is not valid JSON")
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)


# The route handlers below say what they do in comments, not docstrings: FastAPI would
# publish a docstring in /openapi.json and /docs.


# GET /health: 200, or a 503 saying why the server cannot serve (or is failing).
async def health(request: Request):
    server = app_state(request).server
    if server.unavailable():
        return error(503, server.unavailable(), "server_error")
    if server.loop.engine.failing:  # it still takes requests, but an operator must know
        return error(503, server.loop.engine.failing, "server_error")
    return {"status": "ok"}


# GET /v1/models: the one model this server serves.
async def models(request: Request):
    server = app_state(request).server
    return {
        "object": "list",
        "data": [
            {"id": server.model_id, "object": "model", "created": server.started, "owned_by": "batchlab"}
        ],
    }


# GET /metrics: the engine's queue, slots, KV blocks and recent tokens/s, in Prometheus'
# text format.
async def metrics(request: Request):
    engine = app_state(request).server.loop.engine
    stats = engine.stats()
    recent = [s for s in list(engine.trace.steps)[-200:] if s.end_s > engine.clock() - 10]
    tokens = sum(len(t) for s in recent for t in s.emitted.values())
    busy = engine.slots_busy()
    lines = [
        "# HELP batchlab_queue_depth Requests waiting to be admitted.",
        f"batchlab_queue_depth {engine.queue_depth()}",
        f"batchlab_slots_busy {busy}",
        f"batchlab_slots_total {engine.scheduler.max_batch_size}",
        f"batchlab_requests_running {stats['running']}",
        "# HELP batchlab_tokens_per_second Output tokens per second over the last 10 s.",
        f"batchlab_tokens_per_second {tokens / 10:.3f}",
        f"batchlab_kv_blocks_free {stats['free_kv_blocks']}",
        f"batchlab_kv_blocks_total {stats['num_kv_blocks']}",
    ] + [
        f'batchlab_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(stats["finished"].items())
    ]
    return PlainTextResponse("\n".join(lines) + "\n")


def sse(payload: dict) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return "data: " + json.dumps(payload) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"  # the last event of every stream, as OpenAI's servers end them


@dataclass
class Reply:
    """The parts of one answer that OpenAI's format repeats in its body or in every chunk
    of its stream: the id, the object kind, when it was made, the model, the usage."""

    chat: bool
    model: str
    prompt_tokens: int
    usage_every_chunk: bool  # vLLM's continuous_usage_stats (with include_usage)
    ident: str
    created: int

    @classmethod
    def new(cls, req: SamplingFields, chat: bool, model: str, prompt_tokens: int) -> "Reply":
        """A fresh id and creation time for an answer to ``req``."""
        options = req.stream_options or StreamOptions()
        return cls(
            chat=chat,
            model=model,
            prompt_tokens=prompt_tokens,
            usage_every_chunk=options.include_usage and options.continuous_usage_stats,
            ident=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            created=int(time.time()),
        )

    @property
    def kind(self) -> str:
        """OpenAI's ``object`` of the whole answer."""
        return "chat.completion" if self.chat else "text_completion"

    def usage(self, count: int) -> dict:
        """The token counts once ``count`` tokens are generated."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": count,
            "total_tokens": self.prompt_tokens + count,
        }

    def choice(self, text: str, reason: str | None, final: bool) -> dict:
        """The one choice: a chat answer's ``message`` (or a chunk's ``delta``), or a
        completion's ``text``."""
        if self.chat:
            body = (
                {"delta": {"content": text} if text else {}}
                if not final
                else {"message": {"role": "assistant", "content": text}}
            )
        else:
            body = {"text": text}
        return {"index": 0, **body, "finish_reason": reason, "logprobs": None}

    def body(self, text: str, reason: str | None, count: int) -> dict:
        """The whole answer, not streamed."""
        return {
            "id": self.ident,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(text, reason, final=True)],
            "usage": self.usage(count),
        }

    def chunk(self, choices: list, count: int = 0, **extra) -> str:
        """One event of the stream; ``count`` is the tokens so far, for the usage that
        every chunk with a choice carries when ``usage_every_chunk``."""
        if self.usage_every_chunk and choices:
            extra["usage"] = self.usage(count)
        obj = self.kind + (".chunk" if self.chat else "")
        return sse(
            {
                "id": self.ident,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
        )


async def whole_answer(http: Request, server: ServerBase, rid: str, stops: list[str], reply: Reply):
    """Wait for the whole answer, then send it in one body; a client that goes away
    cancels the request (499)."""
    text, reason, count = "", None, 0
    try:
        async for piece, reason, count in server.events(rid, stops):
            text += piece
            if await http.is_disconnected():
                server.loop.cancel(rid)
                return error(499, "client closed the request")
    except StreamEnded as e:
        return error(e.status, str(e), "server_error")
    except Exception as e:  # a learner's events() that fails: this request ends, the server serves on
        return error(500, stream_failed(server, rid, e), "server_error")
    return reply.body(text, reason, count)


def stream_failed(server: ServerBase, rid: str, e: Exception) -> str:
    """A stream's ``events()`` raised (a learner's, say): cancel its request, so its slot is
    not held to the end, log the traceback, and say what happened, for the client."""
    server.loop.cancel(rid)
    logging.getLogger("batchlab.server").error(
        "%s.events() raised for request %s", type(server).__name__, rid, exc_info=e
    )
    return f"{type(server).__name__}.events() raised {type(e).__name__}: {e}"


async def streamed_answer(
    server: ServerBase, rid: str, req: SamplingFields, reply: Reply
) -> AsyncIterator[str]:
    """The answer as server-sent events: one per token that adds text (the last one with
    the finish reason), then the usage if asked for, then ``[DONE]``. The status (200) is sent already, so a failure mid-way is
    an error event, as OpenAI's and vLLM's servers send."""
    options = req.stream_options or StreamOptions()
    if reply.chat:
        yield reply.chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )
    count = 0
    try:
        async for piece, reason, count in server.events(rid, req.stop):
            if piece or reason:
                yield reply.chunk([reply.choice(piece, reason, final=False)], count)
    except StreamEnded as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": e.status}})
        yield SSE_DONE
        return
    except Exception as e:  # a learner's events() that fails: this stream ends, the server serves on
        yield sse(
            {
                "error": {
                    "message": stream_failed(server, rid, e),
                    "type": "server_error",
                    "param": None,
                    "code": 500,
                }
            }
        )
        yield SSE_DONE
        return
    if options.include_usage:
        yield reply.chunk([], usage=reply.usage(count))
    yield SSE_DONE


async def respond(http: Request, req: SamplingFields, prompt_ids: list[int], chat: bool):
    """Both endpoints after their prompt is tokens: refuse what cannot be served (503, 400,
    429), submit, and answer whole or streamed as ``req.stream`` asks."""
    server = app_state(http).server
    if server.unavailable():
        return error(503, server.unavailable(), "server_error")
    if refused := refusal(req):
        return error(400, str(refused), param=refused.param)
    try:
        rid = server.submit(prompt_ids, req)
    except ValueError as e:
        return error(400, str(e))
    except (QueueFull, TooManyRunning) as e:
        return error(429, str(e), "rate_limit_error")
    reply = Reply.new(req, chat, server.model_id, len(prompt_ids))
    if not req.stream:
        return await whole_answer(http, server, rid, req.stop, reply)
    return StreamingResponse(streamed_answer(server, rid, req, reply), media_type="text/event-stream")


# POST /v1/chat/completions: the messages through the model's chat template.
async def chat_completions(req: ChatRequest, http: Request):
    try:
        prompt_ids = app_state(http).server.lm.tokenizer.encode_chat(chat_turns(req.messages))
    except Unsupported as e:
        return error(400, str(e), param=e.param)
    except ValueError as e:
        return error(400, str(e), param="messages")
    return await respond(http, req, prompt_ids, chat=True)


# POST /v1/completions: a prompt given as text or as token ids.
async def completions(req: CompletionRequest, http: Request):
    prompt = req.prompt
    prompt_ids = app_state(http).server.lm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return await respond(http, req, prompt_ids, chat=False)


def create_app(server: ServerBase, api_key: str | None = None, show_prompts: bool = False) -> FastAPI:
    """The HTTP app. With ``api_key``, every /v1 route needs it; /health, /metrics and the
    dashboard stay open (the dashboard shows prompt text only with ``show_prompts``).
    The handlers are module-level and read ``server`` and ``api_key`` from
    ``app.state.batchlab`` (an ``AppState``)."""
    app = FastAPI(title="batchlab", version="0.1")
    app.state.batchlab = AppState(server, api_key)
    app.add_exception_handler(Unauthorized, _unauthorized)
    app.add_exception_handler(RequestValidationError, _bad_request)
    # in this order: the routes (and /openapi.json) are as when they were declared inline
    app.get("/health")(health)
    app.get("/v1/models", dependencies=[AUTH])(models)
    app.get("/metrics")(metrics)
    app.post("/v1/chat/completions", dependencies=[AUTH])(chat_completions)
    app.post("/v1/completions", dependencies=[AUTH])(completions)
    add_dashboard(app, server, show_prompts=show_prompts)
    return app


# After the streams have been told to end, how long shutdown waits for a connection
# (a client that reads slowly) before uvicorn cancels it.
GRACEFUL_SHUTDOWN_S = 5


def _uvicorn(server: ServerBase, api_key: str | None, show_prompts: bool, **config):
    """A uvicorn server that, on shutdown (SIGTERM, Ctrl+C, ``should_exit``), first ends
    every open stream; uvicorn alone would wait until each had generated its last token."""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        async def shutdown(self, sockets=None):
            server.close()
            await super().shutdown(sockets)

    app = create_app(server, api_key, show_prompts)
    return Uvicorn(uvicorn.Config(app, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **config))


def _start(
    lm: LoadedModel,
    kind,
    *,
    host: str,
    max_queue: int,
    trace_limit: int | None,
    model_id: str | None,
    api_key: str | None,
    insecure: bool,
    max_running_per_user: int | None,
    show_prompts: bool,
    engine_options: dict,
    uvicorn_config: dict,
    shedding: type[AdmissionBase] = Admission,
    max_wait_s: float | None = None,
    server_class: type[ServerBase] = Server,
):
    """What ``batchlab serve`` and :func:`serve_in_thread` share: refuse an exposed ``host``
    without a key, make the engine, start its loop, and put the app on a uvicorn server
    (``uvicorn_config``: its ``uvicorn.Config`` arguments). ``shedding`` is the admission
    class, made with ``max_queue`` and ``max_wait_s``; ``server_class`` writes each request's
    stream (``events``: ours, or a learner's ``ServerBase`` subclass). Returns (uvicorn server, loop):
    the caller runs the one, blocking or in a thread, and stops the other. If this fails
    after the loop started, it stops the loop."""
    from ..core.engine import make_engine

    check_exposure(host, api_key, insecure)
    admission = shedding(max_queue=max_queue, max_wait_s=max_wait_s)
    engine = make_engine(kind, lm, trace_limit=trace_limit, admission=admission, **engine_options)
    loop = EngineLoop(engine).start()
    try:
        server = server_class(lm, loop, model_id or lm.info.name, max_running_per_user)
        return _uvicorn(server, api_key, show_prompts, **uvicorn_config), loop
    except BaseException:
        loop.stop()
        raise


def serve(
    lm: LoadedModel,
    kind,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queue: int = 64,
    api_key: str | None = None,
    insecure: bool = False,
    max_running_per_user: int | None = None,
    show_prompts: bool = False,
    shedding: type[AdmissionBase] = Admission,
    max_wait_s: float | None = None,
    server_class: type[ServerBase] = Server,
    **engine_options,
) -> None:
    """Run the server until interrupted (``batchlab serve``). ``shedding`` (an
    ``AdmissionBase`` class, e.g. a learner's) sheds what waited over ``max_wait_s``;
    ``server_class`` writes each request's stream (a learner's ``ServerBase`` subclass);
    ``engine_options`` go to ``make_engine`` (``engine_class``: a learner's front)."""
    uv, loop = _start(
        lm,
        kind,
        host=host,
        max_queue=max_queue,
        trace_limit=2000,  # a long-running server keeps only its recent steps and requests
        model_id=None,
        api_key=api_key,
        insecure=insecure,
        max_running_per_user=max_running_per_user,
        show_prompts=show_prompts,
        engine_options=engine_options,
        uvicorn_config={"host": host, "port": port, "log_level": "info"},
        shedding=shedding,
        max_wait_s=max_wait_s,
        server_class=server_class,
    )
    try:
        uv.run()  # here, until SIGTERM or Ctrl+C
    finally:
        loop.stop()


class ServerThread:
    """A running in-process server (from :func:`serve_in_thread`): its ``base_url``, the
    ``engine`` and ``loop`` behind it (for slot views and tests), and ``stop()``."""

    def __init__(self, uv, thread, sock, loop: EngineLoop):
        self._uv, self._thread, self._sock, self.loop = uv, thread, sock, loop
        self.engine = loop.engine
        host, port = sock.getsockname()[:2]
        self.base_url = f"http://{host}:{port}"

    def stop(self) -> None:
        """Stop the HTTP server, then the engine loop (idempotent)."""
        self._uv.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()
        self.loop.stop()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_in_thread(
    lm: LoadedModel,
    kind="stallfree",
    host: str = "127.0.0.1",
    port: int = 0,
    max_queue: int = 64,
    model_id: str | None = None,
    trace_limit: int | None = 5000,
    api_key: str | None = None,
    insecure: bool = False,
    max_running_per_user: int | None = None,
    show_prompts: bool = False,
    shedding: type[AdmissionBase] = Admission,
    max_wait_s: float | None = None,
    server_class: type[ServerBase] = Server,
    **engine_options,
) -> ServerThread:
    """Start the server in a background thread of this process (a notebook or a test) and
    return once it accepts connections. ``port=0`` takes a free port; the socket is bound
    here, before the thread starts, so no other process can take it in between.
    ``api_key``, ``insecure``, ``max_running_per_user``, ``show_prompts``, ``shedding``,
    ``max_wait_s`` and ``server_class`` are as for ``batchlab serve``."""
    import socket
    import threading

    uv, loop = _start(
        lm,
        kind,
        host=host,
        max_queue=max_queue,
        trace_limit=trace_limit,
        model_id=model_id,
        api_key=api_key,
        insecure=insecure,
        max_running_per_user=max_running_per_user,
        show_prompts=show_prompts,
        engine_options=engine_options,
        uvicorn_config={"log_level": "warning"},  # the socket is given to run() instead
        shedding=shedding,
        max_wait_s=max_wait_s,
        server_class=server_class,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        thread = threading.Thread(
            target=uv.run, kwargs={"sockets": [sock]}, name="batchlab-http", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + 30
        while not uv.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
    except BaseException:
        loop.stop()
        sock.close()
        raise
    return ServerThread(uv, thread, sock, loop)
