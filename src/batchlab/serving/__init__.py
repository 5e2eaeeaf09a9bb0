"""The engine behind an HTTP server, and the clients that load it.

``loop`` (``EngineLoop``: the engine stepping in a thread), the OpenAI-compatible server
(``server``: each request's stream, what lesson 7 teaches; ``protocol``: the request
schema and its checks; ``app``: the FastAPI routes and the API key they need; ``launch``:
``serve``, ``serve_in_thread``, their ``ServerConfig`` and the refusal to listen beyond this
machine without a key), ``dashboard`` (the live page),
``loadgen`` (a load generator for any OpenAI-compatible server) and ``serverprocs``
(servers as subprocesses, side by side).
"""
