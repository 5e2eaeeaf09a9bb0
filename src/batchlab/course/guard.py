"""What keeps a learner's code from hanging or breaking a lesson: a time limit on every call
the checkers make into it, and a watch on the library it must not change.

* ``run_guarded(call)`` runs ``call`` for at most ``CASE_LIMIT_S`` seconds. In the main thread
  (a notebook's kernel) it runs in place, so MLX's arrays stay with the thread that made them, and
  a watchdog thread stops it at the limit: an exception raised in the thread
  (``PyThreadState_SetAsyncExc``) ends a pure-Python endless loop, and SIGUSR1 wakes a wait on a
  lock, an event, a queue or a sleep, whose handler raises the same exception. In any other thread
  (no signals there) the call runs in a daemon worker thread, interrupted the same way; one blocked
  inside C cannot take the exception until it wakes, so after ``STOP_GRACE_S`` it is left behind
  and said so. Either way the answer names the learner's function that was running, from the
  thread's stack.
* ``snapshot()`` / ``restore(snapshot)``: the class dicts and UPPERCASE constants of the
  engine's modules (``batchlab.core``: ``Scheduler``, ``Engine``, ``KINDS``, ...). ``restore``
  puts back whatever a learner's code changed and says what it was.

Only the standard library here: ``my_engine`` imports it without the checkers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

CASE_LIMIT_S: float | None = 10.0  # the most one checker case may run; None: no limit, no thread
STOP_GRACE_S = 2.0  # how long an interrupted case gets to end before it is left behind
WATCHED = "batchlab.core"  # the modules whose classes and constants a learner's code must not change

_NOT_THE_LEARNERS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # batchlab
    sysconfig.get_paths()["stdlib"],
)


def ours(filename: str) -> bool:
    """True for batchlab's files, the standard library's and installed packages': not the learner's."""
    if filename.startswith(("<frozen ", *_NOT_THE_LEARNERS)):  # <frozen importlib._bootstrap>: importing
        return True
    return "site-packages" in filename or "dist-packages" in filename


class OutOfTime(BaseException):
    """Raised inside a call's thread when its time is up (not an ``Exception``: ``except Exception``
    in the learner's code or the engine does not swallow it)."""


@dataclass
class Outcome:
    """How a guarded call ended: its value, or the exception it raised, or ``late``: why it did not end."""

    value: Any = None
    error: BaseException | None = None
    late: str | None = None


def run_guarded(call: Callable[[], Any], limit_s: float | None = None) -> Outcome:
    """``call()`` within ``limit_s`` seconds (default ``CASE_LIMIT_S``; None: in this thread, unlimited).
    Never raises what ``call`` raises; a KeyboardInterrupt while waiting stops the call, then goes on."""
    limit_s = CASE_LIMIT_S if limit_s is None else limit_s
    outcome = Outcome()
    if limit_s is None:
        try:
            outcome.value = call()
        except Exception as e:  # noqa: BLE001 -- the caller reports it
            outcome.error = e
        return outcome
    if threading.current_thread() is threading.main_thread() and _signal_ready():
        return _run_here(call, limit_s)  # a notebook: in the kernel's own thread, MLX's arrays with it
    before = {t.ident for t in threading.enumerate()}

    def work():
        try:
            outcome.value = call()
        except OutOfTime:
            pass
        except BaseException as e:  # noqa: BLE001 -- SystemExit too: reported, never raised
            outcome.error = e

    worker = threading.Thread(target=work, name="batchlab-guarded", daemon=True)
    worker.start()
    try:
        worker.join(limit_s)
    except BaseException:  # the learner interrupted the cell: stop the call too, not just the wait
        _stop(worker, before)
        raise
    if not worker.is_alive():
        return outcome
    frames = sys._current_frames().get(worker.ident)
    waiting = frames is not None and frames.f_code.co_filename.startswith(_NOT_THE_LEARNERS[1])
    running = _running(worker.ident, before)
    stopped = _stop(worker, before)
    outcome.late = _late(limit_s, running, stopped, waiting or not stopped)
    return outcome


_armed = threading.Event()  # set while a call in the main thread is past its time


def _out_of_time(signum, frame):
    if _armed.is_set():
        raise OutOfTime


