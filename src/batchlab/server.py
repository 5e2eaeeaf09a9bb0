"""An OpenAI-compatible HTTP server on top of the poll interface.

One ``EngineLoop`` runs the engine in its own thread. Each HTTP request submits to
it and then polls for new tokens between short sleeps, so no client ever blocks the
scheduler and the scheduler never waits for a client. A client that goes away
cancels its request, which frees its slot at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .loop import EngineLoop
from .model import LoadedModel
from .policies import Admission, QueueFull

POLL_INTERVAL_S = 0.005
DEFAULT_MAX_TOKENS = 512


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


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

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[int]


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": None}})


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
            out, self.buffer = self.buffer[:min(hits)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.buffer.endswith(s[:k])),
                   default=0)
        out = self.buffer[:len(self.buffer) - hold]
        self.buffer = self.buffer[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


class Server:
    def __init__(self, lm: LoadedModel, loop: EngineLoop, model_id: str):
        self.lm, self.loop, self.model_id = lm, loop, model_id
        self.started = int(time.time())

    def submit(self, prompt_ids: list[int], req: SamplingFields) -> str:
        """Raises ValueError for a request the engine refuses (too long, bad ids...) and
        QueueFull when the engine's admission policy has no room."""
        max_new = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
        return self.loop.submit(prompt_ids, max_new_tokens=max_new, temperature=req.temperature,
                                top_p=req.top_p, seed=req.seed, priority=req.priority)

    async def events(self, rid: str, stops: list[str]) -> AsyncIterator[tuple[str, str | None, int]]:
        """Yield (new text, finish reason or None, tokens so far) until the request ends:
        one piece per token that adds text, so a client can time every token (ITL).
        If the consumer goes away (a disconnect cancels this generator), cancel the request."""
        detok, stopper = self.lm.tokenizer.detokenizer(), StopMatcher(stops)
        eos, count, done = self.lm.tokenizer.eos_token_ids, 0, False
        try:
            while True:
                tokens, status, reason = self.loop.poll(rid)
                for token in tokens:  # one piece per token, as OpenAI's servers stream
                    count += 1
                    sent, hit = stopper.feed(detok.add(token) if token not in eos else "")
                    if hit:
                        self.loop.cancel(rid)
                        done = True
                        yield sent, "stop", count
                        return
                    if sent:
                        yield sent, None, count
                if status != "running":
                    sent, hit = stopper.feed(detok.flush())
                    done = True
                    reason = "stop" if hit or reason == "cancelled" else reason
                    yield sent + ("" if hit else stopper.flush()), reason, count
                    return
                await asyncio.sleep(POLL_INTERVAL_S)
        finally:
            if not done:
                self.loop.cancel(rid)


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="batchlab", version="0.1")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error(400, "the request body is not valid JSON")
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

    @app.get("/health")
    async def health():
        if server.loop.error is not None:
            return error(503, f"engine stopped: {server.loop.error!r}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model",
                                            "created": server.started, "owned_by": "batchlab"}]}

    @app.get("/metrics")
    async def metrics():
        engine = server.loop.engine
        stats = engine.stats()
        recent = [s for s in list(engine.trace.steps)[-200:] if s.end_s > engine.clock() - 10]
        tokens = sum(len(t) for s in recent for t in s.emitted.values())
        busy = sum(r is not None for r in engine.scheduler.slots)
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
        ] + [f'batchlab_requests_finished_total{{reason="{r}"}} {n}'
             for r, n in sorted(stats["finished"].items())]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def respond(http: Request, req: SamplingFields, prompt_ids: list[int], chat: bool):
        if server.loop.error is not None:
            return error(503, "the engine has stopped", "server_error")
        try:
            rid = server.submit(prompt_ids, req)
        except ValueError as e:
            return error(400, str(e))
        except QueueFull as e:
            return error(429, str(e), "rate_limit_error")
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        kind = "chat.completion" if chat else "text_completion"
        created = int(time.time())

        def usage(count):
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": count,
                    "total_tokens": len(prompt_ids) + count}

        def choice(text, reason, final):
            if chat:
                body = {"delta": {"content": text} if text else {}} if not final else \
                    {"message": {"role": "assistant", "content": text}}
            else:
                body = {"text": text}
            return {"index": 0, **body, "finish_reason": reason, "logprobs": None}

        if not req.stream:
            text, reason, count = "", None, 0
            async for piece, reason, count in server.events(rid, req.stop):
                text += piece
                if await http.is_disconnected():
                    server.loop.cancel(rid)
                    return error(499, "client closed the request")
            return {"id": ident, "object": kind, "created": created, "model": server.model_id,
                    "choices": [choice(text, reason, final=True)], "usage": usage(count)}

        async def sse():
            obj = kind + (".chunk" if chat else "")

            def chunk(choices, **extra):
                return "data: " + json.dumps({"id": ident, "object": obj, "created": created,
                                              "model": server.model_id, "choices": choices,
                                              **extra}) + "\n\n"

            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None}])
            count = 0
            async for piece, reason, count in server.events(rid, req.stop):
                if piece or reason:
                    yield chunk([choice(piece, reason, final=False)])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=usage(count))
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, http: Request):
        try:
            prompt_ids = server.lm.tokenizer.encode_chat([m.model_dump() for m in req.messages])
        except ValueError as e:
            return error(400, str(e), param="messages")
        return await respond(http, req, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        prompt = req.prompt
        prompt_ids = server.lm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return await respond(http, req, prompt_ids, chat=False)

    return app


def serve(lm: LoadedModel, kind: str, host: str = "127.0.0.1", port: int = 8000,
          max_queue: int = 64, **engine_options) -> None:
    """Run the server until interrupted (``batchlab serve``)."""
    import uvicorn

    from .engine import make_engine

    engine = make_engine(kind, lm, trace_limit=2000, admission=Admission(max_queue=max_queue),
                         **engine_options)
    with EngineLoop(engine) as loop:
        app = create_app(Server(lm, loop, lm.info.name))
        uvicorn.run(app, host=host, port=port, log_level="info")


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


def serve_in_thread(lm: LoadedModel, kind: str = "stallfree", host: str = "127.0.0.1",
                    port: int = 0, max_queue: int = 64, model_id: str | None = None,
                    trace_limit: int | None = 5000, **engine_options) -> ServerThread:
    """Start the server in a background thread of this process (a notebook or a test) and
    return once it accepts connections. ``port=0`` takes a free port; the socket is bound
    here, before the thread starts, so no other process can take it in between."""
    import socket
    import threading

    import uvicorn

    from .engine import make_engine

    engine = make_engine(kind, lm, trace_limit=trace_limit, admission=Admission(max_queue=max_queue),
                         **engine_options)
    loop = EngineLoop(engine).start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        app = create_app(Server(lm, loop, model_id or lm.info.name))
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]},
                                  name="batchlab-http", daemon=True)
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
