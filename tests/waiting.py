"""Waiting in tests: on a condition, with a deadline, never for a fixed time."""

from __future__ import annotations

import time


def happens_within(condition, seconds: float, poll_s: float = 0.005):
    """Poll ``condition()`` until it holds or ``seconds`` pass; return what it last gave.
    To show that something does *not* happen, this bounded wait is the most a test can do:
    it returns at once if it does."""
    deadline = time.monotonic() + seconds
    while not (held := condition()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return held


def wait_for(condition, seconds: float, what: str, poll_s: float = 0.005):
    """Await ``condition()`` with a deadline; fail naming ``what`` if it never holds.
    Returns what ``condition()`` gave. ``seconds`` only bounds a hang: a passing test
    never waits it out, so make it generous."""
    held = happens_within(condition, seconds, poll_s)
    assert held, f"{what} did not happen within {seconds:.0f} s"
    return held
