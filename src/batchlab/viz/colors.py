"""Colours and labels shared by every picture: one colour per request, distinct within a figure."""

from __future__ import annotations

import colorsys
import re
import zlib
from collections.abc import Callable

STATE_COLORS = {
    "queued": "#c9c9c9",
    "prefilling": "#f28e2b",
    "awaiting_slot": "#edc948",
    "decoding": "#4e79a7",
}
PADDING_COLOR, PADDING_EDGE = "#d0d0d0", "#8f8f8f"
_LIGHTNESS = (0.35, 0.5, 0.65)  # cycled, so requests whose hues end up close differ in lightness


def _bit_reversed_fraction(i: int) -> float:
    """0, 1/2, 1/4, 3/4, 1/8, ...: the first 2^k values are exactly evenly spaced."""
    fraction, weight = 0.0, 0.5
    while i:
        fraction += weight * (i & 1)
        i >>= 1
        weight /= 2
    return fraction


def palette_color(i: int) -> str:
    """The i-th colour of the palette: the first 2^k colours have evenly spaced hues, in
    three lightnesses, so 16 (or 32) requests in one figure never look alike."""
    hue = (0.6 + _bit_reversed_fraction(i)) % 1.0
    r, g, b = colorsys.hls_to_rgb(hue, _LIGHTNESS[i % len(_LIGHTNESS)], 0.75)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def _luminance(hex_color: str) -> float:
    """WCAG relative luminance."""
    channels = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_color(hex_color: str) -> str:
    """Black or white, whichever has the higher WCAG contrast on ``hex_color`` (for any
    colour one of them reaches 4.5:1, the WCAG bar for small text)."""
    lum = _luminance(hex_color)
    return "#000000" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "#ffffff"


def lighten(hex_color: str, amount: float = 0.6) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in (r, g, b))


def rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))


class Palette:
    """Hands out palette colours in the order requests are first seen and remembers them,
    so a live view keeps each request's colour while the trace grows or forgets requests,
    and traces drawn side by side with one palette colour the same request alike."""

    def __init__(self):
        self.colors: dict[str, str] = {}

    def color(self, request_id: str) -> str:
        if request_id not in self.colors:
            self.colors[request_id] = palette_color(len(self.colors))
        return self.colors[request_id]


def request_color(request_id: str) -> str:
    """A request's colour from its id alone (for pictures drawn outside a trace): an id
    ending in a number N ("req-7", "mix-007") takes the N-th palette colour, the colour it
    gets in a figure of a run whose requests arrived in the order of their numbers from 0."""
    number = re.search(r"\d+$", request_id)
    return palette_color(int(number.group()) if number else zlib.crc32(request_id.encode()))


def short_label(request_id: str) -> str:
    """A label that fits in a cell: the number that ends ids like "req-12", else 3 characters."""
    number = re.search(r"\d+$", request_id)
    return number.group() if number else request_id[:3]


def fitting_label(request_id: str, room: float, width_of: Callable[[str], float]) -> str | None:
    """The request's id if ``width_of`` it fits in ``room``, else its short label if that
    fits, else None (in whatever unit ``width_of`` measures: points, pixels)."""
    for label in (request_id, short_label(request_id)):
        if width_of(label) <= room:
            return label
    return None
