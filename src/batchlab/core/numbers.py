"""The argument checks the core shares. In Python ``True`` is an ``int`` (``True + 1 == 2``),
so "an integer" and "a number" here leave bools out: ``max_batch_size=True`` is a mistake to
name, not a batch of one."""

from __future__ import annotations


def is_int(value) -> bool:
    """A Python ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A Python ``int`` or ``float`` that is not a ``bool`` (it may be inf or NaN: check the range)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
