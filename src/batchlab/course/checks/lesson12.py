"""Checkers for lesson 12 (structured output): ``token_mask`` against the ``regex`` module's partial
matches (a reference that shares no code with ``interegular``'s automaton), the learner's
constraint on the course model's real token texts (the mask, EOS, one computation per state),
and whole runs of the learner's engine on an adversarial fake model (``core.fake.
AdversarialRunner``: its favourite token is almost never one a pattern allows, EOS is its
favourite of all), whose every answer must still match by Python's ``re``, ``json`` and
``jsonschema``."""

from __future__ import annotations

import functools

import numpy as np
import regex

from ...core.engine import Engine, EngineBase, make_engine
from ...core.fake import AdversarialRunner, FakeModel, greedy_output
from ...core.structured import GrammarConstraint, StructuredOutputs, violation
from ..automaton import Automaton, token_texts
from ._core import Case, Verdict, run_cases, show
from ._lineage import ancestry_problem
from ._pieces import piece_case

__all__ = ["structured_engine", "mask_share"]

PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]


@functools.cache
def _tokenizer():
    from ...model.load import load_tokenizer

    return load_tokenizer()


def _reference(pattern: str, prefix: str, texts: list[str]) -> np.ndarray:
    """True where ``prefix + text`` can still become a whole match (``regex``'s partial match)."""
    return np.array(
        [bool(t) and regex.fullmatch(pattern, prefix + t, partial=True) is not None for t in texts]
    )


# ---------------------------------------------------------------------------------------
# token_mask: which token texts keep a state live.

TOKEN_MASK = (
    "a token is allowed when every one of its characters, read in turn from the state, keeps a next state"
)


def _mask_problem(got, pattern: str, prefix: str, texts: list[str]) -> str | None:
    want = _reference(pattern, prefix, texts)
    try:
        arr = np.asarray(got)
    except Exception:
        arr = None
    if arr is None or arr.shape != (len(texts),) or arr.dtype != bool:
        return f"token_mask returns a numpy bool array of {len(texts)} entries, one per text; got {show(got)}"
    wrong = [i for i in range(len(texts)) if arr[i] != want[i]]
    if not wrong:
        return None
    i = wrong[0]
    text, where = texts[i], f"after {prefix!r}" if prefix else "at the start"
    if want[i]:
        return f"{text!r} {where} can still match {pattern!r} ({prefix + text!r} begins a match), but yours rules it out"
    if not text:
        return "an empty text reads no character and moves nothing: never allow it"
    first_ok = regex.fullmatch(pattern, prefix + text[0], partial=True) is not None
    why = (
        "its first character fits, a later one does not: read EVERY character of the token"
        if first_ok
        else "its first character already cannot follow"
    )
    return f"{text!r} {where} cannot match {pattern!r} ({prefix + text!r} begins no match), but yours allows it: {why}"


def _mask_case(label: str, pattern: str, prefix: str, texts: list[str]) -> Case:
    def call(pieces):
        automaton = Automaton(pattern)
        return pieces()[0](automaton, automaton.read(prefix), list(texts))

    return Case(
        f"token_mask: {label}",
        call,
        _reference(pattern, prefix, texts),
        lambda got, _: _mask_problem(got, pattern, prefix, texts),
        TOKEN_MASK,
    )


def _mask_cases() -> list[Case]:
    choice = "|".join(CHOICES)
    return [
        _mask_case(
            f"{PHONE} at the start",
            PHONE,
            "",
            ["1", "12", "123", "1234", "123-", "12-", "-", "a", "", " 1", "123-4567", "123-45678"],
        ),
        _mask_case(f"{PHONE} after '123'", PHONE, "123", ["-", "-4", "4", "-4567", "-45678", "--", " -"]),
        _mask_case(
            f"{choice} at the start",
            choice,
            "",
            ["y", "ye", "yes", "yess", "m", "maybe", "maybe ", "n", "Yes"],
        ),
        _mask_case(f"{choice} after 'yes', a whole match", choice, "yes", ["s", " ", "no", "!", ""]),
        _mask_case("(ab)+ after 'ab', inside its loop", "(ab)+", "ab", ["a", "ab", "abab", "aba", "b", "ba"]),
    ]