def _signal_ready() -> bool:
    """Whether ``_out_of_time`` handles SIGUSR1 (installed here once, if nobody else handles it)."""
    if not hasattr(signal, "pthread_kill"):
        return False
    current = signal.getsignal(signal.SIGUSR1)
    if current in (signal.SIG_DFL, signal.SIG_IGN, None):
        signal.signal(signal.SIGUSR1, _out_of_time)
        current = _out_of_time
    return current is _out_of_time


def _run_here(call: Callable[[], Any], limit_s: float) -> Outcome:
    """``call()`` in this (the main) thread, a watchdog thread stopping it after ``limit_s``: an
    exception raised in it (ends a loop) and SIGUSR1 (wakes a wait on a lock, event, queue or sleep,
    whose handler raises the same exception)."""
    outcome, done, me = Outcome(), threading.Event(), threading.get_ident()
    before = {t.ident for t in threading.enumerate()}

    def watch():
        if done.wait(limit_s):
            return
        frames = sys._current_frames().get(me)
        waiting = frames is not None and frames.f_code.co_filename.startswith(_NOT_THE_LEARNERS[1])
        outcome.late = _late(limit_s, _running(me, before), True, waiting)
        _armed.set()
        deadline = time.monotonic() + STOP_GRACE_S
        while not done.is_set() and time.monotonic() < deadline:
            _interrupt(me, before)
            signal.pthread_kill(me, signal.SIGUSR1)
            done.wait(0.05)

    watchdog = threading.Thread(target=watch, name="batchlab-watchdog", daemon=True)
    watchdog.start()
    try:
        outcome.value = call()
    except OutOfTime:
        pass
    except KeyboardInterrupt:
        raise  # the learner stopped the cell
    except BaseException as e:  # noqa: BLE001 -- SystemExit too: reported, never raised
        outcome.error = e
    finally:
        # the watchdog's last signal or exception may land here, after the call returned: it must
        # not escape (a learner would see a traceback, not a verdict), so the clean-up runs again
        while True:
            try:
                done.set()
                watchdog.join()
                # the watchdog fired: later signals raise nothing, a pending exception goes
                if _armed.is_set():
                    _armed.clear()
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(me), None)
                break
            except OutOfTime:
                continue
    return outcome


def _late(limit_s: float, running: str | None, stopped: bool, waiting: bool) -> str:
    late = f"did not finish within {limit_s:g} s" + (f": still running {running}" if running else "")
    if not waiting:
        return late + " — an endless loop?"
    late += " — waiting for something that never comes (a lock, an event, a queue, a sleep)?"
    return late + ("" if stopped else " It could not be stopped and is left waiting in the background.")


def _interrupt(me: int, before: set) -> None:
    """Raise ``OutOfTime`` in thread ``me`` and in the threads started since ``before`` that run the
    learner's code now."""
    started = [t.ident for t in threading.enumerate() if t.ident not in before and t.ident != me]
    for ident in [me, *(i for i in started if _learner_frame(i) is not None)]:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(OutOfTime))


