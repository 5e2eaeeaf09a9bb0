"""Checkers for lesson 11 (speculative decoding by prompt lookup): ``propose`` as a contract (any
proposer that keeps it passes; where it is not the lesson's rule, a second line says where),
``accept`` as a table (greedy) and as a statistical test (sampled), and whole runs of the
learner's scheduler on test models of ``core.fake`` whose answers are known: one that echoes its
prompt (drafts accepted), one that never says what prompt lookup could guess (every draft
rejected), on roomy and starved KV pools."""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable

import numpy as np

from ...core.engine import make_engine
from ...core.fake import (
    PERIOD,
    ContrarianRunner,
    EchoRunner,
    FakeModel,
    FakeRunner,
    PureEchoRunner,
    TickClock,
    greedy_output,
)
from ...core.request import Request, SamplingParams, clamp_new_tokens
from ...core.scheduler import OnDemandKV, Scheduler
from ...core.speculative import accept_greedy, propose_ngram
from ...core.trace import Trace
from ...measurement.workloads import Workload, WorkloadRequest
from ._core import Case, Differs, Verdict, WrongType, mistakes, number_compare, run_cases, show, table
from ._lineage import KINDS_OF_OURS, ancestry_problem
from ._pieces import HELD, VOCAB, Ask, finishing_problem, piece_case, run_piece

__all__ = ["speculative_scheduler", "chi_square_p001", "expected_tokens"]


# ---------------------------------------------------------------------------------------
# A statistical test: do emitted tokens follow the distribution plain sampling gives?


def chi_square_p001(counts: Counter, probs: dict) -> tuple[float, float]:
    """Pearson's statistic over the cells expected at least 5 times (the rest pooled in one),
    and its critical value at alpha = 0.001 (Wilson-Hilferty; an outcome of probability 0, or
    one ``probs`` does not name, counts as infinitely unlikely)."""
    n = sum(counts.values())
    if set(counts) - set(probs) or any(probs[c] == 0 for c in counts):
        return float("inf"), 0.0
    big = [cell for cell, p in probs.items() if p * n >= 5]
    observed = [counts[c] for c in big] + [n - sum(counts[c] for c in big)]
    expected = [probs[c] * n for c in big] + [n - sum(probs[c] * n for c in big)]
    if expected[-1] < 5:  # nothing worth a cell left over
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    k = len(expected) - 1
    return stat, k * (1 - 2 / (9 * k) + 3.090 * (2 / (9 * k)) ** 0.5) ** 3


# ---------------------------------------------------------------------------------------
# propose: the tokens that followed an earlier occurrence of the last n tokens, as a contract.


def _occurrences(tokens: list[int], min_n: int, max_n: int) -> list[tuple[int, int]]:
    """(n, start) of every earlier occurrence (one that ends before the last position) of the
    last n tokens, min_n <= n <= max_n."""
    return [
        (n, start)
        for n in range(min_n, min(max_n, len(tokens) - 1) + 1)
        for start in range(len(tokens) - n)  # start + n <= len - 1: never the pattern itself
        if tokens[start : start + n] == tokens[-n:]
    ]


def _followers(tokens: list[int], k: int, min_n: int, max_n: int) -> dict[tuple, tuple[int, int]]:
    """Every proposal the contract allows: the up to k tokens after an earlier occurrence of the
    last n tokens, min_n <= n <= max_n; each with the (n, start) that gives it, the longest n
    first, then the most recent."""
    allowed: dict[tuple, tuple[int, int]] = {}
    for n, start in _occurrences(tokens, min_n, max_n):  # by n, then start: the last one stays
        allowed[tuple(tokens[start + n : start + n + k])] = (n, start)
    return allowed


def _as_tokens(got, what: str) -> tuple[list[int] | None, str | None]:
    if not isinstance(got, list):
        return None, f"{what} returns a list of token ids, not a {type(got).__name__}"
    for i, t in enumerate(got):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            return None, f"item {i} is {show(t)}: {what} returns token ids as ints"
    return [int(t) for t in got], None


PROPOSE = (
    "for some n from min_n to max_n: the tokens that followed an earlier occurrence of the last n "
    "tokens (one ending before the last position), as many as k or as the sequence holds after it"
)