# ---------------------------------------------------------------------------------------
# The learner's constraint on the course model's token texts, made by the learner's engine.


def _engine(cls, **options):
    return make_engine(
        "stallfree", FakeModel(text=_tokenizer()), runner=AdversarialRunner, engine_class=cls, **options
    )


def _constraint(cls, spec: dict):
    return _engine(cls).compile(StructuredOutputs(**spec))


@functools.cache
def _marker() -> str:
    """A character that is the first character of exactly one token text and appears in no other
    place of any text: every mask computation reads it exactly once (as that text's first
    character), however it walks the rest, so counting ``step`` calls on it counts masks."""
    texts = token_texts(_tokenizer())
    seen: dict[str, int] = {}
    for t in texts:
        for ch in t:
            seen[ch] = seen.get(ch, 0) + 1
    return next(t[0] for t in reversed(texts) if t and seen[t[0]] == 1 and not t[0].isascii())


class _Sweeps:
    """Counts the masks computed while on (``with``): ``Automaton.step`` calls on ``_marker()``."""

    def __enter__(self):
        self.count, marker = 0, _marker()
        original = self.original = Automaton.step

        def step(automaton, state, ch):
            if ch == marker:
                self.count += 1
            return original(automaton, state, ch)

        Automaton.step = step
        return self

    def __exit__(self, *exc):
        Automaton.step = self.original


def _constraint_problem(cls) -> str | None:
    tok, texts = _tokenizer(), token_texts(_tokenizer())
    eos = sorted(tok.eos_token_ids)
    mine = _constraint(cls, dict(regex=PHONE))
    if isinstance(mine, GrammarConstraint):
        return (
            "compile returned the library's grammar (llguidance) for a regex: build your own MyConstraint "
            "from an Automaton, and keep compile_constraint for JSON schemas"
        )
    mask = np.asarray(mine.allowed())
    if mask.shape != (tok.vocab_size,) or mask.dtype != bool:
        return f"allowed() returns a numpy bool array of {tok.vocab_size} entries (the vocabulary); got {show(mask)}"
    want = _reference(PHONE, "", texts)
    if mask[eos].any():
        return "allowed() lets EOS end an empty answer, which is no whole match of the pattern: EOS only where it is"
    wrong = np.flatnonzero(np.delete(mask != want, eos))
    if wrong.size:
        i = int(np.delete(np.arange(tok.vocab_size), eos)[wrong[0]])
        return (
            f"allowed() at the start of {PHONE} gives token {i} ({texts[i]!r}) {bool(mask[i])}; it can"
            + ("" if want[i] else "not")
            + " begin a match"
        )
    for token in tok.encode("555-1234"):
        mine.advance(token)
    end = np.asarray(mine.allowed())
    if not end[eos].all() or end.sum() != len(eos):
        return (
            "after '555-1234', a whole match that nothing may follow, allowed() should allow the EOS ids "
            f"{eos} and nothing else; it allows {int(end.sum())} token(s)"
            + ("" if end[eos].all() else ", EOS not among them")
        )
    engine = _engine(cls)
    loop = engine.compile(StructuredOutputs(regex="[0-9]+"))
    loop.allowed()
    with _Sweeps() as sweeps:
        for token in tok.encode("1234567"):
            loop.advance(token)
            loop.allowed()
    if sweeps.count > 2:  # the digits reach at most two states (one after the first digit)
        return (
            f"seven digits of [0-9]+ take the automaton to at most two states, yet your constraint computed "
            f"{sweeps.count} masks for them: compute each state's mask once and keep it (a dict state -> mask)"
        )
    with _Sweeps() as sweeps:
        engine.compile(StructuredOutputs(regex="[0-9]+")).allowed()
    if sweeps.count:
        return (
            "a second request with the same pattern computed its start state's mask again: keep the masks "
            "per pattern, shared by all its requests (compile gives each constraint the same dict)"
        )
    return None


