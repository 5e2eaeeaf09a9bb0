"""Lesson 11's checker (``check.speculative_scheduler``) rejects known-wrong pieces and names the
mistake: one wrong piece per clause, each the lesson's right form (``learner_pieces``) with one
mistake; and it accepts right designs that are not the lesson's."""

from __future__ import annotations

import contextlib
import inspect
import io

import numpy as np
import pytest

import learner_pieces
from batchlab.core.request import State
from batchlab.core.scheduler import StallFreeScheduler
from batchlab.core.speculative import propose_ngram
from batchlab.course import checks
from learner_pieces import MyMemoryScheduler, MySpeculativeScheduler, MyStallFreeScheduler, propose


def verdict_of(propose_fn, scheduler_cls):
    with contextlib.redirect_stdout(io.StringIO()):
        return checks.speculative_scheduler(propose_fn, scheduler_cls)


def assert_rejected(verdict, says: str, label: str | None = None) -> None:
    """The verdict fails (not as "not written yet"), says ``says``, and (when given) its first
    failing case's label starts with ``label``."""
    assert not verdict and not verdict.not_written, verdict.message
    assert says in verdict.message, verdict.message
    if label is not None:
        assert verdict.failed[0].startswith(label), verdict.message


# -- the right pieces, and the lineage -----------------------------------------------------------


def test_the_lessons_pieces_pass():
    verdict = verdict_of(propose, MySpeculativeScheduler)
    assert verdict and not verdict.differs, verdict.message


def test_our_scheduler_passes_every_case_but_the_lineage():
    verdict = verdict_of(propose, StallFreeScheduler)
    assert verdict.passed == verdict.total - 1, verdict.message
    assert "this is our StallFreeScheduler: pass your own class" in verdict.message


def test_our_proposer_passes_every_case_but_the_lineage():
    verdict = verdict_of(propose_ngram, MySpeculativeScheduler)
    assert_rejected(verdict, "this propose is our propose_ngram: pass your own function", "your own propose")
    assert verdict.passed == verdict.total - 1, verdict.message


def on_another_base(base: type) -> type:
    """The lesson's piece as a learner writes it, on ``base`` in place of the lesson-8 class (its
    source run again, so its ``super()`` calls go to ``base``)."""
    space = {**vars(learner_pieces), "MyMemoryScheduler": base}
    exec(compile(inspect.getsource(MySpeculativeScheduler), learner_pieces.__file__, "exec"), space)
    return space["MySpeculativeScheduler"]


def test_a_piece_on_the_stand_in_for_lesson_8_is_refused_and_says_to_write_lesson_8():
    """``course.earlier("memory")`` gives our StallFreeScheduler while lesson 8 is not written: a
    piece on it could pass by our planner, so it is refused, saying why."""
    verdict = verdict_of(propose, on_another_base(StallFreeScheduler))
    assert_rejected(verdict, "derives from our StallFreeScheduler", "your own propose, and a scheduler")
    assert "an earlier lesson's piece is not written yet and ours stood in for it" in verdict.message
    assert verdict.passed == verdict.total - 1, verdict.message


def test_a_piece_on_the_lesson_5a_planner_is_refused():
    verdict = verdict_of(propose, on_another_base(MyStallFreeScheduler))
    assert_rejected(verdict, "must build on your lesson-8 scheduler", "your own propose")


def test_a_piece_that_only_inherits_from_lesson_8_is_refused():
    """A class that only inherits from the lesson-8 class (its options taken, nothing else written):
    its accept reaches the base, which decides nothing, so it is not written yet."""

    class OnlyLesson8(MyMemoryScheduler):
        def __init__(
            self, blocks, clock, max_batch_size=8, token_budget=64, num_speculative_tokens=3, policy=None
        ):
            super().__init__(blocks, clock, max_batch_size, token_budget, policy=policy)
            self.num_speculative_tokens = num_speculative_tokens

    verdict = verdict_of(propose, OnlyLesson8)
    assert not verdict and verdict.not_written, verdict.message
    assert "must write accept(req, drafts, picks)" in verdict.message, verdict.message