def _proposal_problem(got, tokens: list[int], k: int, min_n: int, max_n: int) -> str | None:
    """What is wrong with ``got`` as ``propose(tokens, k, min_n, max_n)`` (None: the lesson's
    answer; ``Differs``: another that keeps the contract)."""
    ours, allowed = propose_ngram(tokens, k, min_n, max_n), _followers(tokens, k, min_n, max_n) if k else {}
    got, problem = _as_tokens(got, "propose")
    if problem:
        return problem
    if k == 0 and got:
        return "k = 0 asks for no drafts: return []"
    if len(got) > k:
        return f"you proposed {len(got)} tokens, but k = {k}: at most k"
    if not allowed:
        if not got:
            return None
        short = len(tokens) < min_n + 1
        return (
            (
                f"{len(tokens)} token(s) hold no earlier occurrence of the last {min_n} (min_n)"
                if short
                else f"no n-gram of the last {min_n} to {max_n} tokens occurred before (one ending before the "
                "last position)"
            )
            + ": nothing to propose, return []"
            + _and(_why_not(got, tokens, k, min_n, max_n))
        )
    if tuple(got) in allowed:
        n, start = allowed[tuple(got)]
        return (
            None
            if got == ours
            else Differs(
                f"yours proposed {got}, what followed the last {n} token(s) where they occurred at "
                f"position {start}; the lesson's rule proposes {ours} (the longest n first, then its most "
                "recent earlier occurrence). Both keep the contract."
            )
        )
    if not got:
        n, start = max(_occurrences(tokens, min_n, max_n))
        return (
            f"the last {n} token(s) {tokens[-n:]} occurred before, at position {start}: propose what "
            f"followed them there ({tokens[start + n : start + n + k]})"
        )
    return _why_not(got, tokens, k, min_n, max_n) or (
        f"{got} is not what followed an earlier occurrence of the last n tokens (n from {min_n} to "
        f"{max_n}) in this sequence"
    )