# ---------------------------------------------------------------------------------------
# Whole runs of the learner's engine.

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SPECS = [dict(regex=PHONE), dict(choice=CHOICES), dict(json=PERSON), dict(regex="(cat|dog)s? (sat|ran)\\.")]


def _answer(tokens: list[int]) -> str:
    tok = _tokenizer()
    return tok.decode([t for t in tokens if t not in tok.eos_token_ids])


def _run(cls, requests, **options):
    engine = _engine(cls, max_batch_size=8, **options)
    ids = [engine.submit(p, **params) for p, params in requests]
    engine.run_until_idle()
    return [(engine.trace.requests[i].output_ids, engine.trace.requests[i].finish_reason) for i in ids]


def _prompts(n: int) -> list[list[int]]:
    return [_tokenizer().encode(f"Question {i}: answer, please.") for i in range(n)]


def _mixed_problem(cls, during: bool) -> str | None:
    cls = type(cls.__name__, (cls,), {"masks_during_pass": during})
    ps = _prompts(7)
    requests = [(p, dict(max_new_tokens=40, structured_outputs=s)) for p, s in zip(ps, SPECS)]
    requests += [(p, dict(max_new_tokens=10, ignore_eos=True)) for p in ps[4:]]
    try:
        results = _run(cls, requests)
    except (RuntimeError, IndexError) as e:  # the library's constraint refuses a token it ruled out
        return (
            f"the run stopped: {str(e).splitlines()[0]}. Every token of a constrained row must come from its "
            "mask: is every chunk that samples (a prefill's last chunk too) given its request's mask?"
        )
    for (prompt, params), (tokens, reason) in zip(requests, results):
        spec = params.get("structured_outputs")
        if spec is None:
            if tokens != greedy_output(
                AdversarialRunner, prompt, 10, frozenset(), FakeModel(text=_tokenizer())
            ):
                return "an unconstrained row in the same passes changed its answer: mask only the constrained rows"
            continue
        if reason != "stop":
            return (
                f"a request constrained to {spec} ended with {reason!r} after {len(tokens)} tokens "
                f"({_answer(tokens)!r}); the model prefers EOS, so it ends as soon as the answer is whole: "
                "is EOS allowed where the text is a whole match?"
            )
        wrong = violation(spec, _answer(tokens))
        if wrong:
            return f"{wrong}: every token of a constrained row must come from its mask (the first one too, from a prefill)"
    return None


def _length_problem(cls) -> str | None:
    ((tokens, reason),) = _run(
        cls, [(_prompts(1)[0], dict(max_new_tokens=2, structured_outputs=dict(regex=PHONE)))]
    )
    text = _answer(tokens)
    if reason != "length" or regex.fullmatch(PHONE, text, partial=True) is None:
        return f"cut by max_new_tokens = 2, the answer should end 'length' and begin a match; it is {text!r}, {reason!r}"
    return None


def _bad_pattern_problem(cls) -> str | None:
    engine = _engine(cls)
    try:
        engine.submit(_prompts(1)[0], structured_outputs=dict(regex="(unclosed"))
    except ValueError:
        return None
    return "a regex that cannot be parsed, '(unclosed', was accepted: compile should raise ValueError"


def _lineage_problem(pieces) -> str | None:
    token_mask, constraint_cls, engine_cls = pieces
    found = ancestry_problem(EngineBase, (Engine,), engine_cls)
    if found:
        return found
    for name in ("compile", "constrain"):
        if getattr(engine_cls, name) is getattr(EngineBase, name):
            return f"{engine_cls.__name__} has no {name}() of its own: write it (lesson 12)"
    return None


