"""Structured output (per-row token masks) in the engine, checked by references no engine code
computes: Python's ``re`` for regexes, membership for choices, ``json`` and ``jsonschema`` for
schemas, and ``fake.greedy_output`` for unconstrained rows.

The fake model here is ``AdversarialRunner`` over the course model's real tokenizer (token
strings are what a mask is about): its favourite token is random and almost never one a
pattern allows, and EOS is its favourite of all, so an answer that matches does so only
because every mask held, and it ends as soon as its mask lets it. One test runs the real
model (slow).
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from batchlab import make_engine
from batchlab.core.fake import AdversarialRunner, FakeModel, FakeRunner, greedy_output
from batchlab.core.scheduler import KINDS
from batchlab.core.engine import Engine
from batchlab.core.structured import Constraint, StructuredOutputs, compile_constraint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SPECS = [
    dict(regex=r"[0-9]{3}-[0-9]{4}"),
    dict(choice=["yes", "no", "it depends"]),
    dict(json=PERSON),
    dict(json_object=True),
    dict(regex=r"(cat|dog)s? (sat|ran)( quickly)?\."),
]


@pytest.fixture(scope="module")
def text():
    from batchlab.model.load import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def fake(text):
    return FakeModel(text=text)


def answer_text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t not in tok.eos_token_ids])


def violation(spec: dict, answer: str) -> str | None:
    """Why ``answer`` does not match ``spec`` (independent of the engine and of llguidance)."""
    if "regex" in spec:
        return None if re.fullmatch(spec["regex"], answer) else f"{answer!r} does not match {spec['regex']!r}"
    if "choice" in spec:
        return None if answer in spec["choice"] else f"{answer!r} is none of {spec['choice']}"
    try:
        value = json.loads(answer)
    except ValueError as e:
        return f"{answer!r} is not JSON: {e}"
    if "json_object" in spec:
        return None if isinstance(value, dict) else f"{answer!r} is not a JSON object"
    try:
        jsonschema.validate(value, spec["json"])
    except jsonschema.ValidationError as e:
        return f"{answer!r} breaks the schema: {e.message}"
    return None


def run(lm, kind, requests, runner=AdversarialRunner, **options):
    """Submit ``requests`` (prompt, params) to one engine, run it; each request's (tokens, reason)."""
    engine = make_engine(kind, lm, runner=runner, **options)
    ids = [engine.submit(prompt, **params) for prompt, params in requests]
    engine.run_until_idle()
    return engine, [
        (engine.trace.requests[i].output_ids, engine.trace.requests[i].finish_reason) for i in ids
    ]