def _propose_case(label: str, tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> Case:
    def call(pieces):
        given = list(tokens)
        return pieces()[0](given, k, min_n, max_n), given

    def compare(result, expected):
        got, given = result
        if given != tokens:
            return (
                f"propose changed the list it was given, to {show(given)}: those are the request's prompt "
                "and output, so read them, never modify them (slice or copy what you need)"
            )
        return _proposal_problem(got, tokens, k, min_n, max_n)

    expected = (propose_ngram(tokens, k, min_n, max_n), tokens)
    return Case(f"propose: {label}", call, expected, compare, PROPOSE, show=lambda result: show(result[0]))


def _and(reason: str) -> str:
    return f"; {reason}" if reason else ""


def _why_not(got: list[int], tokens: list[int], k: int, min_n: int, max_n: int) -> str:
    """The likely mistake behind a proposal the contract does not allow ("" if none is known)."""
    cut = [list(f) for f in _followers(tokens, len(tokens), min_n, max_n)]  # every follower, uncut
    if any(len(got) < min(k, len(f)) and f[: len(got)] == got for f in cut):
        return (
            f"you proposed {len(got)} token(s) where more followed that occurrence: propose as many as "
            "k, or as the sequence holds after it"
        )
    for n in range(1, len(tokens)):
        if tuple(got) in _followers(tokens, k, n, n) and not min_n <= n <= max_n:
            return (
                f"that followed an occurrence of only the last {n} token(s), but n goes from "
                f"min_n = {min_n} to max_n = {max_n}"
            )
    if any(got == tokens[start : start + len(got)] for _, start in _occurrences(tokens, min_n, max_n)):
        return "those are the matched tokens themselves: propose the tokens that FOLLOWED the occurrence"
    return ""


def _propose_cases() -> list[Case]:
    return [
        _propose_case("one token: nothing earlier to match", [7], 3),
        _propose_case("3 tokens with min_n = 3: too short for an earlier occurrence", [2, 2, 2], 2, 3, 4),
        _propose_case("no token occurs twice: nothing to propose", [1, 2, 3, 4, 5, 6], 3),
        _propose_case("the last 2 tokens [1, 2] began the sequence", [1, 2, 3, 9, 1, 2], 3),
        _propose_case("k = 5, but only 3 tokens follow the occurrence", [4, 5, 6, 4, 5], 5),
        _propose_case("a pattern that overlaps itself: 8 9 8 9 8", [8, 9, 8, 9, 8], 3),
        _propose_case("min_n = 2: only a single token ([1]) occurred before", [1, 2, 3, 1], 3, 2, 4),
        _propose_case(
            "[1, 2] and [2] occurred before, with different followers", [1, 2, 3, 9, 2, 5, 1, 2], 2
        ),
        _propose_case(
            "[1, 2] occurred twice before, with different followers", [5, 1, 2, 7, 5, 1, 2, 8, 3, 1, 2], 2
        ),
        _propose_case("k = 0 asks for no drafts", [3, 4, 5, 3, 4], 0),
    ]


# ---------------------------------------------------------------------------------------
# accept: the drafts the picks confirm, then the model's own token.

ACCEPT = (
    "keep drafts while each equals the pick at its own position; then the pick where the first did "
    "not (a correction), or after the last draft (a bonus)"
)


def _scheduler(cls):
    """An instance of the learner's class, as an engine builds it."""
    engine = make_engine(
        cls,
        FakeModel(vocab_size=VOCAB),
        runner=FakeRunner,
        clock=TickClock(),
        kv_block_size=4,
        max_batch_size=4,
        token_budget=16,
        num_speculative_tokens=3,
    )
    return engine.scheduler


def _request(sampled: bool) -> Request:
    params = SamplingParams(temperature=1.0, seed=0) if sampled else SamplingParams()
    req = Request("r0", [3, 9, 4, 7, 5], 20, params, frozenset({0}), 0.0)
    req.output_ids.extend([3, 9])
    return req


def _accept_diagnose(drafts: list[int], picks: list[int]) -> Callable:
    def diagnose(got, want):
        j = len(want) - 1  # where the first draft was rejected (or the bonus)
        if got == want[:-1]:
            return (
                f"you left out the model's own token: after the {j} confirmed draft(s) add picks[{j}] = "
                f"{picks[j]} ({'the bonus' if j == len(drafts) else 'its correction'})"
            )
        if len(got) > len(want) and got[:j] == want[:j] and j < len(drafts):
            if got == [*drafts, picks[-1]]:
                return (
                    f"you kept every draft, but drafts[{j}] = {drafts[j]} is not the model's pick there "
                    f"(picks[{j}] = {picks[j]}): stop at the first draft the model does not confirm"
                )
            if drafts[j] in picks:
                return (
                    f"drafts[{j}] = {drafts[j]} is not picks[{j}] = {picks[j]}: a draft counts only where "
                    "the model picked it at its OWN position, not anywhere among the picks"
                )
            return (
                f"drafts[{j}] = {drafts[j]} is not the model's pick there ({picks[j]}): stop at the first "
                "rejected draft, the picks after it were computed on a wrong context"
            )
        if len(got) == len(want) and got[:-1] == want[:-1] and got[-1] == picks[-1] != want[-1]:
            return (
                f"the model's token is its pick where the first draft was rejected, picks[{j}] = "
                f"{picks[j]}, not always the last pick"
            )
        return ""

    return diagnose


def _accept_case(label: str, drafts: list[int], picks: list[int]) -> Case:
    def call(pieces):
        cls = pieces()[1]
        return cls.accept(_scheduler(cls), _request(False), list(drafts), list(picks))

    diagnose = _accept_diagnose(drafts, picks)

    def compare(got, want):
        got, problem = _as_tokens(got, "accept")
        return problem or (None if got == want else diagnose(got, want))

    return Case(f"accept, greedy: {label}", call, accept_greedy(drafts, picks), compare, ACCEPT)


def _accept_cases() -> list[Case]:
    return [
        _accept_case(
            "drafts [5, 6, 7], picks [5, 6, 7, 8]: all confirmed, the bonus 8", [5, 6, 7], [5, 6, 7, 8]
        ),
        _accept_case("drafts [5, 6, 7], picks [9, 6, 7, 8]: the first rejected", [5, 6, 7], [9, 6, 7, 8]),
        _accept_case("drafts [5, 6, 7], picks [5, 9, 7, 8]: rejected in the middle", [5, 6, 7], [5, 9, 7, 8]),
        _accept_case("no drafts, picks [4]: the model's one token", [], [4]),
        _accept_case(
            "drafts [6, 5, 9], picks [5, 6, 2, 3]: each draft is a pick, but not at its own position",
            [6, 5, 9],
            [5, 6, 2, 3],
        ),
    ]


# Sampled rows: draws i.i.d. from a known distribution per position (the model's p at that
# position: here the same whatever came before), so plain sampling gives t0 ~ P[0], t1 ~ P[1].
_P = np.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.4, 0.1, 0.1, 0.4]])
_GUESS = [0, 1, 2, 3]  # the draft at each position: its most likely token (mostly)
SAMPLED_RUNS, SAMPLED_SEED = 2000, 11


