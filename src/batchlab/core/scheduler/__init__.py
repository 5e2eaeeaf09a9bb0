"""Schedulers: the policy half of the engine, in pure Python (no MLX, not even through
an import).

A scheduler owns the waiting queue, the decode slots and the KV blocks (it is the only
code that takes or frees them), and decides what the model runs. One flow serves every
kind:

- **Planning** is the kind's ``batches()``: a generator that yields one ``Batch`` (one
  forward pass) at a time. It is the only code a kind writes; it reads the requests'
  states and changes them (admits, places, preempts).
- **The result** of each pass goes to ``postprocess`` (shared by every kind): requests
  advance by what they computed, get their new tokens, finish, and a request whose
  prompt is done moves on -- to decoding if it holds a slot, else to await one.
- **Leaving** (finish, cancel, preemption) is ``remove`` / ``release``, also shared: a
  kind keeps no containers of its own to keep in sync. Who is prefilling, awaiting a
  slot or decoding is read from the requests themselves (``in_state``), in admission
  order (``running``).

The engine asks ``passes()`` for the passes of one iteration, has each ``prepare``d
(blocks taken, described as runner ``Chunk``s), runs it, and hands the new tokens to
``postprocess``; then the generator resumes and sees the result. The kinds:

- ``SequentialScheduler``: one request at a time, start to finish.
- ``StaticScheduler``: up to B requests start together; nobody joins until all finish.
- ``ContinuousScheduler``: iteration-level scheduling in five phases (see ``batches``).
- ``StallFreeScheduler``: a token budget per step, decodes first, one fused pass.

*Write your own*: subclass one of them, give it a ``kind`` name and a one-line
``description``, and pass the class to ``make_engine(MyScheduler, lm, ...)`` -- or
``--engine my_module:MyScheduler`` to any ``batchlab`` command. A scheduler's options are
the keyword arguments of its constructor after ``(blocks, clock)``, with their defaults;
``options`` gives each its type and help text (the command line's flags come from it).
The kinds batchlab ships are registered below, one line each (``register``), into ``KINDS``,
the registry every command, the bench and the README read.

The package, a file a job: ``base`` (the shared flow, no decision in it, the ``Batch`` a kind
plans, and ``StopRules``, the shipped kinds' finishing rules), ``sequential`` and ``static``
(a kind each), ``continuous`` (the iteration-level kinds: continuous and stall-free, which
builds on it, and ``OnDemandKV``: KV blocks taken as requests grow, preemption), and
``registry``.
"""

from .base import Batch, Option, Scheduler, StopRules
from .continuous import ContinuousScheduler, OnDemandKV, StallFreeScheduler
from .registry import KINDS, import_from_here, register, scheduler_class
from .sequential import SequentialScheduler
from .static import StaticScheduler

# The kinds batchlab ships, in the order the CLI, the bench and the README list them.
register(SequentialScheduler)
register(StaticScheduler)
register(ContinuousScheduler)
register(StallFreeScheduler)

__all__ = [
    "KINDS",
    "Batch",
    "ContinuousScheduler",
    "OnDemandKV",
    "Option",
    "Scheduler",
    "SequentialScheduler",
    "StallFreeScheduler",
    "StaticScheduler",
    "StopRules",
    "import_from_here",
    "register",
    "scheduler_class",
]
