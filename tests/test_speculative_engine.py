"""Speculative decoding by prompt lookup in the engine (the stall-free kind's
``num_speculative_tokens``), against references that no engine code computes.

On the fake model every greedy answer is known: ``fake.reference_output`` for the fake's own
model, and for the test runners of ``core.fake`` (shared with lesson 11's checker)
``fake.greedy_output``, a plain loop over their ``choose``. The fake's model is a hash, so it
never echoes its prompt and drafts are rejected; ``EchoRunner``'s model repeats the token
``PERIOD`` places back most of the time, so drafts from an echo-heavy prompt are accepted until
it does not; ``ContrarianRunner``'s never says a token prompt lookup could propose. The runners
read every context through the block tables from a pool of KV positions, so a rewind that kept
a rejected draft's position, or a block freed while in use, gives a wrong answer. One test runs
the real model (slow).
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from test_kv import check_blocks

from batchlab import make_engine
from batchlab.core.fake import (
    PERIOD,
    ContrarianRunner,
    EchoRunner,
    FakeModel,
    FakeRunner,
    PureEchoRunner,
    greedy_output,
    reference_output,
    sequence_hash,
)
from batchlab.core.kv import BlockManager
from batchlab.core.metrics import summarize
from batchlab.core.scheduler import StallFreeScheduler
from batchlab.core.speculative import accept_sampled, propose_ngram
from batchlab.core.trace import Trace
from batchlab.course.checks.lesson11 import chi_square_p001

LM = FakeModel()
EOS = frozenset({LM.eos_id})


def reference(runner_cls, prompt, max_new, eos=EOS):
    """One greedy request, one token at a time, on the runner's model (no engine)."""
    return greedy_output(runner_cls, prompt, max_new, eos, LM)


def echo_prompt(rng, reps=(3, 8)) -> list[int]:
    """A pattern of ``PERIOD`` different tokens (no EOS), repeated: an echo-heavy prompt."""
    return rng.sample(range(1, LM.vocab_size), PERIOD) * rng.randint(*reps)


def random_prompt(rng) -> list[int]:
    return [rng.randrange(1, LM.vocab_size) for _ in range(rng.randint(3, 40))]


def engine_for(runner, **options):
    options = {"max_batch_size": 4, "token_budget": 24, "kv_block_size": 4, **options}
    return make_engine("stallfree", LM, runner=runner, **options)


def run(engine, requests, check_each_step=False, **params):
    ids = [engine.submit(p, max_new_tokens=m, **params) for p, m in requests]
    engine.__dict__.setdefault("test_prompts", {}).update(zip(ids, (p for p, _ in requests)))
    while engine.step():
        if check_each_step:
            check_blocks(engine.scheduler.blocks)
            check_cached_blocks_are_verified(engine)
    engine.raise_if_failing()
    return [engine.poll(i) for i in ids]


def check_trace(engine) -> None:
    """Every step within the token budget, each request's tokens emitted once and in order,
    no more drafts accepted than carried, and every KV block back in the pool (free, or
    free and cached)."""
    budget = engine.scheduler.token_budget
    emitted = {rid: [] for rid in engine.trace.requests}
    for step in engine.trace.steps:
        assert step.num_tokens <= budget, f"step {step.index}: {step.num_tokens} tokens > {budget}"
        assert set(step.drafts) <= set(step.decoded), "drafts ride on decode rows only"
        for rid, n in step.accepted.items():
            assert 0 <= n <= step.drafts[rid]
        for rid, tokens in step.emitted.items():
            emitted[rid] += tokens
    for rid, record in engine.trace.requests.items():
        assert emitted[rid] == record.output_ids
    blocks = engine.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks and not blocks.tables, "every KV block is back"