def _sampled_pairs(accept: Callable) -> Counter:
    """The first two tokens of ``SAMPLED_RUNS`` sampled requests, each made by verify rows of two
    drafts: the first row at position 0, a second at position 1 if the first gave one token."""
    rng = np.random.default_rng(SAMPLED_SEED)
    draws = {m: np.stack([rng.choice(4, SAMPLED_RUNS, p=_P[m + j]) for j in range(3)], 1) for m in (0, 1)}
    pairs: Counter = Counter()
    for i in range(SAMPLED_RUNS):
        seq: list[int] = []
        while len(seq) < 2:
            m = len(seq)
            drafts, picks = _GUESS[m : m + 2], draws[m][i].tolist()
            returned = accept(list(drafts), list(picks))
            got, problem = _as_tokens(returned, "accept")
            if problem or not 1 <= len(got) <= 3:
                raise WrongType(
                    f"for drafts {drafts} and draws {picks} your accept returned {show(returned)}: "
                    + (problem or "accept returns 1 to len(drafts) + 1 tokens")
                )
            seq += got
        pairs[tuple(seq[:2])] += 1
    return pairs


SAMPLED = (
    "a sampled request: keep a draft only while the draw at its own position equals it; at the first "
    "that does not, emit that position's draw, so every token follows the model's distribution"
)


def _sampled_case() -> Case:
    def call(pieces):
        cls = pieces()[1]
        sched, req = _scheduler(cls), _request(True)
        return _sampled_pairs(lambda drafts, picks: cls.accept(sched, req, drafts, picks))

    def compare(pairs, _):
        first = Counter()
        for (t0, _t1), count in pairs.items():
            first[(t0,)] += count
        for counts, probs, what in (
            (first, {(a,): _P[0][a] for a in range(4)}, "the first token"),
            (
                pairs,
                {(a, b): _P[0][a] * _P[1][b] for a in range(4) for b in range(4)},
                "the first two tokens",
            ),
        ):
            stat, critical = chi_square_p001(counts, probs)
            if stat >= critical:
                cell = max(probs, key=lambda c: abs(counts[c] / SAMPLED_RUNS - probs[c]))
                return (
                    f"over {SAMPLED_RUNS} sampled requests, {what} your accept emitted did not follow the "
                    f"model's distribution (chi-square {stat:.0f}, the limit at p = 0.001 is {critical:.1f}): "
                    f"{list(cell)} came {counts[cell] / SAMPLED_RUNS:.0%} of the time, plain sampling gives "
                    f"{probs[cell]:.0%}"
                )
        return None

    label = (
        f"accept, sampled: the first two tokens of {SAMPLED_RUNS} requests, draws from known distributions, "
        "against plain sampling (chi-square, p = 0.001)"
    )

    def shown(value):
        return (
            "plain sampling's distribution" if value is None else f"{SAMPLED_RUNS} requests' tokens (below)"
        )

    return Case(label, call, None, compare, SAMPLED, show=shown)


# ---------------------------------------------------------------------------------------
# Whole runs of the learner's scheduler, judged by their traces and outputs.


def _echo_prompts(seed: int, count: int, reps: tuple[int, int]) -> list[list[int]]:
    """Prompts of a pattern of ``PERIOD`` different tokens (no EOS), repeated: echo-heavy."""
    rng = random.Random(seed)
    return [rng.sample(range(1, VOCAB), PERIOD) * rng.randint(*reps) for _ in range(count)]


def _workload(name: str, seed: int, count: int, reps: tuple[int, int], new: tuple[int, int]) -> Workload:
    rng = random.Random(seed + 1)
    prompts = _echo_prompts(seed, count, reps)
    reqs = [WorkloadRequest(f"s{i}", p, rng.randint(*new)) for i, p in enumerate(prompts)]
    return Workload(name, name, reqs, seed)


