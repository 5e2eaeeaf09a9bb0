"""Starting a server: `batchlab serve` in the foreground, or `serve_in_thread` for a
notebook or a test, both from one `ServerConfig`.

Both refuse an exposed host without a key, make the engine, start its loop, put the app
(``app.create_app``) on a uvicorn server whose shutdown first ends every open stream, and
always stop the loop again.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field, fields
from typing import Any

from .app import create_app
from .server import EngineLoop, Server, ServerBase
from ..core.policies import Admission, AdmissionBase
from ..model.load import LoadedModel

# After the streams have been told to end, how long shutdown waits for a connection
# (a client that reads slowly) before uvicorn cancels it.
GRACEFUL_SHUTDOWN_S = 5


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server is started with, in one place: :func:`serve` and
    :func:`serve_in_thread` take its fields as keywords (:func:`server_config`). The defaults are
    ``batchlab serve``'s; :func:`serve_in_thread` gives its own (a free port, a longer trace,
    quieter logs)."""

    lm: LoadedModel
    kind: Any  # an engine kind's name, or a scheduler class (a learner's)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    max_queue: int = 64  # the admission's queue
    trace_limit: int | None = 2000  # a long-running server keeps only its recent steps and requests
    model_id: str | None = None  # the name /v1/models gives (None: the model's own)
    api_key: str | None = None  # every /v1 route needs it (None: open)
    insecure: bool = False  # listen beyond this machine without a key
    max_running_per_user: int | None = None  # unfinished requests per user (None: no limit)
    show_prompts: bool = False  # the dashboard shows prompt text
    shedding: type[AdmissionBase] = Admission  # the admission class (a learner's)
    max_wait_s: float | None = None  # shed what waited longer
    server_class: type[ServerBase] = Server  # writes each request's stream (a learner's)
    engine_options: dict = field(default_factory=dict)  # to make_engine (engine_class: a learner's front)
    log_level: str = "info"  # uvicorn's


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


def _uvicorn(server: ServerBase, config: ServerConfig):
    """A uvicorn server that, on shutdown (SIGTERM, Ctrl+C, ``should_exit``), first ends
    every open stream; uvicorn alone would wait until each had generated its last token.
    ``run()`` binds ``config.host`` and ``config.port``, ``run(sockets=...)`` the sockets."""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        async def shutdown(self, sockets=None):
            server.close()
            await super().shutdown(sockets)

    app = create_app(server, config.api_key, config.show_prompts)
    return Uvicorn(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )


def _start(config: ServerConfig):
    """What ``batchlab serve`` and :func:`serve_in_thread` share: refuse an exposed host
    without a key, make the engine (its admission: ``config.shedding`` with ``max_queue``
    and ``max_wait_s``), start its loop, and put the app on a uvicorn server. Returns
    (uvicorn server, loop): the caller runs the one, blocking or in a thread, and stops
    the other. If this fails after the loop started, it stops the loop."""
    from ..core.engine import make_engine

    check_exposure(config.host, config.api_key, config.insecure)
    admission = config.shedding(max_queue=config.max_queue, max_wait_s=config.max_wait_s)
    engine = make_engine(
        config.kind, config.lm, trace_limit=config.trace_limit, admission=admission, **config.engine_options
    )
    loop = EngineLoop(engine).start()
    try:
        model_id = config.model_id or config.lm.info.name
        server = config.server_class(config.lm, loop, model_id, config.max_running_per_user)
        return _uvicorn(server, config), loop
    except BaseException:
        loop.stop()
        raise


def server_config(lm: LoadedModel, kind, options: dict, **defaults) -> ServerConfig:
    """A :class:`ServerConfig` from keyword ``options``: those named like one of its fields set
    that field (over ``defaults``), and every other keyword goes to ``make_engine``
    (``engine_options``: ``max_batch_size``, ``token_budget``, ``engine_class`` ...)."""
    own = {f.name for f in fields(ServerConfig)} - {"lm", "kind", "engine_options"}
    settings = {**defaults, **{k: v for k, v in options.items() if k in own}}
    engine = {k: v for k, v in options.items() if k not in own}
    return ServerConfig(lm, kind, engine_options=engine, **settings)


def serve(lm: LoadedModel, kind, **options) -> None:
    """Run the server until interrupted (``batchlab serve``). ``options``: any field of
    :class:`ServerConfig` (``shedding``: a learner's ``AdmissionBase`` class, which sheds what
    waited over ``max_wait_s``; ``server_class``: a learner's ``ServerBase`` subclass, which
    writes each request's stream); any other keyword goes to ``make_engine``."""
    uv, loop = _start(server_config(lm, kind, options))
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


def serve_in_thread(lm: LoadedModel, kind="stallfree", **options) -> ServerThread:
    """Start the server in a background thread of this process (a notebook or a test) and
    return once it accepts connections. ``options`` are as for :func:`serve`; the defaults
    differ in three: ``port=0`` takes a free port (the socket is bound here, before the thread
    starts, so no other process can take it in between), the trace keeps 5,000 steps, and
    uvicorn logs warnings only."""
    return _start_in_thread(server_config(lm, kind, options, port=0, trace_limit=5000, log_level="warning"))


def _start_in_thread(config: ServerConfig) -> ServerThread:
    """:func:`serve_in_thread` once its ``config`` is made: bind the socket, run uvicorn on
    it in a daemon thread, and wait (30 s at most) until it accepts connections. On any
    failure, stop the loop and close the socket."""
    import socket
    import threading

    uv, loop = _start(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, config.port))
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
