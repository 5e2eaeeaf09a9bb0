"""The engine behind an HTTP server, and the clients that load it.

``loop`` (``EngineLoop``: the engine stepping in a thread), the OpenAI-compatible server
(``server``: each request's stream, what lesson 7 teaches; ``protocol``: the request
schema and its checks; ``auth``: the API key; ``app``: the FastAPI routes; ``launch``:
``serve``, ``serve_in_thread`` and their ``ServerConfig``), ``dashboard`` (the live page),
``loadgen`` (a load generator for any OpenAI-compatible server) and ``serverprocs``
(servers as subprocesses, side by side).
"""