NO_DRAFTS = (
    "no row ever carried drafts: after your lesson-8 growth, grow must give decode rows their drafts "
    "(batch.drafts[req.id] = the tokens propose found), from what is left of the token budget"
)


def _made_before(trace: Trace) -> list[dict[str, int]]:
    """For each step, each request's tokens handed out before it."""
    made: Counter = Counter()
    before = []
    for step in trace.steps:
        before.append(dict(made))
        for rid, tokens in step.emitted.items():
            made[rid] += len(tokens)
    return before


def _draft_limit_problem(trace: Trace, max_seq_len: int) -> str | None:
    """No verify row drafts past the request's last token (max_new_tokens, or max_seq_len)."""
    made = _made_before(trace)
    for step, before in zip(trace.steps, made):
        for rid, n in step.drafts.items():
            rec = trace.requests[rid]
            left = clamp_new_tokens(rec.prompt_len, rec.max_new_tokens, max_seq_len) - before.get(rid, 0)
            if n > left:
                return (
                    f"step {step.index}: {rid} carried {n} drafts with only {left} token(s) left to make: "
                    "its last drafts sit past max_new_tokens (or max_seq_len), positions no request may "
                    "write. At most tokens left - 1 are worth a draft (the model adds one of its own)"
                )
    return None


def _crosses_a_block(trace: Trace, block_size: int) -> bool:
    """Some verify row's tokens span two KV blocks."""
    for step, before in zip(trace.steps, _made_before(trace)):
        for rid, n in step.drafts.items():
            start = trace.requests[rid].prompt_len + before.get(rid, 0) - 1  # its input token
            if n and start // block_size != (start + n) // block_size:
                return True
    return False


def _preempted_while_speculating(trace: Trace) -> bool:
    """Some request gave its blocks back after a verify row of its own had run."""
    drafted: set[str] = set()
    for step in trace.steps:
        if drafted & set(step.preempted):
            return True
        drafted |= set(step.drafts)
    return False


