"""The HTTP app: OpenAI's routes over a ``Server``, their answers whole or streamed.

``create_app`` puts the routes on a FastAPI app: ``/v1/chat/completions`` and
``/v1/completions`` (each request checked, submitted, then answered in one body or as
server-sent events, one per token), ``/v1/models``, ``/health``, ``/metrics`` and the
dashboard. The handlers are module-level and read the server from ``app.state.batchlab``.
Every /v1 route needs the server's API key when it has one (``require_key``).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse

from .dashboard import add_dashboard
from ..core.structured import CompileError
from .protocol import (
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    StreamOptions,
    Unsupported,
    chat_turns,
    error,
    refusal,
)
from .server import ServerBase, StreamEnded, TooManyRunning
from ..core.policies import QueueFull


@dataclass
class AppState:
    """What the HTTP handlers share, kept on ``app.state.batchlab`` by :func:`create_app`:
    the server (a ``ServerBase``: model, engine loop, model id, per-user limit) and the API key."""

    server: ServerBase
    api_key: str | None = None


def app_state(request: Request) -> AppState:
    """The ``AppState`` of the app that received ``request``."""
    return request.app.state.batchlab


# -- who may use the server: the API key every /v1 route needs ----------------------------
class Unauthorized(Exception):
    """A /v1 request without the server's API key."""


async def require_key(request: Request) -> None:
    """A FastAPI dependency that lets a request through only with ``Authorization: Bearer
    <api_key>`` (compared in constant time, so response times leak nothing about the key).
    Without a key (``AppState.api_key`` is None) it lets everything through."""
    api_key = request.app.state.batchlab.api_key
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise Unauthorized


AUTH = Depends(require_key)  # on every /v1 route


async def unauthorized(request: Request, exc: Unauthorized):
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
        "# HELP batchlab_spec_draft_tokens_total Draft tokens verified (speculative decoding).",
        f"batchlab_spec_draft_tokens_total {engine.spec_drafted}",
        "# HELP batchlab_spec_accepted_tokens_total Draft tokens the model agreed with, kept as output.",
        f"batchlab_spec_accepted_tokens_total {engine.spec_accepted}",
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
    def object_name(self) -> str:
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
        """The one choice: a chat answer's ``message`` (or a stream event's ``delta``), or a
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
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(text, reason, final=True)],
            "usage": self.usage(count),
        }

    def event(self, choices: list, count: int = 0, **extra) -> str:
        """One event of the stream; ``count`` is the tokens so far, for the usage that
        every chunk with a choice carries when ``usage_every_chunk``."""
        if self.usage_every_chunk and choices:
            extra["usage"] = self.usage(count)
        obj = self.object_name + (".chunk" if self.chat else "")
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
        yield reply.event(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )
    count = 0
    try:
        async for piece, reason, count in server.events(rid, req.stop):
            if piece or reason:
                yield reply.event([reply.choice(piece, reason, final=False)], count)
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
        yield reply.event([], usage=reply.usage(count))
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
    except CompileError as e:  # the pattern or schema the grammar library cannot compile
        return error(400, str(e), param="structured_outputs" if req.structured_outputs else "response_format")
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
    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(RequestValidationError, _bad_request)
    # in this order: the routes (and /openapi.json) are as when they were declared inline
    app.get("/health")(health)
    app.get("/v1/models", dependencies=[AUTH])(models)
    app.get("/metrics")(metrics)
    app.post("/v1/chat/completions", dependencies=[AUTH])(chat_completions)
    app.post("/v1/completions", dependencies=[AUTH])(completions)
    add_dashboard(app, server, show_prompts=show_prompts)
    return app
