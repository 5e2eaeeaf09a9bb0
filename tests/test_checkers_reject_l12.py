"""Lesson 12's checker (``check.structured_engine``) rejects known-wrong pieces and names the mistake:
one wrong piece per clause, each the lesson's right form (``learner_pieces``) with one mistake; and it
accepts right designs that are not the lesson's."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from batchlab.core.engine import Engine
from batchlab.core.structured import compile_constraint
from batchlab.course import checks
from batchlab.course.automaton import Automaton, token_texts
from learner_pieces import MyConstraint, MyEngine, MyStructuredEngine, token_mask


def verdict_of(mask=token_mask, constraint=MyConstraint, engine=MyStructuredEngine):
    with contextlib.redirect_stdout(io.StringIO()):
        return checks.structured_engine(mask, constraint, engine)


def assert_rejected(verdict, says: str, label: str | None = None) -> None:
    assert not verdict and not verdict.not_written, verdict.message
    assert says in verdict.message, verdict.message
    if label is not None:
        assert verdict.failed[0].startswith(label), verdict.message


def test_the_lessons_pieces_pass():
    verdict = verdict_of()
    assert verdict and not verdict.differs, verdict.message


def test_our_engine_is_refused_by_the_lineage_only():
    verdict = verdict_of(engine=Engine)
    assert_rejected(verdict, "this is our Engine: pass your own class", "an engine of your own")
    assert verdict.passed == verdict.total - 2, verdict.message  # and compile gives llguidance's constraint


# -- token_mask ----------------------------------------------------------------------------------


def first_character_only(automaton, state, texts):
    return np.array([bool(t) and automaton.step(state, t[0]) is not None for t in texts])


def empty_allowed(automaton, state, texts):
    mask = token_mask(automaton, state, texts)
    return mask | np.array([t == "" for t in texts])


def as_ints(automaton, state, texts):
    """0 and 1, not False and True: ``~mask`` (how a sampler rules tokens out) is then -1 and -2."""
    return token_mask(automaton, state, texts).astype(int)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (first_character_only, "read EVERY character of the token"),
        (empty_allowed, "an empty text reads no character"),
        (as_ints, "returns a numpy bool array"),
    ],
)
def test_a_wrong_token_mask_is_refused(wrong, says):
    assert_rejected(verdict_of(mask=wrong), says, "token_mask")


# -- the constraint ------------------------------------------------------------------------------


class NoCache(MyConstraint):
    def allowed(self):
        self.masks.clear()
        return super().allowed()


def no_early_stop(automaton, state, texts):
    """Right masks, reading every character of a text even after None (slower, not wrong)."""
    mask = np.zeros(len(texts), dtype=bool)
    for i, text in enumerate(texts):
        s = state
        for ch in text:
            s = automaton.step(s, ch)
        mask[i] = bool(text) and s is not None
    return mask


class NoEarlyStop(MyConstraint):
    def allowed(self):
        if self.state not in self.masks:
            mask = no_early_stop(self.automaton, self.state, self.texts)
            mask[list(self.eos_ids)] = self.automaton.accepting(self.state)
            self.masks[self.state] = mask
        return self.masks[self.state]


class EosAlways(MyConstraint):
    def allowed(self):
        mask = super().allowed().copy()
        mask[list(self.eos_ids)] = True
        return mask


class EosNever(MyConstraint):
    def allowed(self):
        mask = super().allowed().copy()
        mask[list(self.eos_ids)] = False
        return mask


class StaysAtTheStart(MyConstraint):
    def advance(self, token):
        pass


def engine_with(constraint_cls):
    class Mine(MyStructuredEngine):
        def compile(self, spec):
            c = super().compile(spec)
            if isinstance(c, MyConstraint):
                c.__class__ = constraint_cls
            return c

    return Mine


@pytest.mark.parametrize(
    "wrong, says",
    [
        (NoCache, "compute each state's mask once"),
        (EosAlways, "lets EOS end an empty answer"),
        (EosNever, "should allow the EOS ids"),
        (StaysAtTheStart, "should allow the EOS ids"),
    ],
)
def test_a_wrong_constraint_is_refused(wrong, says):
    assert_rejected(verdict_of(constraint=wrong, engine=engine_with(wrong)), says, "your constraint")


# -- the engine ----------------------------------------------------------------------------------


class LibraryForEverything(MyStructuredEngine):
    def compile(self, spec):
        return compile_constraint(spec, self.lm.tokenizer)


class DecodeRowsOnly(MyStructuredEngine):
    """Masks only one-token chunks: a prefill's first token is unconstrained."""

    def constrain(self, batch, chunks):
        super().constrain(batch, [c for c in chunks if len(c.tokens) == 1])


class EveryRow(MyStructuredEngine):
    """Gives the unconstrained rows that sample a constrained request's mask too."""

    def constrain(self, batch, chunks):
        super().constrain(batch, chunks)
        masks = [c.sampler.allowed for c in chunks if c.sampler is not None and c.sampler.allowed is not None]
        for c in chunks:
            if c.sampler is not None and c.sampler.allowed is None and masks:
                c.sampler.allowed = masks[0]


