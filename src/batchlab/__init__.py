"""batchlab: learn how LLM servers schedule work by building one.

Importing batchlab first makes MLX use an optimized BLAS on Linux (see ``_blas``). The
names below load on first use, so ``import batchlab.scheduler`` (or any pure-Python part:
request, kv, policies, fake) does not import MLX at all.
"""

import importlib

from . import _blas  # noqa: F401  (first: before anything imports mlx)

_EXPORTS = {
    "Engine": "engine",
    "EngineLoop": "loop",
    "make_engine": "engine",
    "Generation": "baseline",
    "generate": "baseline",
    "LoadedModel": "model",
    "ModelInfo": "model",
    "load_model": "model",
    "SamplingParams": "sampling",
    "IncrementalDetokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
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
