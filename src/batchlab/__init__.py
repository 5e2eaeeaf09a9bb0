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
``core``) does not import MLX at all. Module paths from before the grouping
(``batchlab.engine``, ``batchlab.scheduler``...) still import, as the same modules.
"""

import importlib
import importlib.abc
import importlib.util
import sys

from . import _blas  # noqa: F401  (first: before anything imports mlx)

_EXPORTS = {
    "Engine": "core.engine",
    "make_engine": "core.engine",
    "SamplingParams": "core.sampling",
    "EngineLoop": "serving.loop",
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

# Where each module lived before the package was grouped by job (a learner's saved pieces,
# older notes and notebooks import these paths).
MOVED = {
    **{m: f"core.{m}" for m in "request batch kv runner sampling trace metrics policies".split()},
    **{m: f"core.{m}" for m in "costmodel scheduler engine fake".split()},
    **{m: f"model.{m}" for m in "backend tokenizer attention model_runner cpu_llama".split()},
    **{m: f"model.{m}" for m in "baseline export prompts".split()},
    **{m: f"measurement.{m}" for m in "workloads driver simulator costfit microbench peers bench".split()},
    **{m: f"serving.{m}" for m in "server loop dashboard loadgen serverprocs".split()},
    **{m: f"course.{m}" for m in "exercises lessons listing checks".split()},
}


def moved_to(name: str) -> str | None:
    """The module's path now, for a path from before the grouping (else None):
    ``batchlab.scheduler.base`` -> ``batchlab.core.scheduler.base``."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != __name__ or parts[1] not in MOVED:
        return None
    return ".".join([__name__, MOVED[parts[1]], *parts[2:]])


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the very module at its new path (one module, two names)."""

    def find_spec(self, name, path=None, target=None):
        new = moved_to(name)
        return importlib.util.spec_from_loader(name, self) if new else None

    def create_module(self, spec):
        return importlib.import_module(moved_to(spec.name))

    def exec_module(self, module):
        pass  # already executed under its new name

    def get_code(self, name):  # ``python -m batchlab.lessons`` runs the moved module's code
        new = moved_to(name)
        return importlib.util.find_spec(new).loader.get_code(new)


if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())  # first: before the path finder loads a copy


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