class PerRequestStore(MyStructuredEngine):
    """Gives each request a mask store of its own, shared with no other request of its pattern."""

    def compile(self, spec):
        c = super().compile(spec)
        if isinstance(c, MyConstraint):
            c.masks = {}
        return c


class SuperOnly(MyEngine):
    pass


class NoCompileError(MyStructuredEngine):
    def compile(self, spec):
        try:
            return super().compile(spec)
        except ValueError:
            return super().compile(type(spec)(regex=".*"))


@pytest.mark.parametrize(
    "wrong, says, label",
    [
        (LibraryForEverything, "compile returned the library's grammar", "your constraint"),
        (DecodeRowsOnly, "a prefill's last chunk too", "a mixed batch"),
        (EveryRow, "an unconstrained row in the same passes changed", "a mixed batch"),
        (SuperOnly, "has no compile() of its own", "an engine of your own"),
        (PerRequestStore, "keep the masks per pattern, shared by all its requests", "your constraint"),
        (NoCompileError, "'(unclosed', was accepted", "a regex that cannot be parsed"),
    ],
)
def test_a_wrong_engine_is_refused(wrong, says, label):
    assert_rejected(verdict_of(engine=wrong), says, label)


# -- other right designs -------------------------------------------------------------------------


def by_reading(automaton, state, texts):
    """Through ``Automaton.read``, one call per text."""
    return np.array([bool(t) and automaton.read(t, state) is not None for t in texts])


class OverlappingEngine(MyStructuredEngine):
    masks_during_pass = True


class ByOwnTable(MyStructuredEngine):
    """Builds every state's mask up front when it compiles (a different time, the same masks)."""

    def compile(self, spec):
        c = super().compile(spec)
        if isinstance(c, MyConstraint):
            for s in c.automaton.states:
                if c.automaton.live(s) and s not in c.masks:
                    c.state = s
                    c.allowed()
            c.state = c.automaton.start
        return c


@pytest.mark.parametrize(
    "pieces",
    [
        dict(mask=by_reading),
        dict(engine=OverlappingEngine),
        dict(mask=no_early_stop, constraint=NoEarlyStop, engine=engine_with(NoEarlyStop)),
        dict(engine=ByOwnTable),
    ],
    ids=["mask-by-read", "masks-during-the-pass", "no-early-stop", "masks-built-at-compile"],
)
def test_other_right_designs_pass(pieces):
    verdict = verdict_of(**pieces)
    assert verdict, verdict.message


def test_the_automaton_and_token_texts_agree_with_re():
    """The lesson's tools: ``Automaton`` accepts exactly what ``re.fullmatch`` does on a few strings,
    and ``token_texts`` gives special tokens no text."""
    import re

    from batchlab.model.load import load_tokenizer

    a = Automaton(r"(cat|dog)s? [0-9]{2}")
    for text in ["cat 12", "dogs 07", "cats 1", "cow 12", "cat 123", "dog12", ""]:
        end = a.read(text)
        assert (end is not None and a.accepting(end)) == bool(re.fullmatch(a.pattern, text)), text
    assert Automaton.from_choices(["a.b", "c"]).read("axb") is None
    with pytest.raises(ValueError, match="cannot build an automaton"):
        Automaton("(unclosed")
    tok = load_tokenizer()
    texts = token_texts(tok)
    assert len(texts) == tok.vocab_size and all(texts[i] == "" for i in tok.eos_token_ids)
    assert texts[tok.encode(" the")[0]] == " the"


# -- exercise 2: mask_share ----------------------------------------------------------------------


def share(trace):
    total = sum(s.end_s - s.start_s for s in trace.steps)
    return sum(s.mask_s for s in trace.steps) / total if total else 0.0


def share_over_span(trace):
    if not trace.steps:
        return 0.0
    return sum(s.mask_s for s in trace.steps) / (trace.steps[-1].end_s - trace.steps[0].start_s)


def share_of_the_rest(trace):
    total = sum(s.end_s - s.start_s for s in trace.steps)
    masks = sum(s.mask_s for s in trace.steps)
    return masks / (total - masks) if total else 0.0


def mean_of_shares(trace):
    return float(np.mean([s.mask_s / (s.end_s - s.start_s) for s in trace.steps])) if trace.steps else 0.0


def test_mask_share_passes_and_its_mistakes_are_named():
    with contextlib.redirect_stdout(io.StringIO()):
        assert checks.mask_share(share)
        for wrong, says in [
            (share_over_span, "not the span from the first to the last"),
            (share_of_the_rest, "not by the rest of it"),
            (mean_of_shares, "not the mean of each step's share"),
        ]:
            verdict = checks.mask_share(wrong)
            assert not verdict and says in verdict.message, verdict.message