def _learner_frame(ident: int | None):
    """The innermost frame of the learner's code on thread ``ident``'s stack now, or None."""
    frame = sys._current_frames().get(ident)
    while frame is not None and ours(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _running(ident: int | None, before: set) -> str | None:
    """``MyClass.method (my_engine/file.py, line N)``: the learner's code thread ``ident`` runs now
    (or, if none, a thread started since ``before`` does)."""
    others = [t.ident for t in threading.enumerate() if t.ident not in before and t.ident != ident]
    for candidate in [ident, *others]:
        frame = _learner_frame(candidate)
        if frame is not None:
            return describe(frame.f_code, frame.f_lineno, frame)
    return None


def where_raised(e: BaseException) -> str:
    """`` (my_engine/file.py, line N)``: the learner's line that raised ``e`` (a SyntaxError's own), or ""."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        return f" ({show_file(e.filename)}, line {e.lineno})"
    tb, found = e.__traceback__, None
    while tb is not None:
        if not ours(tb.tb_frame.f_code.co_filename):
            found = tb
        tb = tb.tb_next
    return f" ({show_file(found.tb_frame.f_code.co_filename)}, line {found.tb_lineno})" if found else ""


def describe(code, line: int, frame=None) -> str:
    """A function of the learner's and where it is: ``MyClass.method (my_engine/file.py, line N)``.
    (Python 3.10 has no ``co_qualname``: there the class comes from the frame's ``self``.)"""
    name = getattr(code, "co_qualname", None) or _qualname(code, frame)
    name = name.rpartition("<locals>.")[2]
    name = "the file's top level" if name == "<module>" else name
    return f"{name} ({show_file(code.co_filename)}, line {line})"


def _qualname(code, frame) -> str:
    """``Class.method`` for a method's ``code`` run by ``frame`` (the class in ``self``'s ancestry
    that defines it), else the bare name."""
    owner = frame.f_locals.get("self", frame.f_locals.get("cls")) if frame is not None else None
    if owner is not None:
        for cls in (owner if isinstance(owner, type) else type(owner)).__mro__:
            if getattr(cls.__dict__.get(code.co_name), "__code__", None) is code:
                return f"{cls.__name__}.{code.co_name}"
    return code.co_name


def kind_of(value) -> str:
    """``a dict``, ``an int``: the type of ``value`` with its article."""
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def show_file(filename: str) -> str:
    """``my_engine/continuous.py`` for a piece, "a notebook cell" for a cell, else the file's name."""
    parts = Path(filename).parts
    if "my_engine" in parts:
        at = len(parts) - 1 - parts[::-1].index("my_engine")
        return "/".join(parts[at:])
    return "a notebook cell" if "ipykernel_" in filename else Path(filename).name


def _stop(worker: threading.Thread, before: set) -> bool:
    """Raise ``OutOfTime`` in the worker (and in threads it started that run the learner's code),
    again and again for ``STOP_GRACE_S``; True if the worker ended."""
    deadline = time.monotonic() + STOP_GRACE_S
    while worker.is_alive() and time.monotonic() < deadline:
        if worker.ident is not None:
            _interrupt(worker.ident, before)
        worker.join(0.05)
    return not worker.is_alive()


# -- the library a learner's code must not change ------------------------------------------


def snapshot() -> dict:
    """The watched modules' classes (their dicts) and UPPERCASE constants (with a copy of a
    dict's, list's or set's contents), to compare with later."""
    shot = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == WATCHED or name.startswith(WATCHED + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == name:
                shot[value] = dict(vars(value))
            elif attr.isupper():
                shot[(module, attr)] = (value, _contents(value))
    return shot


def _contents(value):
    if isinstance(value, dict):
        return list(value.items())
    return list(value) if isinstance(value, (list, set)) else None


def restore(shot: dict) -> list[str]:
    """Put back what changed since ``shot``; say what it was, one phrase each."""
    changed = []
    for key, old in shot.items():
        if isinstance(key, type):
            changed += _restore_class(key, old)
            continue
        module, attr = key
        value, contents = old
        if vars(module).get(attr, _GONE) is not value:
            setattr(module, attr, value)
            changed.append(f"{attr} (in {module.__name__}) was replaced")
        if contents is not None and _contents(value) != contents:
            value.clear()
            value.update(contents) if isinstance(value, (dict, set)) else value.extend(contents)
            changed.append(f"{attr} (in {module.__name__}) was changed")
    return changed


_GONE = object()
_CACHES = {"__slotnames__", "_abc_impl"}  # what Python itself adds to a class (copy, abc)


def _restore_class(cls: type, old: dict) -> list[str]:
    changed, now = [], dict(vars(cls))
    for attr in now.keys() - old.keys() - _CACHES:
        delattr(cls, attr)
        changed.append(f"{cls.__name__}.{attr} was added")
    for attr, value in old.items():
        if now.get(attr, _GONE) is not value:
            setattr(cls, attr, value)
            changed.append(f"{cls.__name__}.{attr} was {'replaced' if attr in now else 'deleted'}")
    return changed


def library_changed(changed: list[str]) -> str:
    """The sentence for a learner's code that changed the library (``restore``'s list)."""
    what = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
    return (
        f"your code changed batchlab itself: {what}. It is put back now; change your own class "
        f"(a method of your subclass, or self.something), never the library's."
    )
