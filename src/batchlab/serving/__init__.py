"""The engine behind an HTTP server, and the clients that load it.

``loop`` (``EngineLoop``: the engine stepping in a thread), ``server`` (OpenAI-compatible,
FastAPI), ``dashboard`` (the live page), ``loadgen`` (a load generator for any
OpenAI-compatible server) and ``serverprocs`` (servers as subprocesses, side by side).
"""