def prompts(text, n):
    return [text.encode(f"Question {i}: answer please.") for i in range(n)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_constrained_answer_matches_in_a_mixed_batch_and_free_rows_are_untouched(fake, text, kind):
    """Constrained rows of every spec next to unconstrained ones in the same passes: every
    complete answer matches its pattern; the unconstrained rows make exactly what they make
    alone; every constrained answer ended at EOS, since the model prefers it wherever allowed."""
    options = {"max_batch_size": 8} if kind != "sequential" else {}
    ps = prompts(text, 10)
    requests = [(ps[i], dict(max_new_tokens=40, structured_outputs=SPECS[i % len(SPECS)])) for i in range(5)]
    requests += [(ps[i], dict(max_new_tokens=12, ignore_eos=True)) for i in range(5, 10)]
    _, results = run(fake, kind, requests, **options)
    for (prompt, params), (tokens, reason) in zip(requests, results):
        spec = params.get("structured_outputs")
        if spec is None:
            assert tokens == greedy_output(AdversarialRunner, prompt, 12, frozenset(), fake), (
                "a free row changed"
            )
            continue
        assert reason == "stop" and tokens[-1] in text.eos_token_ids, (
            spec,
            reason,
            answer_text(text, tokens),
        )
        assert violation(spec, answer_text(text, tokens)) is None


def test_sampled_constrained_rows_match_too_and_follow_their_seed(fake, text):
    ps = prompts(text, len(SPECS))
    requests = [
        (p, dict(max_new_tokens=48, temperature=1.0, top_p=0.95, seed=7, structured_outputs=s))
        for p, s in zip(ps, SPECS)
    ]
    _, first = run(fake, "stallfree", requests, max_batch_size=8)
    _, again = run(fake, "stallfree", requests[::-1], max_batch_size=3)
    assert first == again[::-1], "a sampled constrained answer depends on its batch"
    for (_, params), (tokens, reason) in zip(requests, first):
        if reason == "stop":
            assert violation(params["structured_outputs"], answer_text(text, tokens)) is None


def test_an_answer_cut_by_max_new_tokens_ends_with_length_and_is_a_prefix(fake, text):
    """The JSON answer cannot close in 6 tokens: it ends "length", and what it said is where a
    valid answer could begin (the constraint still accepts it: no mask was skipped)."""
    spec = dict(json=PERSON)
    ((tokens, reason),) = run(
        fake, "stallfree", [(prompts(text, 1)[0], dict(max_new_tokens=6, structured_outputs=spec))]
    )[1]
    assert reason == "length" and len(tokens) == 6
    check = compile_constraint(StructuredOutputs(**spec), text)
    for t in tokens:  # raises if a token left the pattern
        assert check.allowed()[t]
        check.advance(t)


def test_constrained_rows_carry_no_drafts_and_free_rows_still_speculate(fake, text):
    ps = prompts(text, 4)
    requests = [
        (ps[0], dict(max_new_tokens=40, structured_outputs=SPECS[0])),
        (ps[1], dict(max_new_tokens=40, structured_outputs=SPECS[2])),
    ]
    echo = ps[2] * 4  # a repeating prompt: prompt lookup finds drafts for the free row
    requests.append((echo, dict(max_new_tokens=16, ignore_eos=True)))
    engine, results = run(fake, "stallfree", requests, max_batch_size=4, num_speculative_tokens=3)
    constrained = {rid for rid, r in engine.trace.requests.items() if rid in ("req-0", "req-1")}
    drafted = {rid for s in engine.trace.steps for rid in s.drafts}
    assert not drafted & constrained, "a constrained row carried drafts"
    for (_, params), (tokens, reason) in zip(requests[:2], results[:2]):
        assert reason == "stop" and violation(params["structured_outputs"], answer_text(text, tokens)) is None
    assert results[2][0] == greedy_output(AdversarialRunner, echo, 16, frozenset(), fake)


def test_a_preempted_constrained_request_gives_the_same_answer(fake, text):
    """A pool so small that requests are preempted and recompute: the constraint's state is
    the request's, kept across it, and the answers are those of a roomy pool."""
    ps = prompts(text, 6)
    requests = [
        (p, dict(max_new_tokens=30, structured_outputs=SPECS[2 if i % 2 else 4])) for i, p in enumerate(ps)
    ]
    roomy, want = run(fake, "stallfree", requests, max_batch_size=6)
    tight, got = run(fake, "stallfree", requests, max_batch_size=6, kv_block_size=4, num_kv_blocks=12)
    assert sum(len(s.preempted) for s in tight.trace.steps) > 0, (
        "nothing was preempted: the case proves nothing"
    )
    assert got == want


def test_min_new_tokens_cannot_push_a_complete_answer_past_its_end(fake, text):
    """Banned stop tokens and a complete answer whose only next token is EOS: the mask wins
    (greedy and sampled: with nothing left to draw from, a sampler has no distribution)."""
    p = prompts(text, 1)[0]
    for sampling in (dict(), dict(temperature=1.0, seed=3)):
        spec = dict(choice=["no"])
        ((tokens, reason),) = run(
            fake,
            "stallfree",
            [(p, dict(max_new_tokens=20, min_new_tokens=10, structured_outputs=spec, **sampling))],
        )[1]
        assert answer_text(text, tokens) == "no" and reason == "stop", sampling


def test_masks_are_timed_in_the_trace(fake, text):
    engine, _ = run(
        fake, "stallfree", [(prompts(text, 1)[0], dict(max_new_tokens=20, structured_outputs=SPECS[2]))]
    )
    assert sum(s.mask_s for s in engine.trace.steps) > 0


def test_masks_filled_during_the_pass_give_the_same_answers_from_a_second_thread(fake, text):
    """``masks_during_pass``: the masks are filled beside the forward pass, in another thread,
    and every row still samples with its own step's mask (the same answers as before the pass)."""
    threads = []

    class During(Engine):
        masks_during_pass = True

        def constrain(self, batch, chunks):
            threads.append(threading.current_thread().name)
            super().constrain(batch, chunks)

    requests = [(p, dict(max_new_tokens=40, structured_outputs=s)) for p, s in zip(prompts(text, 5), SPECS)]
    _, before = run(fake, "stallfree", requests, max_batch_size=4)
    _, during = run(fake, "stallfree", requests, max_batch_size=4, engine_class=During)
    assert during == before
    assert threads and all(t.startswith("beside-the-pass") for t in threads), set(threads)


def test_an_engine_may_compile_its_own_constraints(fake, text):
    """``EngineBase.compile`` is where a request's constraint is made (lesson 12 makes its own):
    an engine whose constraint allows only digits gets digits, until max_new_tokens."""
    digits = np.array([t.isdigit() for t in (text.decode([i]) for i in range(text.vocab_size))])

    class OnlyDigits(Constraint):
        def allowed(self):
            return digits

        def advance(self, token):
            assert digits[token]

    class Mine(Engine):
        def compile(self, spec):
            return OnlyDigits()

    ((tokens, reason),) = run(
        fake,
        "stallfree",
        [(prompts(text, 1)[0], dict(max_new_tokens=8, structured_outputs=SPECS[1]))],
        engine_class=Mine,
    )[1]
    assert reason == "length" and answer_text(text, tokens).isdigit()


@pytest.mark.parametrize(
    "fields, says",
    [
        (dict(), "exactly one of"),
        (dict(regex="a", choice=["a"]), "exactly one of"),
        (dict(choice=[]), "at least one"),
        (dict(choice="yes"), "list of non-empty strings"),
        (dict(choice=["a", ""]), "list of non-empty strings"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json=[1, 2]), "JSON object"),
        (dict(regex=""), "non-empty string"),
        (dict(json_object="yes"), "true or false"),
    ],
)
def test_bad_specs_are_refused_with_a_reason(fields, says):
    with pytest.raises(ValueError, match=says):
        StructuredOutputs(**fields)


