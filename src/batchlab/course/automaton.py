"""Lesson 12's tools: a regular expression as an automaton over characters, and every token's text.

A pattern the answer must match becomes a *deterministic automaton*: states, a start state,
and for each state and character at most one next state (none: the text can no longer match).
A state is *accepting* when the text read so far is a whole match, and *live* when some
continuation can still reach an accepting state. ``interegular`` (a small, pure-Python regex
library) builds the automaton; the lesson's work starts after that: which *tokens* keep a
state live, where a token is a string of several characters.
"""

from __future__ import annotations

import re
import weakref

import interegular


class Automaton:
    """A regular expression (Python's syntax, the common subset) as a deterministic automaton
    over characters. ``step(state, ch)`` is the next state, or None where the text cannot
    match any more."""

    def __init__(self, pattern: str):
        try:
            fsm = interegular.parse_pattern(pattern).to_fsm()
        except Exception as e:  # interegular's own parse errors, for a pattern it cannot read
            raise ValueError(f"cannot build an automaton for {pattern!r}: {e}") from None
        self.pattern = pattern
        self._symbol, self._map = fsm.alphabet, fsm.map
        self.start = fsm.initial
        self.states = sorted(fsm.states)
        self._accepting = frozenset(fsm.finals)
        # live: an accepting state is reachable (walk the transitions backwards from them)
        back: dict[int, set[int]] = {s: set() for s in self.states}
        for s, moves in fsm.map.items():
            for t in moves.values():
                back[t].add(s)
        live, todo = set(self._accepting), list(self._accepting)
        while todo:
            for s in back[todo.pop()] - live:
                live.add(s)
                todo.append(s)
        self._live = frozenset(live)
        self._steps: dict[tuple[int, str], int | None] = {}  # (state, ch) -> step's answer, once worked out

    @classmethod
    def from_choices(cls, choices) -> "Automaton":
        """The automaton of "exactly one of these strings"."""
        return cls("|".join(re.escape(c) for c in choices))

    def step(self, state: int, ch: str) -> int | None:
        """The state after reading ``ch`` in ``state``; None if no text can match any more."""
        try:  # a mask reads every token's characters: the same few pairs, millions of times
            return self._steps[state, ch]
        except KeyError:
            nxt = self._map.get(state, {}).get(self._symbol[ch])
            nxt = self._steps[state, ch] = nxt if nxt in self._live else None
            return nxt

    def accepting(self, state: int) -> bool:
        """The text read so far is a whole match."""
        return state in self._accepting

    def live(self, state: int) -> bool:
        """Some continuation from ``state`` still matches."""
        return state in self._live

    def read(self, text: str, state: int | None = None) -> int | None:
        """The state after reading ``text`` (from ``state``, default the start), or None."""
        state = self.start if state is None else state
        for ch in text:
            state = self.step(state, ch)
            if state is None:
                return None
        return state

    def table(self, chars: str) -> str:
        """The transitions of every live state on each character of ``chars``, as a text table
        (``*`` marks accepting states, ``-`` no next state)."""
        head = "state " + " ".join(f"{c!r:>5}" for c in chars)
        rows = [head]
        for s in sorted(self._live):
            cells = [self.step(s, c) for c in chars]
            mark = "*" if self.accepting(s) else " "
            rows.append(f"{s:>4}{mark} " + " ".join(f"{'-' if t is None else t:>5}" for t in cells))
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"Automaton({self.pattern!r}: {len(self._live)} live states)"


_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_texts(tokenizer) -> list[str]:
    """Each token id's text, as the tokenizer decodes it alone. Special tokens (EOS among
    them) and the tokens that hold only part of a character's bytes (they decode to "\\ufffd")
    get "": no pattern can use them. Kept per tokenizer (decoding 49,152 tokens takes a moment)."""
    if tokenizer not in _texts:
        special = set(getattr(tokenizer, "special_tokens", {}).values()) | set(tokenizer.eos_token_ids)
        texts = []
        for i in range(tokenizer.vocab_size):
            text = "" if i in special else tokenizer.decode([i])
            texts.append("" if "\ufffd" in text else text)
        _texts[tokenizer] = texts
    return _texts[tokenizer]