def check_cached_blocks_are_verified(engine) -> None:
    """Every block the prefix cache names is a full block of some request's real sequence
    (prompt + the tokens it was handed): no draft that was not accepted, and the name's
    tokens and everything before them are those the block's keys and values came from."""
    real = set()
    bs = engine.scheduler.blocks.block_size
    for rid, prompt in engine.test_prompts.items():  # every prompt ``run`` submitted to it
        seq, key = prompt + engine.trace.requests[rid].output_ids, b""
        for i in range(len(seq) // bs):
            key = BlockManager.block_key(key, seq[i * bs : (i + 1) * bs])
            real.add(key)
    unknown = set(engine.scheduler.blocks.cached) - real
    assert not unknown, f"{len(unknown)} cached block(s) hold tokens no request has"


# -- greedy: the same tokens as without speculation ------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_outputs_equal_the_reference_on_echo_and_random_prompts(k):
    rng = random.Random(k)
    requests = [(echo_prompt(rng), rng.randint(1, 40)) for _ in range(10)]
    requests += [(random_prompt(rng), rng.randint(1, 40)) for _ in range(10)]
    rng.shuffle(requests)
    accepted = rejected = 0
    for runner, ref in (
        (EchoRunner, lambda p, m: reference(EchoRunner, p, m)),
        (FakeRunner, lambda p, m: reference_output(p, m, LM.vocab_size, EOS)),
    ):
        engine = engine_for(runner, num_speculative_tokens=k)
        results = run(engine, requests)
        plain = run(engine_for(runner), requests)  # the same engine without speculation
        for (prompt, max_new), got, without in zip(requests, results, plain):
            want = ref(prompt, max_new)
            assert got == without == (want, "done", "stop" if want[-1] in EOS else "length")
        check_trace(engine)
        stats = engine.stats()
        accepted += stats["spec_accepted"]
        rejected += stats["spec_drafted"] - stats["spec_accepted"]
        if runner is EchoRunner:
            assert stats["spec_accepted"] > 0 and stats["spec_passes_per_token"] < 1
    assert accepted > 0 and rejected > 0, "both the accepted and the rejected path ran"


def test_all_drafts_rejected_still_gives_the_reference():
    rng = random.Random(2)
    requests = [(echo_prompt(rng), 30) for _ in range(6)]
    engine = engine_for(ContrarianRunner, num_speculative_tokens=4)
    for (prompt, max_new), got in zip(requests, run(engine, requests, check_each_step=True)):
        assert got[0] == reference(ContrarianRunner, prompt, max_new)
    stats = engine.stats()
    assert stats["spec_drafted"] > 50 and stats["spec_accepted"] == 0
    assert stats["spec_tokens_per_verify_row"] == 1.0 and stats["spec_passes_per_token"] == 1.0
    check_trace(engine)


def test_all_drafts_accepted_yields_k_plus_one_tokens_a_pass():
    rng = random.Random(3)
    requests = [(echo_prompt(rng), 33) for _ in range(4)]
    engine = engine_for(PureEchoRunner, num_speculative_tokens=3)
    results = run(engine, requests, check_each_step=True)
    for (prompt, max_new), got in zip(requests, results):
        assert got == (reference(PureEchoRunner, prompt, max_new), "done", "length")
    stats = engine.stats()
    assert stats["spec_drafted"] > 0 and stats["spec_accepted"] == stats["spec_drafted"]
    assert stats["spec_tokens_per_verify_row"] == 4.0  # 3 drafts + the model's own token
    # after its prefill's token, 32 tokens in 8 verify rows of 4
    assert all(len(s.emitted[r]) == 4 for s in engine.trace.steps for r in s.drafts)
    assert stats["spec_passes_per_token"] == 0.25
    assert stats["decode_step_s"] is None, "a step of verify rows is no plain decode step"
    # the trace keeps the drafts through JSON: the metrics read the same from a saved run
    saved = summarize(Trace.from_json(engine.trace.to_json()))
    assert {k: v for k, v in saved.items() if k.startswith("spec")} == {
        k: v for k, v in stats.items() if k.startswith("spec")
    }
    check_trace(engine)


# -- finishing rules inside an accepted run ----------------------------------------------------


def test_eos_inside_an_accepted_run_ends_it_there():
    prompt = [5, 6, 7, LM.eos_id, 8] * 3 + [5]  # the model echoes 6, 7, EOS, ...
    engine = engine_for(PureEchoRunner, num_speculative_tokens=4)
    (got,) = run(engine, [(prompt, 20)])
    assert got == ([6, 7, LM.eos_id], "done", "stop")
    assert got[0] == reference(PureEchoRunner, prompt, 20)
    # the prefill gave 6; one verify row carried 7, EOS, 8, 5 and handed out 7, EOS only
    (verify,) = [s for s in engine.trace.steps if s.drafts]
    assert verify.emitted == {"req-0": [7, LM.eos_id]} and verify.accepted == {"req-0": 2}
    check_trace(engine)


class StopsAfterThirteen(StallFreeScheduler):
    """A kind with a finishing rule of its own (as a learner's may have): 13 ends a request."""

    kind = "stops-after-13"

    def finish_reason(self, req, token):
        return "stop" if token == 13 else super().finish_reason(req, token)


@pytest.mark.parametrize("how", ["stop_token_ids", "the kind's own rule"])
def test_every_finishing_rule_applies_inside_an_accepted_run(how):
    prompt = [11, 12, 9, 13, 14] * 3 + [11]  # the model echoes 12, 9, 13, 14, ...
    kind = StopsAfterThirteen if how != "stop_token_ids" else "stallfree"
    options = dict(max_batch_size=4, token_budget=24, kv_block_size=4, num_speculative_tokens=4)
    engine = make_engine(kind, LM, runner=PureEchoRunner, **options)
    stops = [13] if how == "stop_token_ids" else []
    rid = engine.submit(prompt, max_new_tokens=20, stop_token_ids=stops)
    engine.run_until_idle()
    assert engine.poll(rid) == ([12, 9, 13], "done", "stop")
    (verify,) = [s for s in engine.trace.steps if s.drafts]
    assert verify.drafts == {rid: 4} and verify.emitted == {rid: [9, 13]}
    check_trace(engine)


@pytest.mark.parametrize("max_new", [2, 3, 4, 6, 9])
def test_max_new_tokens_inside_a_run_ends_with_exactly_that_many(max_new):
    prompt = [11, 12, 13, 14, 15] * 4
    engine = engine_for(PureEchoRunner, num_speculative_tokens=5)
    (got,) = run(engine, [(prompt, max_new)])
    assert got == (reference(PureEchoRunner, prompt, max_new), "done", "length")
    assert len(got[0]) == max_new
    # never a draft past the limit: a verify row carries at most tokens_left - 1 drafts
    made = 0
    for step in engine.trace.steps:
        assert made + step.drafts.get("req-0", 0) + 1 <= max_new
        made += len(step.emitted.get("req-0", []))
    assert max(len(t) for s in engine.trace.steps for t in s.emitted.values()) == min(max_new - 1, 6)
    check_trace(engine)


def test_a_request_near_max_seq_len_stops_at_it_and_never_writes_past_it():
    prompt = [21, 22, 23, 24, 25] * 6  # 30 tokens
    engine = engine_for(PureEchoRunner, num_speculative_tokens=5, max_seq_len=37)
    (got,) = run(engine, [(prompt, 100)])
    assert got == (reference(PureEchoRunner, prompt, 7), "done", "length")
    assert max(c.end for chunks in engine.runner.passes for c in chunks) <= 37
    check_trace(engine)


# -- KV memory: block boundaries, rewind, preemption, the prefix cache ------------------------


def test_drafts_across_kv_block_boundaries_and_rewinds_that_free_blocks():
    rng = random.Random(7)
    requests = [(echo_prompt(rng), 40) for _ in range(8)]
    engine = engine_for(EchoRunner, num_speculative_tokens=5, kv_block_size=4)
    freed = 0
    real_truncate = engine.scheduler.blocks.truncate

    def truncate(req_id, num_tokens):
        nonlocal freed
        before = len(engine.scheduler.blocks.tables[req_id])
        real_truncate(req_id, num_tokens)
        freed += before - len(engine.scheduler.blocks.tables[req_id])

    engine.scheduler.blocks.truncate = truncate
    for (prompt, max_new), got in zip(requests, run(engine, requests, check_each_step=True)):
        assert got[0] == reference(EchoRunner, prompt, max_new)
    verify = [c for chunks in engine.runner.passes for c in chunks if c.num_drafts]
    assert any(c.start // 4 != (c.end - 1) // 4 for c in verify), "a verify row spans a block boundary"
    assert freed > 0, "a rewind gave back a block that held only rejected drafts"
    check_trace(engine)


def test_a_preemption_in_the_middle_of_speculation_loses_nothing():
    rng = random.Random(11)
    requests = [(echo_prompt(rng, reps=(2, 5)), rng.randint(20, 40)) for _ in range(12)]
    engine = engine_for(EchoRunner, num_speculative_tokens=3, max_batch_size=6, num_kv_blocks=22)
    results = run(engine, requests, check_each_step=True, ignore_eos=True)
    for (prompt, max_new), got in zip(requests, results):
        assert got == (reference(EchoRunner, prompt, max_new, eos=frozenset()), "done", "length")
    stats = engine.stats()
    assert stats["preemptions"] > 0, "22 blocks of 4 for 6 slots must preempt"
    # some request was preempted after drafts of its own had been accepted
    steps = list(engine.trace.steps)
    assert any(
        rid in s.preempted and any(t.accepted.get(rid) for t in steps[: s.index])
        for s in steps
        for rid in s.preempted
    )
    # a preempted request prefilled again exactly its prompt and the tokens it had been handed
    for s in steps:
        for rid in s.preempted:
            made = sum(len(t.emitted.get(rid, [])) for t in steps[: s.index + 1])
            refill = [p[2] for t in steps[s.index + 1 :] for p in t.prefill if p[0] == rid]
            prompt_len = engine.trace.requests[rid].prompt_len
            assert sum(refill) >= prompt_len + made  # (it may be preempted again meanwhile)
    check_trace(engine)


def test_the_prefix_cache_keeps_only_verified_tokens():
    rng = random.Random(13)
    requests = [(echo_prompt(rng), 30) for _ in range(6)]
    engine = engine_for(EchoRunner, num_speculative_tokens=4, enable_prefix_cache=True)
    first = run(engine, requests, check_each_step=True)
    # the same prompts again share the cached blocks, and read the right tokens from them
    again = run(engine, requests, check_each_step=True)
    for (prompt, max_new), a, b in zip(requests, first, again):
        assert a == b and a[0] == reference(EchoRunner, prompt, max_new)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["spec_accepted"] > 0
    assert stats["spec_accepted"] < stats["spec_drafted"]
    check_blocks(engine.scheduler.blocks)
    check_trace(engine)  # free or cached: all of them in num_free


# -- the budget -------------------------------------------------------------------------------


def test_drafts_are_paid_from_the_budget_before_prefills():
    engine = engine_for(PureEchoRunner, num_speculative_tokens=3, max_batch_size=2, token_budget=8)
    a = engine.submit([31, 32, 33, 34, 35] * 3, max_new_tokens=40)
    engine.step()  # a's prefill (15 tokens in chunks of 8): 2 steps
    engine.step()
    engine.submit(list(range(1, 61)), max_new_tokens=2)  # 60 prompt tokens to prefill
    engine.run_until_idle()
    both = [s for s in engine.trace.steps if s.drafts and s.prefill]
    assert any(s.drafts[a] == 3 for s in both), "a step verified 3 drafts beside a prefill chunk"
    for s in both:  # the chunk took what the decode row and its drafts left (or ended its prompt)
        (rid, start, n) = s.prefill[0]
        assert n == 8 - 1 - s.drafts[a] or start + n == 60
    check_trace(engine)


def test_drafts_take_only_free_blocks_and_never_preempt():
    """Two requests on a pool that cannot hold both: growth preempts, drafts never do (they
    are cut to the blocks the pool has free), and the answers stay right."""
    prompts = [[41, 42, 43, 44, 45] * 2, [46, 47, 48, 49, 50] * 2]  # 10 tokens + 30 new: 10 blocks
    engine = engine_for(PureEchoRunner, num_speculative_tokens=5, max_batch_size=2, num_kv_blocks=13)
    sched, cut = engine.scheduler, 0
    real = sched.fit_drafts

    def fit_drafts(batch):  # after growth: the drafts' blocks
        nonlocal cut
        before, free = sched.num_preemptions, sched.blocks.num_free
        for r in batch.decode:  # what prompt lookup proposed (the budget, 24, never cuts here)
            left = r.max_new_tokens - len(r.output_ids) - 1
            assert batch.drafts.get(r.id, []) == propose_ngram(
                r.token_ids(0, r.prompt_len + len(r.output_ids)), min(5, left)
            )
        wanted = {rid: len(d) for rid, d in batch.drafts.items()}
        out = real(batch)
        assert sched.num_preemptions == before, "a draft preempted somebody"
        taken = free - sched.blocks.num_free
        assert 0 <= taken <= free
        cut += sum(len(out.drafts.get(rid, [])) < n for rid, n in wanted.items())
        return out

    sched.fit_drafts = fit_drafts
    results = run(engine, [(p, 30) for p in prompts], check_each_step=True)
    for prompt, got in zip(prompts, results):
        assert got == (reference(PureEchoRunner, prompt, 30), "done", "length")
    assert cut > 0, "some drafts were cut to the free blocks"
    assert engine.stats()["preemptions"] > 0, "13 blocks for two requests of 10: growth preempts"
    check_trace(engine)


def test_an_empty_draft_list_or_a_banned_row_is_no_verify_row_and_keeps_no_extra_block():
    """A planner may store ``[]`` for a row prompt lookup found nothing for, and a row whose stop
    tokens are still banned carries no drafts whatever the planner gave it: neither is counted
    as a verify row (the trace and the totals say 0 drafts), and blocks taken for dropped
    drafts go back before the pass."""
    engine = engine_for(FakeRunner, num_speculative_tokens=3, max_batch_size=2)
    sched, real, real_prepare = engine.scheduler, engine.scheduler.drafts, engine.scheduler.prepare
    given, spare = {"empty": 0, "banned": 0}, []

    def drafts(decode, budget):
        out = {r.id: real(decode, budget).get(r.id, []) for r in decode}  # every row, some empty
        given["empty"] += sum(not d for d in out.values())
        for r in decode:  # a banned row gets three drafts anyway, with their blocks
            if r.sampler.banned:
                out[r.id] = [1, 2, 3]
                sched.blocks.ensure(r.id, r.num_computed + 4)
        return out

    def prepare(batch):
        given["banned"] += sum(bool(r.sampler.banned) and r.id in batch.drafts for r in batch.decode)
        chunks = real_prepare(batch)
        for r in batch.decode:  # blocks held past this pass's last position, in whole blocks
            end = r.num_computed + 1 + len(batch.drafts.get(r.id, []))
            spare.append(len(sched.blocks.tables[r.id]) - sched.blocks.blocks_for(end))
        return chunks

    sched.drafts, sched.prepare = drafts, prepare
    prompts = [[2, 3, 5, 7, 11, 13, 17], [19, 23, 29, 31, 37, 41, 43]]
    ids = [
        engine.submit(prompts[0], max_new_tokens=30),
        engine.submit(prompts[1], max_new_tokens=30, min_new_tokens=20),
    ]
    while engine.step():
        pass
    engine.raise_if_failing()
    for rid, prompt in zip(ids, prompts):
        assert engine.poll(rid)[0] == reference(FakeRunner, prompt, 30)
    assert given["empty"] and given["banned"], f"the run must offer both kinds of row: {given}"
    steps = engine.trace.steps
    assert all(n > 0 for s in steps for n in s.drafts.values()), (
        "a row without drafts was recorded as a verify row"
    )
    assert engine.stats()["spec_drafted"] == sum(sum(s.drafts.values()) for s in steps)
    made = 0
    for s in steps:  # the second request's stop tokens are banned until it has 20 tokens
        assert ids[1] not in s.drafts or made >= 20, f"step {s.index}: drafts verified at token {made}"
        made += len(s.emitted.get(ids[1], []))
    assert not any(spare), f"blocks taken for dropped drafts were kept: {spare}"
    check_trace(engine)


# -- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, says",
    [
        ({"num_speculative_tokens": -1}, "num_speculative_tokens must be an integer >= 0"),
        ({"num_speculative_tokens": 1.5}, "num_speculative_tokens must be an integer >= 0"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer >= 0"),
        ({"num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer >= 0"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
        ({"prompt_lookup_max": 0}, "prompt_lookup_max must be an integer >= 1"),
        ({"prompt_lookup_max": 2.0}, "prompt_lookup_max must be an integer >= 1"),
        (
            {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
            r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)",
        ),
    ],
)
def test_bad_option_values_are_refused(options, says):
    with pytest.raises(ValueError, match=says):
        engine_for(FakeRunner, **options)


@pytest.mark.parametrize("kind", ["sequential", "static", "continuous"])
def test_a_kind_without_speculation_refuses_the_option(kind):
    with pytest.raises(ValueError, match=f"num_speculative_tokens does not apply to the {kind} engine"):
        make_engine(kind, LM, runner=FakeRunner, num_speculative_tokens=3)


def test_make_engine_takes_the_option_by_name():
    engine = make_engine("stallfree", LM, num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    s = engine.scheduler
    assert (s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == (3, 2, 3)


# -- sampled requests ---------------------------------------------------------------------------


class SoftEchoRunner(FakeRunner):
    """Logits that leave a real choice: a seeded spread over the vocabulary (by a hash of the
    sequence), the token ``PERIOD`` back well ahead, EOS close behind it."""

    def logits_row(self, seq):
        return self.soft(seq)

    @staticmethod
    def soft(seq):
        logits = np.random.default_rng(sequence_hash(seq)).normal(0, 1, LM.vocab_size)
        if len(seq) >= PERIOD:
            logits[seq[-PERIOD]] += 4.0
        logits[LM.eos_id] += 2.5
        return logits


def test_sampled_rows_same_seed_same_output_and_banned_ids_honoured():
    rng = random.Random(17)
    prompts = [echo_prompt(rng) for _ in range(6)]
    min_new = 12

    def sampled_run():
        engine = engine_for(SoftEchoRunner, num_speculative_tokens=3)
        ids = [
            engine.submit(p, max_new_tokens=30, temperature=1.0, seed=i, min_new_tokens=min_new)
            for i, p in enumerate(prompts)
        ]
        engine.run_until_idle()
        return engine, [engine.poll(i) for i in ids]

    engine, first = sampled_run()
    _, second = sampled_run()
    assert first == second, "a seeded request samples the same tokens every time"
    for tokens, status, reason in first:
        assert LM.eos_id not in tokens[:min_new], "no stop token before min_new_tokens"
        assert status == "done" and (reason == "stop") == (tokens[-1] == LM.eos_id)
    stats = engine.stats()
    assert stats["spec_accepted"] > 0 and stats["spec_accepted"] < stats["spec_drafted"]
    assert any(tokens[-1] == LM.eos_id for tokens, _, _ in first), "some request sampled EOS"
    # no drafts while a request's stop tokens are banned
    made = Counter()
    for step in engine.trace.steps:
        for rid in step.decoded:
            if rid in step.drafts:
                assert made[rid] >= min_new, f"{rid} drafted before min_new_tokens"
        for rid, tokens in step.emitted.items():
            made[rid] += len(tokens)
    check_trace(engine)


NEW = 4  # tokens each sampled request makes: the prefill's, then verify rows of up to 2 drafts


def sampled_joint(accept=None, n=3000):
    """The ``NEW`` tokens of ``n`` seeded sampled requests (top-k 3, EOS ignored) on one
    echo-heavy prompt, with 2 speculative tokens: a Counter of token tuples. ``accept``
    replaces the scheduler's acceptance rule (a wrong one, to see the check fail)."""
    engine = engine_for(SoftEchoRunner, num_speculative_tokens=2, max_batch_size=16, token_budget=64)
    if accept is not None:
        engine.scheduler.accept = accept
    prompt = [3, 9, 4, 7, 5] * 3
    ids = [
        engine.submit(prompt, max_new_tokens=NEW, temperature=1.0, top_k=3, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    engine.run_until_idle()
    stats = engine.stats()
    assert stats["spec_drafted"] > n, "most requests verified drafts"
    if accept is None:
        assert 0 < stats["spec_accepted"] < stats["spec_drafted"], "drafts accepted and rejected"
    return prompt, Counter(tuple(engine.poll(i)[0]) for i in ids)


def exact_joint(prompt, depth=NEW) -> dict[tuple, float]:
    """P(t0, ..., t_depth-1) straight from the model's logits (top-k 3, temperature 1), no engine."""
    if depth == 0:
        return {(): 1.0}
    logits = SoftEchoRunner.soft(prompt)
    best = np.argsort(-logits)[:3]
    p = np.exp(logits[best] - logits[best].max())
    return {
        (int(t), *rest): pt * q
        for t, pt in zip(best, p / p.sum())
        for rest, q in exact_joint(prompt + [int(t)], depth - 1).items()
    }


def test_sampled_rows_keep_the_models_distribution_through_the_engine():
    """Sampled requests with speculation emit their tokens with exactly the model's joint
    distribution (a chi-square test against probabilities computed from the logits alone);
    an engine that keeps every draft fails the same test."""
    prompt, counts = sampled_joint()
    stat, critical = chi_square_p001(counts, exact_joint(prompt))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"

    def keep_every_draft(req, drafts, picks):
        return [*drafts, picks[-1]]

    def bonus_from_the_end(req, drafts, picks):  # the model's token always from the last position
        kept = accept_sampled(drafts, picks)
        return [*kept[:-1], picks[-1]]

    for wrong in (keep_every_draft, bonus_from_the_end):
        prompt, counts = sampled_joint(accept=wrong, n=1000)
        stat, critical = chi_square_p001(counts, exact_joint(prompt))
        assert stat > critical, f"the check cannot tell {wrong.__name__} is wrong"


# -- the cost model and the simulator -----------------------------------------------------------


def test_a_verify_row_is_priced_as_a_prefill_chunk_of_one_plus_k_tokens():
    from batchlab.core.costmodel import CostModel, pass_features
    from batchlab.core.runner import Chunk

    verify = Chunk("v", [7, 1, 2, 3], 100, num_drafts=3)
    assert (pass_features([verify]) == pass_features([Chunk("p", [7, 1, 2, 3], 100)])).all()
    cost = CostModel.load()
    row = Chunk("d", [7], 100)
    assert cost.predict([row]) < cost.predict([verify])


def test_the_simulator_runs_speculation_on_its_cost_model():
    from batchlab.measurement.simulator import make_sim_engine

    engine = make_sim_engine("stallfree", max_batch_size=4, token_budget=32, num_speculative_tokens=3)
    ids = [engine.submit([1, 2, 3] * 10, max_new_tokens=20, ignore_eos=True) for _ in range(4)]
    engine.run_until_idle()
    assert all(engine.poll(i)[1:] == ("done", "length") for i in ids)
    stats = engine.stats()
    assert stats["spec_drafted"] > 0 and engine.clock() > 0
    check_trace(engine)


# -- the real model (slow) ---------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_echo_prompt_same_answer_with_and_without_speculation(lm):
    """The course's model asked to repeat a list: greedy answers with 4 speculative tokens and
    without are the same (up to a near-tie), drafts are accepted, and fewer steps run."""
    from near_tie import near_tie_for, parting_problem

    words = "apple, river, candle, mountain, violin, pepper, window, comet, garden, ladder, ocean, pencil"
    prompt = lm.tokenizer.encode_chat([{"role": "user", "content": f"Repeat this list exactly: {words}"}])
    n = 48
    answers, stats = {}, {}
    for k in (0, 4):
        engine = make_engine("stallfree", lm, max_batch_size=2, token_budget=32, num_speculative_tokens=k)
        rid = engine.submit(prompt, max_new_tokens=n)
        engine.run_until_idle()
        answers[k], stats[k] = engine.poll(rid), engine.stats()
    print(
        repr(lm.tokenizer.decode(answers[4][0])), {k: v for k, v in stats[4].items() if k.startswith("spec")}
    )
    for k in (0, 4):
        tokens, status, reason = answers[k]
        assert status == "done" and (reason == "stop") == (tokens[-1] in lm.tokenizer.eos_token_ids)
        if tokens != answers[0][0]:  # only a near-tie may part them from the reference
            wrong = parting_problem(lm, prompt, tokens, n, near_tie_for(lm))
            assert wrong is None, f"k={k}: {wrong}"
    assert stats[4]["spec_acceptance_rate"] > 0 and stats[4]["steps"] < stats[0]["steps"]
