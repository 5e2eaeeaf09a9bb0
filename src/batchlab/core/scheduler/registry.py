"""The registry of scheduler kinds: ``KINDS`` (the kinds batchlab ships, by name, filled by
``register`` in ``batchlab.core.scheduler``), and ``scheduler_class``, which turns what a user names
-- a kind, a class, or ``module:Class`` imported from the current folder -- into a class."""

from __future__ import annotations

import importlib
import os
import sys

from .base import Scheduler

KINDS: dict[str, type[Scheduler]] = {}  # kind name -> class: the kinds batchlab ships


def register(cls: type[Scheduler]) -> type[Scheduler]:
    """Add a shipped kind to ``KINDS`` under its ``kind`` name (each name once)."""
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)) or "kind" not in cls.__dict__:
        raise ValueError(f"{cls!r}: register a Scheduler subclass that names its own kind")
    if KINDS.get(cls.kind, cls) is not cls:
        raise ValueError(f"kind {cls.kind!r} is already {KINDS[cls.kind].__qualname__}")
    KINDS[cls.kind] = cls
    return cls


def scheduler_class(kind: str | type[Scheduler]) -> type[Scheduler]:
    """The scheduler class for ``kind``: a kind name (``KINDS``), a ``Scheduler``
    subclass, or ``"module:Class"`` (the uvicorn convention), imported with the current
    folder on the path -- so ``my_engine.memory:MyMemoryScheduler`` finds the learner's
    package. Anything else is a ValueError that says what was wrong."""
    if isinstance(kind, type):
        if issubclass(kind, Scheduler):
            return kind
        raise ValueError(
            f"{kind.__module__}.{kind.__qualname__} is not a Scheduler subclass "
            f"(subclass batchlab.core.scheduler.Scheduler or one of its kinds)"
        )
    if isinstance(kind, str) and ":" in kind:
        return _import_scheduler(kind)
    if kind not in KINDS:
        raise ValueError(
            f"unknown engine kind {kind!r}; choose one of {', '.join(KINDS)}, "
            f"or name your own as module:Class (e.g. my_engine.memory:MyMemoryScheduler)"
        )
    return KINDS[kind]


def import_from_here(spec: str, flag: str = "--engine"):
    """``module:Name`` imported with the current folder on the path (the uvicorn
    convention); a ValueError that says what was wrong otherwise."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name or ":" in name:
        raise ValueError(f"{flag} {spec!r}: write module:Class, e.g. my_engine.memory:MyMemoryScheduler")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ValueError(
                f"{flag} {spec}: there is no module {e.name!r} here ({here}); run "
                f"the command from the folder that holds it"
            ) from None
        raise ValueError(f"{flag} {spec}: importing {module_name} failed: {e}") from None
    except Exception as e:  # a learner's module that does not import: say where
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        raise ValueError(
            f"{flag} {spec}: importing {module_name} raised {type(e).__name__}: {e}{where}"
        ) from None
    if not hasattr(module, name):
        raise ValueError(f"{flag} {spec}: {module_name} defines no {name!r}")
    return getattr(module, name)


def _import_scheduler(spec: str) -> type[Scheduler]:
    found = import_from_here(spec)
    name = spec.partition(":")[2]
    if not (isinstance(found, type) and issubclass(found, Scheduler)):
        what = "a class" if isinstance(found, type) else f"a {type(found).__name__}"
        raise ValueError(
            f"--engine {spec}: {name} is {what}, not a Scheduler subclass "
            f"(subclass one of batchlab.core.scheduler's kinds)"
        )
    return found