@pytest.mark.parametrize(
    "spec, says",
    [
        (dict(regex="(unclosed"), "regex cannot be compiled"),
        (dict(json={"type": "nonsense"}), "json cannot be compiled: .*nonsense"),
        (
            dict(json={"type": "object", "properties": {"a": {"$ref": "#/missing"}}}),
            "json cannot be compiled",
        ),
    ],
)
def test_a_pattern_the_library_cannot_compile_is_refused_at_submit_and_nothing_changes(
    fake, text, spec, says
):
    engine = make_engine("stallfree", fake, runner=AdversarialRunner)
    with pytest.raises(ValueError, match=says):
        engine.submit(prompts(text, 1)[0], structured_outputs=spec)
    assert engine.stats()["requests"] == 0 if "requests" in engine.stats() else not engine.trace.requests


def test_other_bad_combinations_are_refused(fake, text):
    engine = make_engine("stallfree", fake, runner=AdversarialRunner)
    p = prompts(text, 1)[0]
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.submit(p, ignore_eos=True, structured_outputs=SPECS[0])
    with pytest.raises(ValueError, match="unknown: grammar"):
        engine.submit(p, structured_outputs={"grammar": "start: x"})
    with pytest.raises(ValueError, match="StructuredOutputs or a dict"):
        engine.submit(p, structured_outputs="[0-9]+")
    fake = make_engine("stallfree", FakeModel(), runner=FakeRunner)
    with pytest.raises(ValueError, match="token strings"):
        fake.submit([1, 2, 3], structured_outputs=SPECS[0])