class _TokenIds:
    """A test model that refuses, as a real one does, a row holding anything but its token ids."""

    def forward(self, chunks, head_rows=None):
        for chunk in chunks:
            bad = [t for t in chunk.tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
            bad += [t for t in chunk.tokens if t not in bad and not 0 <= t < self.lm.vocab_size]
            if bad:
                raise ValueError(
                    f"{chunk.req_id}'s row holds {show(bad[0])}, which is no token id of the model (0 to "
                    f"{self.lm.vocab_size - 1}): a draft is a token the request's own tokens hold"
                )
        return super().forward(chunks, head_rows)


@functools.cache
def _checked(runner: type[FakeRunner]) -> type[FakeRunner]:
    return type(runner.__name__, (_TokenIds, runner), {})


def _outputs_problem(run, workload: Workload, runner: type[FakeRunner]) -> str | None:
    """Every request of ``workload`` got the model's own greedy answer, and none ended "error"."""
    for r in workload:
        rec = run.trace.requests[r.id]
        want = greedy_output(runner, r.prompt_ids, r.max_new_tokens, frozenset(), FakeModel(vocab_size=VOCAB))
        if rec.finish_reason == "error":
            return f"{r.id} ended with reason 'error': a forward pass that carried it raised" + (
                f" (the first that failed: {run.first_error})" if run.first_error else ""
            )
        if list(rec.output_ids) != want:
            drafted = any(r.id in s.drafts for s in run.trace.steps)
            why = ": a verify row keeps only the drafts the model's picks confirm, then the model's own pick"
            return f"{r.id} produced {rec.output_ids[:8]}..., the model's answer is {want[:8]}..." + (
                f"{why} (accept)" if drafted else ""
            )
    return None


def _run_problem(
    cls,
    workload: Workload,
    runner: type[FakeRunner],
    *,
    speculate: bool = True,
    accepted: bool = False,
    preempt: bool = False,
    boundary: bool = False,
    **options,
) -> str | None:
    """``workload`` on the learner's scheduler around ``runner``'s model: the first thing wrong,
    then the first thing the run must show (``accepted`` drafts, a ``preempt``ion while speculating,
    a verify row across a block ``boundary``) and did not."""
    options = {
        "max_batch_size": 4,
        "token_budget": 16,
        "kv_block_size": 4,
        "num_speculative_tokens": 3,
        **options,
    }
    hints = {"memory": "drafts take FREE blocks only (a draft is a guess: it preempts nobody)"}
    run = run_piece(cls, workload, runner=_checked(runner), hints=hints, **options)
    if run.problem:
        return run.problem
    trace, budget = run.trace, options["token_budget"]
    over = [(s.index, s.num_tokens) for s in trace.steps if s.num_tokens > budget]
    drafted = [s for s in trace.steps if s.drafts]
    confirmed = any(s.accepted.get(rid) for s in drafted for rid in s.drafts)
    untested = "so this run did not test it"
    found = [
        _outputs_problem(run, workload, runner),
        over
        and f"step {over[0][0]} ran {over[0][1]} tokens (decode rows, their drafts and prefill chunks), more "
        f"than the token budget of {budget}: drafts are paid from the budget, from what the step has left",
        run.blocks_held and f"at the end {run.blocks_held} {HELD}",
        _draft_limit_problem(trace, 4096),
        not speculate
        and drafted
        and f"step {drafted[0].index} carried drafts with num_speculative_tokens=0: 0 turns speculation off",
        speculate and not drafted and NO_DRAFTS,
        accepted
        and drafted
        and not confirmed
        and "drafts were proposed, but the model never confirmed one, on a model that repeats its prompt: "
        "are the drafts what followed the last tokens' earlier occurrence?",
        preempt and not run.preemptions and f"no preemption happened on this small pool, {untested}",
        preempt
        and not _preempted_while_speculating(trace)
        and f"no request was preempted after it had carried drafts, {untested}",
        boundary
        and drafted
        and not _crosses_a_block(trace, options["kv_block_size"])
        and f"no verify row spanned two KV blocks, {untested}",
    ]
    return next(filter(None, found), None)


_ECHO = _workload("echo", 3, 8, (2, 5), (12, 30))
_STARVED = _workload("starved", 11, 12, (2, 5), (20, 40))
_BOUNDARY = _workload("boundary", 7, 3, (3, 4), (24, 30))

WHOLE_RUNS = {  # label: (workload, runner, what the run must show, engine options)
    "8 echo-heavy prompts on a model that repeats them: drafts accepted, the model's own outputs": (
        _ECHO,
        EchoRunner,
        dict(accepted=True),
        {},
    ),
    "6 prompts on a model that never says what prompt lookup guesses: every draft rejected": (
        _workload("contrarian", 5, 6, (2, 4), (10, 24)),
        ContrarianRunner,
        {},
        {},
    ),
    "12 requests on a pool of 22 blocks of 4 tokens: preemptions in the middle of speculation": (
        _STARVED,
        EchoRunner,
        dict(preempt=True),
        dict(max_batch_size=6, token_budget=24, num_kv_blocks=22),
    ),
    "verify rows across KV block boundaries (blocks of 4 tokens), 5 drafts a row": (
        _BOUNDARY,
        PureEchoRunner,
        dict(boundary=True, accepted=True),
        dict(num_speculative_tokens=5, token_budget=24),
    ),
    "num_speculative_tokens=0: no drafts at all, the model's own outputs": (
        _ECHO,
        EchoRunner,
        dict(speculate=False),
        dict(num_speculative_tokens=0),
    ),
}


# Finishing rules inside an accepted run: on a model that repeats the token 5 places back,
# prompt lookup proposes exactly what it will say, so a rule falls inside a verify row's run.
_FINISHING = [
    Ask("its 3rd token is EOS, inside an accepted run: 'stop' there", [5, 6, 7, 0, 8] * 3 + [5], 20),
    Ask("stop_token_ids=[13], its 3rd token: 'stop' there", [11, 12, 9, 13, 14] * 3 + [11], 20, True, (13,)),
    Ask("max_new_tokens=4 inside a run of drafts: 'length' after 4", [21, 22, 23, 24, 25] * 4, 4, True),
    Ask("max_new_tokens=9: 'length' after exactly 9", [31, 32, 33, 34, 35] * 4, 9, True),
]
_SEQ_LEN = [
    Ask(
        "a 31-token prompt, max_seq_len=37: 6 tokens, then 'length'",
        [41, 42, 43, 44, 45] * 6 + [41],
        100,
        True,
    )
]


def _finishing_then(max_seq_len: int) -> Callable:
    def then(engine):
        trace = engine.trace
        if not any(s.drafts for s in trace.steps):
            return NO_DRAFTS
        limit = _draft_limit_problem(trace, max_seq_len)
        inside = any(rid in s.finished and s.accepted.get(rid) for s in trace.steps for rid in s.drafts)
        return limit or (
            None if inside else "no request finished inside an accepted run, so this did not test it"
        )

    return then


def _finishing_cases() -> list[Case]:
    options = dict(
        model_runner=_checked(PureEchoRunner),
        max_batch_size=4,
        token_budget=24,
        kv_block_size=4,
        num_speculative_tokens=4,
    )
    rules = "the base hands a run's tokens out one by one through your finish_reason and stops at the first that ends it"
    return [
        piece_case(
            "EOS, a stop token and max_new_tokens falling inside an accepted run end the request there",
            lambda pieces: finishing_problem(pieces()[1], _FINISHING, then=_finishing_then(4096), **options),
            rules,
        ),
        piece_case(
            "max_seq_len falling inside an accepted run: no draft past it",
            lambda pieces: finishing_problem(pieces()[1], _SEQ_LEN, 37, then=_finishing_then(37), **options),
            rules,
        ),
    ]


def _lineage_problem(propose, cls) -> str | None:
    if propose is propose_ngram:
        return "this propose is our propose_ngram: pass your own function"
    found = ancestry_problem(Scheduler, KINDS_OF_OURS, cls)
    if found or issubclass(cls, OnDemandKV):
        return found
    return (
        f'{cls.__name__} must build on your lesson-8 scheduler: MyMemoryScheduler = course.earlier("memory"), '
        f"then class {cls.__name__}(MyMemoryScheduler)"
    )


def speculative_scheduler(propose, scheduler_cls) -> Verdict:
    """Check ``propose(tokens, k, min_n, max_n)`` and ``MySpeculativeScheduler`` (its ``grow`` choosing
    drafts, its ``accept``): the contract of prompt lookup, the acceptance rule greedy and sampled, and
    whole runs on test models whose answers are known."""
    missing = next((p for p in (propose, scheduler_cls) if getattr(p, "missing_reason", None)), None)
    lineage = piece_case(
        "your own propose, and a scheduler that builds on your lesson-8 scheduler (none of our kinds)",
        lambda pieces: _lineage_problem(*pieces()),
    )
    runs = [
        piece_case(
            f"a whole run: {label}",
            lambda pieces, w=w, runner=runner, show=show_, options=options: _run_problem(
                pieces()[1], w, runner, **show, **options
            ),
        )
        for label, (w, runner, show_, options) in WHOLE_RUNS.items()
    ]
    cases = [lineage, *_propose_cases(), *_accept_cases(), _sampled_case(), *runs, *_finishing_cases()]
    pieces = (lambda: (propose, scheduler_cls)) if missing is None else missing
    return run_cases("speculative_scheduler", pieces, cases)


def expected_tokens(fn: Callable) -> Verdict:
    """Check ``fn(alpha, k)``: the expected tokens one verify row of ``k`` drafts yields when each
    draft is accepted with probability ``alpha``, as long as every draft before it was."""
    rows = [
        ("no drafts: the model's own token only", 0.6, 0),
        ("one draft kept half the time", 0.5, 1),
        ("three drafts, alpha 0.8", 0.8, 3),
        ("every draft always right: k + 1 tokens", 1.0, 4),
        ("drafts never right: still the model's token", 0.0, 5),
    ]

    def right(alpha, k):
        return sum(alpha**i for i in range(k + 1))

    def judge(alpha, k):
        return number_compare(
            mistakes(
                (1 + alpha * k, "draft i is kept only if drafts 1..i all are: alpha ** i, not alpha"),
                (alpha * k, "count the model's own token too: every verify row yields it"),
                (right(alpha, k) - 1, "count the model's own token too: every verify row yields it"),
                (sum(alpha**i for i in range(k + 2)), "k drafts, so draft indices run 1..k"),
            )
        )

    hint = (
        "the expected count is the sum over i = 1..k of P(draft i kept) = alpha ** i, plus the model's token"
    )
    return table("expected_tokens", fn, rows, right, judge, hint)
