"""Structured output: answers that must match a pattern, as per-row token masks.

An application may ask for an answer that fits a regular expression, one of a few strings,
or a JSON schema. Each time such a request's row samples, its *mask* says which tokens of
the vocabulary keep the text so far matchable; every other token's logit becomes -inf before
sampling (greedy or not), so the answer cannot leave the pattern. The end-of-sequence token
is allowed only where the text is complete. Rows without a constraint in the same fused pass
are untouched. A constrained row carries no speculative drafts (its mask after a draft would
depend on that draft).

The grammar work, turning a pattern into an automaton over *tokens* (a token is a string of
several characters, not one character) and filling a mask for its state, is llguidance's (a
Rust library that vLLM and SGLang also use; ``docs/results/grammar_libraries.md`` has why it
was chosen). Lesson 12 builds the mask for a small automaton by hand first.

Names follow vLLM's ``StructuredOutputsParams``: ``json``, ``regex``, ``choice``, ``json_object``.
"""

from __future__ import annotations

import json as _json
import weakref
from dataclasses import dataclass

import numpy as np

# JSON answers are written compactly, one space after ',' and ':', no other whitespace: a
# flexible-whitespace grammar lets a small model emit newlines for ever and never close.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORMS = ("json", "regex", "choice", "json_object")


@dataclass(frozen=True, eq=False)
class StructuredOutputs:
    """What a request's answer must match: exactly one of ``json`` (a JSON schema, as a dict or
    its JSON text), ``regex`` (the whole answer matches it), ``choice`` (the answer is one of
    these strings) or ``json_object=True`` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [k for k in FORMS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured output takes exactly one of {', '.join(FORMS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
            object.__setattr__(self, "json", schema)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must be a list of non-empty strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("choice must list at least one string")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"json_object must be true or false, got {self.json_object!r}")

    @property
    def form(self) -> str:
        return next(k for k in FORMS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, fields: dict) -> "StructuredOutputs":
        """From vLLM's ``structured_outputs`` request field; unknown keys are an error."""
        if not isinstance(fields, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(fields).__name__}")
        unknown = sorted(set(fields) - set(FORMS))
        if unknown:
            raise ValueError(f"structured_outputs takes {', '.join(FORMS)}; unknown: {', '.join(unknown)}")
        return cls(**fields)

    def grammar(self) -> str:
        """llguidance's grammar for it."""
        import llguidance

        if self.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(self.json, defaults=JSON_LAYOUT)
        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        # a Lark rule with one literal per choice (JSON string syntax escapes quotes and the rest)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(_json.dumps(c) for c in self.choice)
        )


class CompileError(ValueError):
    """The grammar library cannot compile this pattern or schema."""


class Constraint:
    """One request's constraint while it generates: the mask for its next token, and the
    automaton state that every token it takes advances."""

    def allowed(self) -> np.ndarray:
        """bool [vocab]: True for every token that keeps the answer matchable (EOS only where
        the answer is complete)."""
        raise NotImplementedError

    def advance(self, token: int) -> None:
        """Take ``token`` (one the mask allowed) into the state."""
        raise NotImplementedError


class GrammarConstraint(Constraint):
    """A ``StructuredOutputs`` compiled by llguidance for one tokenizer."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> np.ndarray:
        if self.matcher.is_error():
            raise RuntimeError(f"the constraint's matcher failed: {self.matcher.get_error()}")
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(
                f"token {token} breaks the constraint: {self.matcher.get_error().splitlines()[0]}"
            )


# llguidance's view of a tokenizer (every token's bytes, arranged for fast masks) takes about
# 0.2 s to build: one per tokenizer, kept as long as the tokenizer lives.
_ll_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer):
    """llguidance's tokenizer for ours (a ``model.tokenizer.Tokenizer``: it needs the token
    strings, which its ``backend`` holds)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise ValueError(
            "structured output needs the tokenizer's token strings; this model's tokenizer has none"
        )
    if tokenizer not in _ll_tokenizers:
        import llguidance

        _ll_tokenizers[tokenizer] = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=sorted(tokenizer.eos_token_ids)
        )
    return _ll_tokenizers[tokenizer]


def compile_constraint(spec: StructuredOutputs, tokenizer) -> GrammarConstraint:
    """A fresh constraint for one request; ``CompileError`` naming the problem when llguidance
    cannot compile the pattern or schema."""
    import llguidance

    ll = ll_tokenizer(tokenizer)
    grammar = spec.grammar()
    error = llguidance.LLMatcher.validate_grammar(grammar, ll)
    if error:
        raise CompileError(f"the {spec.form} cannot be compiled: {error.strip().splitlines()[0]}")
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        raise CompileError(
            f"the {spec.form} cannot be compiled: {matcher.get_error().strip().splitlines()[0]}"
        )
    return GrammarConstraint(matcher, tokenizer.vocab_size)


def violation(spec: dict, text: str) -> str | None:
    """Why ``text`` does not match ``spec`` (vLLM's ``structured_outputs`` form), or None if it
    does, judged by references outside the grammar library: ``re.fullmatch`` for ``regex``,
    membership for ``choice``, ``json.loads`` for ``json_object``, and ``jsonschema`` for
    ``json``. The bench and lesson 12's checker judge answers with it."""
    import re

    if "regex" in spec:
        return None if re.fullmatch(spec["regex"], text) else f"{text!r} does not match {spec['regex']!r}"
    if "choice" in spec:
        return None if text in spec["choice"] else f"{text!r} is none of {spec['choice']}"
    try:
        value = _json.loads(text)
    except ValueError as e:
        return f"{text!r} is not JSON ({e})"
    if spec.get("json_object"):
        return None if isinstance(value, dict) else f"{text!r} is JSON but not an object"
    import jsonschema

    schema = spec["json"]
    try:
        jsonschema.validate(value, _json.loads(schema) if isinstance(schema, str) else schema)
    except jsonschema.ValidationError as e:
        return f"{text!r} is JSON that does not fit the schema ({str(e).splitlines()[0]})"
    return None