def test_a_mask_that_breaks_fails_only_its_own_request(fake, text):
    """A constraint whose matcher errors mid-run: its pass's requests end with "error"; a
    request in a later pass is served."""
    engine = make_engine("stallfree", fake, runner=AdversarialRunner, max_batch_size=1)
    bad = engine.submit(prompts(text, 1)[0], max_new_tokens=10, structured_outputs=SPECS[0])
    engine._requests[bad].constraint.allowed = lambda: (_ for _ in ()).throw(RuntimeError("broken matcher"))
    good = engine.submit(prompts(text, 2)[1], max_new_tokens=10, structured_outputs=SPECS[1])
    engine.run_until_idle()
    assert engine.trace.requests[bad].finish_reason == "error"
    assert engine.trace.requests[good].finish_reason == "stop"


@pytest.mark.slow
def test_real_model_answers_match_their_patterns_and_free_rows_are_untouched(lm):
    """The course's model: constrained JSON, regex and choice answers next to a free greedy row
    in one stall-free engine. Every answer that ends at EOS matches (by ``re``, membership and
    ``jsonschema``); the free row's answer is mlx-lm's for that prompt alone, up to a near-tie."""
    from near_tie import near_tie_for, parting_problem

    tok = lm.tokenizer
    questions = (
        "Describe a person as JSON.",
        "Give me a phone number.",
        "Is the sky blue? Yes or no?",
        "Tell me a story.",
    )
    ask = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    specs = [dict(json=PERSON), dict(regex=r"[0-9]{3}-[0-9]{4}"), dict(choice=["yes", "no"]), None]
    n = 40
    engine = make_engine("stallfree", lm, max_batch_size=4)
    ids = [engine.submit(p, max_new_tokens=n, structured_outputs=s) for p, s in zip(ask, specs)]
    engine.run_until_idle()
    for rid, spec, prompt in zip(ids, specs, ask):
        rec = engine.trace.requests[rid]
        print(rec.finish_reason, repr(answer_text(tok, rec.output_ids)))
        if spec is None:
            assert parting_problem(lm, prompt, rec.output_ids, n, near_tie_for(lm)) is None
        elif rec.finish_reason == "stop":
            assert violation(spec, answer_text(tok, rec.output_ids)) is None
        else:
            assert rec.finish_reason == "length" and len(rec.output_ids) == n
    assert [engine.trace.requests[i].finish_reason for i in ids[1:3]] == ["stop", "stop"]


def test_the_grammar_library_benchmark_runs_and_times_llguidance(capsys):
    """``benchmarks/grammar_libraries.py`` (the measurement behind the choice of llguidance)
    runs here with llguidance alone; the others are optional installs it leaves out."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "grammar_libraries.py"
    spec = importlib.util.spec_from_file_location("grammar_libraries", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.REPS = 1
    rows = bench.main([])
    mine = [r for r in rows if r[0] == "llguidance"]
    assert [r[1] for r in mine] == list(bench.CASES) and all(t > 0 for r in mine for t in r[2:])
    assert "| llguidance | json schema |" in capsys.readouterr().out


def test_an_engine_without_lesson_12s_methods_refuses_a_constraint_and_serves_the_rest(fake, text):
    """A learner's engine from lesson 6 inherits ``EngineBase``'s ``compile`` and ``constrain``:
    a constrained request is a ValueError saying so; a plain one is served."""
    from batchlab.core.engine import EngineBase

    class Lesson6(Engine):
        compile, constrain = EngineBase.compile, EngineBase.constrain

    engine = make_engine("stallfree", fake, runner=AdversarialRunner, engine_class=Lesson6)
    with pytest.raises(ValueError, match="does not do structured output"):
        engine.submit(prompts(text, 1)[0], structured_outputs=SPECS[0])
    rid = engine.submit(prompts(text, 1)[0], max_new_tokens=3, ignore_eos=True)
    engine.run_until_idle()
    assert len(engine.trace.requests[rid].output_ids) == 3
