"""batchlab: learn how LLM servers schedule work by building one.

The package is grouped by job, from the bottom up:

* ``core``: the engine being taught, plain Python (requests, KV blocks, schedulers,
  the engine, traces and metrics, a fake model);
* ``model``: the MLX side (the model, its tokenizer, the runner that computes a pass);
* ``viz``: pictures drawn from traces;
* ``measurement``: workloads, the driver, the simulator, the bench;
* ``serving``: the HTTP server, its dashboard, the load generator;
* ``course``: your engine's pieces and their checkers;
* ``cli`` and ``demo``: the ``batchlab`` command.

Importing batchlab first makes MLX use an optimized BLAS on Linux (see ``_blas``). The
names below load on first use, so ``import batchlab.core.scheduler`` (or anything in
``core``) does not import MLX at all.
"""

import importlib

from . import _blas  # noqa: F401  (first: before anything imports mlx)

_EXPORTS = {
    "Engine": "core.engine",
    "make_engine": "core.engine",
    "SamplingParams": "core.request",
    "EngineLoop": "serving.server",
    "Generation": "model.baseline",
    "generate": "model.baseline",
    "LoadedModel": "model.load",
    "ModelInfo": "model.load",
    "load_model": "model.load",
    "IncrementalDetokenizer": "model.tokenizer",
    "Tokenizer": "model.tokenizer",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    """``batchlab.X``: a public name (loaded from its module) or a submodule."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # found directly next time
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
