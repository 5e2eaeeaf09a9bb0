"""``EngineLoop``: an engine stepping in a background thread, used from any other thread.

The engine's ``submit`` / ``poll`` / ``cancel`` are thread-safe (see ``engine``); this
module adds the thread that calls ``step`` and sleeps when there is nothing to do.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..core.engine import Engine


class EngineLoop:
    """Runs ``engine.step()`` in a background thread; submit / poll / cancel from any thread.

    When there is nothing to do the thread sleeps on an event that ``submit`` sets, so an
    idle engine uses no CPU and a new request starts at once.

    A step whose scheduler raised (``Engine.step``: its requests end with "error", the engine
    is left clean) does not stop the loop: it serves on. Anything else ends it, with ``error``
    set.

    Callbacks given to ``add_listener`` run in the loop's thread after every step that did
    work and once when the loop ends (stopped, or died with ``error`` set), so a waiting
    client (the server's streams) can wake on progress instead of polling on a timer.
    They must be quick and must not raise.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def start(self) -> "EngineLoop":
        if self._thread is not None:
            raise RuntimeError("this EngineLoop is already started")
        self._thread = threading.Thread(target=self._loop, name="batchlab-engine", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._stopping:
                try:
                    worked = self.engine.step()
                except Exception as e:
                    if getattr(self.engine, "contained", None) is not e:
                        raise  # not the scheduler's: the engine itself is broken
                    worked = True  # its requests ended with "error"; the engine is clean: serve on
                if worked:
                    self._notify()
                else:
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as e:  # keep it for the caller to see; the loop cannot go on
            self.error = e
            raise
        finally:
            self._notify()  # whoever waits learns that the loop has ended

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    def submit(self, prompt_ids, **kwargs) -> str:
        if self.error is not None:  # nothing would ever run it
            raise RuntimeError("the engine loop has stopped") from self.error
        rid = self.engine.submit(prompt_ids, **kwargs)
        self._wake.set()
        return rid

    def poll(self, req_id: str):
        return self.engine.poll(req_id)

    def cancel(self, req_id: str) -> bool:
        done = self.engine.cancel(req_id)
        self._wake.set()
        return done

    def stop_string_met(self, req_id: str) -> bool:
        """The request's text met a stop string: it finishes as "stop" (see ``EngineBase``)."""
        done = self.engine.stop_string_met(req_id)
        self._wake.set()
        return done

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.engine.sweep()  # cancels that came after the last step still free their memory

    def __enter__(self) -> "EngineLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