def test_a_grow_that_only_calls_super_is_refused_as_never_drafting():
    """Its accept written, its grow only the lesson-8 growth: a run that claims speculation and
    never drafts fails, saying so."""

    class OnlySuper(MySpeculativeScheduler):
        def grow(self, batch):
            return MyMemoryScheduler.grow(self, batch)

    verdict = verdict_of(propose, OnlySuper)
    assert_rejected(verdict, "no row ever carried drafts", "a whole run")


def test_an_accept_that_only_calls_super_is_not_written():
    class OnlySuper(MySpeculativeScheduler):
        def accept(self, req, drafts, picks):
            return MyMemoryScheduler.accept(self, req, drafts, picks)

    verdict = verdict_of(propose, OnlySuper)
    assert not verdict and verdict.not_written and "must write accept(req, drafts, picks)" in verdict.message


def test_a_missing_piece_is_not_written_yet():
    from batchlab.course.pieces import Missing

    verdict = verdict_of(
        Missing("propose", "my_engine/speculative.py defines no propose"), MySpeculativeScheduler
    )
    assert not verdict and verdict.not_written and "defines no propose" in verdict.message


# -- propose: the contract --------------------------------------------------------------------


def _search(tokens, k, min_n, max_n, *, lowest=None, itself=False):
    """The lesson's search, with a mistake: ``lowest`` n (ignoring min_n), or ``itself`` (the
    pattern's own position counts as an occurrence)."""
    lowest = min_n if lowest is None else lowest
    for n in range(min(max_n, len(tokens) - 1), lowest - 1, -1):
        for start in range(len(tokens) - n - (0 if itself else 1), -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return start, n
    return None


def matches_itself(tokens, k, min_n=1, max_n=4):
    found = _search(tokens, k, min_n, max_n, itself=True)
    return tokens[found[0] + found[1] : found[0] + found[1] + k] if found else []


def the_matched_tokens(tokens, k, min_n=1, max_n=4):
    found = _search(tokens, k, min_n, max_n)
    return tokens[found[0] : found[0] + k] if found else []


def one_short(tokens, k, min_n=1, max_n=4):
    found = _search(tokens, k, min_n, max_n)
    return tokens[found[0] + found[1] : found[0] + found[1] + k - 1] if found else []


def all_that_follows(tokens, k, min_n=1, max_n=4):
    found = _search(tokens, k, min_n, max_n)
    return tokens[found[0] + found[1] :] if found else []


def ignores_min_n(tokens, k, min_n=1, max_n=4):
    found = _search(tokens, k, min_n, max_n, lowest=1)
    return tokens[found[0] + found[1] : found[0] + found[1] + k] if found else []


def ignores_k_zero(tokens, k, min_n=1, max_n=4):
    return propose(tokens, max(k, 1), min_n, max_n)


def guesses_without_a_match(tokens, k, min_n=1, max_n=4):
    return propose(tokens, k, min_n, max_n) or [tokens[-1]] * k


def changes_its_input(tokens, k, min_n=1, max_n=4):
    found = propose(tokens, k, min_n, max_n)
    tokens.reverse()
    return found


def an_array(tokens, k, min_n=1, max_n=4):
    return np.array(propose(tokens, k, min_n, max_n), dtype=np.int64)


PROPOSE_MISTAKES = [  # (wrong propose, what the verdict says)
    (matches_itself, "propose what followed them there"),
    (the_matched_tokens, "those are the matched tokens themselves"),
    (one_short, "propose as many as k, or as the sequence holds after it"),
    (all_that_follows, "but k = 3: at most k"),
    (ignores_min_n, "that followed an occurrence of only the last 1 token(s), but n goes from min_n = 3"),
    (ignores_k_zero, "k = 0 asks for no drafts: return []"),
    (guesses_without_a_match, "nothing to propose, return []"),
    (changes_its_input, "propose changed the list it was given"),
    (an_array, "propose returns a list of token ids, not a ndarray"),
]


@pytest.mark.parametrize("wrong, says", PROPOSE_MISTAKES, ids=[w.__name__ for w, _ in PROPOSE_MISTAKES])
def test_a_wrong_proposer_is_rejected_and_named(wrong, says):
    assert_rejected(verdict_of(wrong, MySpeculativeScheduler), says, "propose:")


# -- accept: greedy (a table) and sampled (a statistical test) --------------------------------


def _kept_while(drafts, picks, same):
    kept = []
    for i, draft in enumerate(drafts):
        if not same(i, draft):
            break
        kept.append(draft)
    return kept


class Accepts(MySpeculativeScheduler):
    """The lesson's accept with one mistake (``mistake``), for greedy requests or (``sampled_only``)
    for sampled ones only."""

    mistake = None
    sampled_only = False

    def accept(self, req, drafts, picks):
        if self.sampled_only and req.sampler.params.greedy:
            return super().accept(req, drafts, picks)
        if self.mistake == "keeps every draft":
            return [*drafts, picks[-1]]
        if self.mistake == "in the picks":
            kept = _kept_while(drafts, picks, lambda i, d: d in picks)
        elif self.mistake == "skips a rejected draft":
            kept = [d for d, p in zip(drafts, picks) if d == p]
        else:
            kept = _kept_while(drafts, picks, lambda i, d: d == picks[i])
        if self.mistake == "no model token":
            return kept
        if self.mistake == "bonus from the end":
            return [*kept, picks[-1]]
        if self.mistake == "an array":
            return np.array([*kept, picks[len(kept)]])
        return [*kept, picks[len(kept)]]


ACCEPT_MISTAKES = {  # mistake: what the verdict says
    "keeps every draft": "you kept every draft",
    "no model token": "you left out the model's own token",
    "bonus from the end": "not always the last pick",
    "in the picks": "not anywhere among the picks",
    "skips a rejected draft": "stop at the first rejected draft",
    "an array": "accept returns a list of token ids, not a ndarray",
}


def test_the_accept_switchboard_with_no_mistake_passes():
    assert verdict_of(propose, Accepts)


@pytest.mark.parametrize("mistake", ACCEPT_MISTAKES)
def test_a_wrong_greedy_accept_is_rejected_and_named(mistake):
    wrong = type(f"Accepts_{mistake.replace(' ', '_')}", (Accepts,), {"mistake": mistake})
    assert_rejected(verdict_of(propose, wrong), ACCEPT_MISTAKES[mistake], "accept, greedy:")


@pytest.mark.parametrize("mistake", ["keeps every draft", "bonus from the end", "in the picks"])
def test_a_wrong_sampled_accept_fails_the_statistical_test(mistake):
    """Right for greedy requests, wrong for sampled ones: only the chi-square test can tell."""
    wrong = type("Accepts_sampled", (Accepts,), {"mistake": mistake, "sampled_only": True})
    verdict = verdict_of(propose, wrong)
    assert_rejected(verdict, "did not follow the model's distribution", "accept, sampled:")
    assert verdict.passed == verdict.total - 1, verdict.message


# -- whole runs --------------------------------------------------------------------------------


class Grows(MySpeculativeScheduler):
    """The lesson's grow with one mistake switched on (``mistake``), the rest right."""

    mistake = None

    def grow(self, batch):
        batch = MyMemoryScheduler.grow(self, batch)
        budget = self.token_budget - batch.num_tokens
        drafts = {}
        for req in sorted(batch.decode, key=self.policy.importance):
            tokens_left = req.max_new_tokens - len(req.output_ids)
            k = min(self.num_speculative_tokens, budget, tokens_left - 1)
            if self.mistake == "no budget":
                k = min(self.num_speculative_tokens, tokens_left - 1)
            elif self.mistake == "no tokens left":
                k = min(self.num_speculative_tokens, budget)
            elif self.mistake == "never the last token":
                k = min(self.num_speculative_tokens, budget, tokens_left - 2)
            elif self.mistake == "always 3":
                k = min(3, budget, tokens_left - 1)
            if k <= 0:
                continue
            guess = propose(
                req.prompt_ids + req.output_ids, k, self.prompt_lookup_min, self.prompt_lookup_max
            )
            if self.mistake == "repeats the last token":
                guess = [req.output_ids[-1]] * k
            elif self.mistake == "pads to k with -1":
                guess = guess + [-1] * (k - len(guess))
            end = req.num_computed + 1
            held = len(self.blocks.tables[req.id])
            room = (held + (0 if self.mistake == "own blocks only" else self.blocks.num_free)) * 4 - end
            if self.mistake != "not cut to free blocks":
                guess = guess[: max(room, 0)]
            if guess:
                self.blocks.ensure(req.id, end + len(guess))
                drafts[req.id] = guess
                budget -= len(guess)
        batch.drafts = drafts
        return batch


GROW_MISTAKES = {  # mistake: (what the verdict says, the failing case's label starts with)
    "no budget": ("more than the token budget of 16", "a whole run: 8 echo-heavy"),
    "no tokens left": ("positions no request may write", "a whole run"),
    "always 3": (
        "with num_speculative_tokens=0: 0 turns speculation off",
        "a whole run: num_speculative_tokens=0",
    ),
    "repeats the last token": ("the model never confirmed one", "a whole run: verify rows"),
    "pads to k with -1": (
        "ended with reason 'error': a forward pass that carried it raised",
        "a whole run: 8 echo",
    ),
    "not cut to free blocks": ("drafts take FREE blocks only", "a whole run: 12 requests on a pool"),
    "own blocks only": (
        "no verify row spanned two KV blocks, so this run did not test it",
        "a whole run: verify",
    ),
}


def test_the_grow_switchboard_with_no_mistake_passes():
    assert verdict_of(propose, Grows)


@pytest.mark.parametrize("mistake", GROW_MISTAKES)
def test_a_wrong_grow_is_rejected_and_named(mistake):
    wrong = type(f"Grows_{mistake.replace(' ', '_')}", (Grows,), {"mistake": mistake})
    says, label = GROW_MISTAKES[mistake]
    assert_rejected(verdict_of(propose, wrong), says, label)


class OneAtATime(MySpeculativeScheduler):
    """Admits a request only when nobody runs: right, but its pool never runs dry."""

    def fits(self, req, max_tokens):
        return not self.running and super().fits(req, max_tokens)


def test_a_run_that_never_preempts_did_not_test_preemption():
    assert_rejected(
        verdict_of(propose, OneAtATime),
        "no preemption happened on this small pool, so this run did not test it",
        "a whole run: 12 requests on a pool",
    )


def test_a_finishing_case_that_sees_no_rule_inside_a_run_says_it_tested_nothing():
    """Drafts never reaching a request's last token: the max_seq_len case never ends a request
    inside a verify row's run, so it cannot say whether the limit is kept there."""
    wrong = type("Grows_short", (Grows,), {"mistake": "never the last token"})
    assert_rejected(
        verdict_of(propose, wrong),
        "no request finished inside an accepted run, so this did not test it",
        "max_seq_len falling inside",
    )


# -- right designs that are not the lesson's ---------------------------------------------------


class DraftsFirst(MySpeculativeScheduler):
    """vLLM V1's order (the library's StallFreeScheduler): the decode rows' drafts are paid from
    the budget first, the prefills get what is left (a lowered budget for the lesson-5a planner)."""

    def plan(self):
        decode = self.in_state(State.DECODING)
        budget = self.token_budget - len(decode)
        self.planned = {}
        for req in sorted(decode, key=self.policy.importance):
            k = min(self.num_speculative_tokens, budget, req.max_new_tokens - len(req.output_ids) - 1)
            guess = propose(
                req.prompt_ids + req.output_ids, k, self.prompt_lookup_min, self.prompt_lookup_max
            )
            if k > 0 and guess:
                self.planned[req.id] = guess
                budget -= len(guess)
        full = self.token_budget
        self.token_budget = full - sum(map(len, self.planned.values()))
        try:
            return super().plan()
        finally:
            self.token_budget = full

    def grow(self, batch):
        batch = MyMemoryScheduler.grow(self, batch)
        drafts = {}
        for req in batch.decode:
            end = req.num_computed + 1
            room = (len(self.blocks.tables[req.id]) + self.blocks.num_free) * self.blocks.block_size - end
            guess = self.planned.get(req.id, [])[: max(room, 0)]
            if guess:
                self.blocks.ensure(req.id, end + len(guess))
                drafts[req.id] = guess
        batch.drafts = drafts
        return batch


class AdaptiveK(MySpeculativeScheduler):
    """k from the row's recent acceptance: one draft after a rejection, one more after each verify
    row whose drafts were all confirmed (up to num_speculative_tokens)."""

    def __init__(
        self, blocks, clock, max_batch_size=8, token_budget=64, num_speculative_tokens=3, policy=None
    ):
        super().__init__(blocks, clock, max_batch_size, token_budget, num_speculative_tokens, policy=policy)
        self.k = {}

    def accept(self, req, drafts, picks):
        run = super().accept(req, drafts, picks)
        confirmed = len(run) - 1 == len(drafts)
        self.k[req.id] = min(self.num_speculative_tokens, len(drafts) + 1) if confirmed else 1
        return run

    def grow(self, batch):
        full = self.num_speculative_tokens
        rows = {}
        for req in batch.decode:
            rows[req.id] = self.k.get(req.id, full)
        batch = MyMemoryScheduler.grow(self, batch)
        budget = self.token_budget - batch.num_tokens
        drafts = {}
        for req in sorted(batch.decode, key=self.policy.importance):
            k = min(rows[req.id], budget, req.max_new_tokens - len(req.output_ids) - 1)
            if k <= 0:
                continue
            guess = propose(
                req.prompt_ids + req.output_ids, k, self.prompt_lookup_min, self.prompt_lookup_max
            )
            end = req.num_computed + 1
            room = (len(self.blocks.tables[req.id]) + self.blocks.num_free) * self.blocks.block_size - end
            guess = guess[: max(room, 0)]
            if guess:
                self.blocks.ensure(req.id, end + len(guess))
                drafts[req.id] = guess
                budget -= len(guess)
        batch.drafts = drafts
        return batch


def earliest(tokens, k, min_n=1, max_n=4):
    """The longest n first, then its EARLIEST occurrence (the lesson's takes the most recent)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def shortest_first(tokens, k, min_n=1, max_n=4):
    """The shortest n first, then its most recent occurrence."""
    for n in range(min_n, min(max_n, len(tokens) - 1) + 1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("design", [DraftsFirst, AdaptiveK], ids=lambda c: c.__name__)
def test_a_right_schedule_that_is_not_the_lessons_passes(design):
    verdict = verdict_of(propose, design)
    assert verdict, verdict.message


@pytest.mark.parametrize("design", [DraftsFirst, AdaptiveK], ids=lambda c: c.__name__)
def test_the_other_designs_really_schedule_otherwise(design):
    """The designs above are tested as designs: on the checker's echo run their drafts differ
    from the lesson's piece's in some step."""
    from batchlab.course.checks import lesson11
    from batchlab.course.checks._pieces import run_piece

    workload, runner, _, extra = lesson11.WHOLE_RUNS[next(iter(lesson11.WHOLE_RUNS))]
    options = {
        "max_batch_size": 4,
        "token_budget": 16,
        "kv_block_size": 4,
        "num_speculative_tokens": 3,
        **extra,
    }
    schedules = [
        [(s.drafts, s.prefill) for s in run_piece(cls, workload, runner=runner, **options).trace.steps]
        for cls in (design, MySpeculativeScheduler)
    ]
    assert schedules[0] != schedules[1]


@pytest.mark.parametrize("other", [earliest, shortest_first], ids=lambda f: f.__name__)
def test_a_proposer_that_keeps_the_contract_passes_and_is_told_where_it_differs(other, monkeypatch):
    monkeypatch.setattr(learner_pieces, "propose", other)  # the scheduler drafts with it too
    verdict = verdict_of(other, MySpeculativeScheduler)
    assert verdict and verdict.differs, verdict.message
    assert all(label.startswith("propose:") for label in verdict.differs)
    assert "the lesson's rule proposes" in verdict.message and "Both keep the contract" in verdict.message


def test_expected_tokens_accepts_a_closed_form_and_rejects_each_miscount():
    """The geometric sum in any correct form passes; each known miscount is named."""
    closed = checks.expected_tokens(lambda a, k: k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a))
    assert closed, closed.message
    independent = checks.expected_tokens(lambda a, k: 1 + a * k)
    assert not independent and "alpha ** i, not alpha" in independent.message
    no_own = checks.expected_tokens(lambda a, k: sum(a**i for i in range(1, k + 1)))
    assert not no_own and "count the model's own token too" in no_own.message
    one_more = checks.expected_tokens(lambda a, k: sum(a**i for i in range(k + 2)))
    assert not one_more and "draft indices run 1..k" in one_more.message
