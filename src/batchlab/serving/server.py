"""``EngineLoop``, an engine stepping in a background thread and used from any other (lesson 6),
and the server over it that lesson 7 teaches: ``ServerBase``, its mechanism, and ``Server``, the
stream of each request.

One ``EngineLoop`` runs the engine in its own thread (``engine.step()`` in a loop, asleep
when there is nothing to do); ``submit`` / ``poll`` / ``cancel`` reach it from any thread.
Each HTTP request submits to
it and then polls for new tokens whenever an engine step ends (the loop wakes the
waiting streams), so no client ever blocks the scheduler and the scheduler never waits
for a client. A client that goes away cancels its request, which frees its slot at the
next engine step. If the engine fails, or the server is shutting down, every open
stream ends with an error event instead of hanging.

``ServerBase`` holds the engine loop, who sent what, the wake-ups, ``submit`` and
shutdown; ``Server`` adds ``events``, which a learner's ``MyServer(ServerBase)`` writes
in lesson 7. The rest of the OpenAI-compatible server is beside it: ``protocol`` (the
request schema and its checks), ``app`` (the FastAPI routes and the API key)
and ``launch`` (``serve``, ``serve_in_thread`` and their ``ServerConfig``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable

from .protocol import SamplingFields, sampling_params
from ..core.trace import RequestRecord

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..model.load import LoadedModel


class EngineLoop:
    """Runs ``engine.step()`` in a background thread; submit / poll / cancel from any thread.

    When there is nothing to do the thread sleeps on an event that ``submit`` sets, so an
    idle engine uses no CPU and a new request starts at once.

    A step whose scheduler raised (``Engine.step``: its requests end with "error", the engine
    is left clean) does not stop the loop: it serves on. Anything else ends it, with ``error``
    set.

    Callbacks given to ``add_listener`` run in the loop's thread after every step that did
    work and once when the loop ends (stopped, or died with ``error`` set), so a waiting
    client (the server's streams) can wake on progress instead of polling on a timer.
    They must be quick and must not raise.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def start(self) -> "EngineLoop":
        if self._thread is not None:
            raise RuntimeError("this EngineLoop is already started")
        self._thread = threading.Thread(target=self._loop, name="batchlab-engine", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._stopping:
                try:
                    worked = self.engine.step()
                except Exception as e:
                    if getattr(self.engine, "contained", None) is not e:
                        raise  # not the scheduler's: the engine itself is broken
                    worked = True  # its requests ended with "error"; the engine is clean: serve on
                if worked:
                    self._notify()
                else:
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as e:  # keep it for the caller to see; the loop cannot go on
            self.error = e
            raise
        finally:
            self._notify()  # whoever waits learns that the loop has ended

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    def submit(self, prompt_ids, **kwargs) -> str:
        if self.error is not None:  # nothing would ever run it
            raise RuntimeError("the engine loop has stopped") from self.error
        rid = self.engine.submit(prompt_ids, **kwargs)
        self._wake.set()
        return rid

    def poll(self, req_id: str):
        return self.engine.poll(req_id)

    def cancel(self, req_id: str) -> bool:
        done = self.engine.cancel(req_id)
        self._wake.set()
        return done

    def stop_string_met(self, req_id: str) -> bool:
        """The request's text met a stop string: it finishes as "stop" (see ``EngineBase``)."""
        done = self.engine.stop_string_met(req_id)
        self._wake.set()
        return done

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.engine.sweep()  # cancels that came after the last step still free their memory

    def __enter__(self) -> "EngineLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# A waiting stream wakes when an engine step ends; it also looks at least this often, so
# no stream can hang on a lost wake-up.
HEARTBEAT_S = 1.0


class StreamEnded(Exception):
    """A stream that cannot go on: its request failed in the engine, the engine stopped,
    or the server is shutting down. ``status`` is the HTTP status a non-streamed answer gets."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class TooManyRunning(Exception):
    """A user already has as many unfinished requests as ``--max-running-per-user`` allows."""


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
        rid = self.loop.submit(prompt_ids, params=sampling_params(req), priority=req.priority)
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
