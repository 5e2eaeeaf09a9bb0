"""Show library code in a lesson: ``show_source(obj, start=..., end=...)``.

Lessons print the reference's code *after* the learner's attempt. Slicing a listing at a
piece of text is fragile (edit a comment and the lesson silently prints the wrong lines),
so a missing anchor here is an error that names it, and the suite catches it.
"""

from __future__ import annotations

import inspect
import textwrap


def source_lines(obj, start: str | None = None, end: str | None = None) -> str:
    """The source of ``obj``, dedented; from the first line containing ``start`` (if given)
    up to, not including, the first later line containing ``end`` (if given)."""
    lines = textwrap.dedent(inspect.getsource(obj)).splitlines()
    name = getattr(obj, "__qualname__", repr(obj))
    first = 0
    if start is not None:
        first = next((i for i, line in enumerate(lines) if start in line), None)
        if first is None:
            raise ValueError(f"the listing anchor {start!r} is not in the source of {name}")
    last = len(lines)
    if end is not None:
        last = next((i for i in range(first + 1, len(lines)) if end in lines[i]), None)
        if last is None:
            raise ValueError(f"the listing anchor {end!r} is not in the source of {name} after {start!r}")
    return textwrap.dedent("\n".join(lines[first:last]))


def show_source(obj, start: str | None = None, end: str | None = None) -> None:
    """Print what ``source_lines`` returns."""
    print(source_lines(obj, start, end))