def structured_engine(token_mask, constraint_cls, engine_cls) -> Verdict:
    """Check ``token_mask(automaton, state, texts)``, the learner's constraint (``allowed``,
    ``advance``) and ``MyStructuredEngine`` (``compile``, ``constrain``): masks against partial
    matches, EOS where the answer is whole, one mask per state, and whole runs whose every answer
    matches on a model that wants to break them."""
    missing = next(
        (p for p in (token_mask, constraint_cls, engine_cls) if getattr(p, "missing_reason", None)), None
    )
    cases = [
        piece_case(
            "an engine of your own, built on your lesson-6 engine", lambda pieces: _lineage_problem(pieces())
        ),
        *_mask_cases(),
        piece_case(
            f"your constraint for {PHONE} on the course model's 49,152 token texts: mask, EOS, each state once",
            lambda pieces: _constraint_problem(pieces()[2]),
        ),
        *[
            piece_case(
                f"a mixed batch on a model that wants to break every pattern, masks {where}",
                lambda pieces, d=d: _mixed_problem(pieces()[2], d),
            )
            for d, where in ((False, "before the pass"), (True, "during the pass"))
        ],
        piece_case("an answer cut by max_new_tokens", lambda pieces: _length_problem(pieces()[2])),
        piece_case(
            "a regex that cannot be parsed is refused", lambda pieces: _bad_pattern_problem(pieces()[2])
        ),
    ]
    pieces = (lambda: (token_mask, constraint_cls, engine_cls)) if missing is None else missing
    return run_cases("structured_engine", pieces, cases)


def _trace(steps: list[tuple[float, float, float]]):
    """A trace of steps ``(start_s, end_s, mask_s)``."""
    from ...core.trace import StepRecord, Trace

    trace = Trace("check", 1)
    trace.steps = [StepRecord(i, a, b, mask_s=m) for i, (a, b, m) in enumerate(steps)]
    return trace


def mask_share(fn) -> Verdict:
    """Check ``fn(trace)``: the steps' mask time over the steps' time (0.0 for no steps)."""
    from ._core import mistakes, number_compare, table

    rows = [
        ("one step of 2 s, 0.5 s of it masks", [(0.0, 2.0, 0.5)]),
        ("three steps, masks only in the first", [(0.0, 1.0, 0.4), (1.0, 1.5, 0.0), (1.5, 2.5, 0.0)]),
        ("steps with gaps between them (an idle engine)", [(0.0, 1.0, 0.2), (5.0, 6.0, 0.2)]),
        ("no steps", []),
    ]

    def right(steps):
        total = sum(b - a for a, b, _ in steps)
        return sum(m for *_, m in steps) / total if total else 0.0

    def judge(steps):
        if not steps:
            return lambda got, want: (
                None if got == 0.0 else f"a run with no steps has share 0.0, not {show(got)}"
            )
        total, masks = sum(b - a for a, b, _ in steps), sum(m for *_, m in steps)
        return number_compare(
            mistakes(
                (
                    masks / (steps[-1][1] - steps[0][0]),
                    "divide by the steps' own time, not the span from the first to the last (an idle gap is no step)",
                ),
                (
                    masks / (total - masks) if total > masks else None,
                    "masks are part of a step's time: divide by the steps' time, not by the rest of it",
                ),
                (
                    float(np.mean([m / (b - a) for a, b, m in steps])),
                    "a share of the run: total mask time over total step time, not the mean of each step's share",
                ),
            )
        )

    return table(
        "mask_share",
        fn,
        [(label, _trace(s)) for label, s in rows],
        lambda t: right([(x.start_s, x.end_s, x.mask_s) for x in t.steps]),
        lambda t: judge([(x.start_s, x.end_s, x.mask_s) for x in t.steps]),
        "the sum of mask_s over the steps, divided by the sum of end_s - start_s",
    )
