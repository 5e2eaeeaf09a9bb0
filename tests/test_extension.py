"""The public extension point: a scheduler class of your own plugs into the real engine.

The README's example is executed from the README itself, so the documentation cannot
drift from what works.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from batchlab import generate, make_engine
from batchlab.core.fake import FakeModel, FakeRunner, reference_output
from batchlab.core.scheduler import ContinuousScheduler, OnDemandKV, Scheduler, StopRules

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPTS = {"long": list(range(1, 41)), "short": [3, 4, 5], "mid": list(range(7, 22)), "tiny": [9, 8]}


def readme_example(drop_engine_line: bool) -> tuple[str, dict]:
    """The code block under "Write your own scheduler", and the namespace it defines."""
    text = README.read_text()
    section = text[text.index("### Write your own scheduler") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    if drop_engine_line:  # everything but the final `engine = make_engine(...)` line
        tree = ast.parse(code)
        assert isinstance(tree.body[-1], ast.Assign), "the example should end by making an engine"
        code = "\n".join(code.splitlines()[: tree.body[-1].lineno - 1])
    return code, {}


def first_prefill_order(engine) -> list[str]:
    seen = []
    for step in engine.trace.steps:
        for rid, start, _ in step.prefill:
            if start == 0 and rid not in seen:
                seen.append(rid)
    return seen


def run_all(engine, max_new_tokens=5) -> dict[str, list[int]]:
    for rid, prompt in PROMPTS.items():
        engine.submit(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, request_id=rid)
    engine.run_until_idle()
    return {rid: list(engine.trace.requests[rid].output_ids) for rid in PROMPTS}


def test_readme_scheduler_on_the_fake_model():
    code, ns = readme_example(drop_engine_line=True)
    exec(code, ns)
    cls = ns["ShortestPromptFirst"]
    engine = make_engine(cls, FakeModel(), runner=FakeRunner, max_batch_size=4, prefill_step=64)
    outputs = run_all(engine)
    for rid, prompt in PROMPTS.items():
        assert outputs[rid] == reference_output(prompt, 5, 64, frozenset()), rid
    assert engine.trace.kind == "shortest-first"
    assert engine.trace.prefill_lane  # inherited from the continuous scheduler
    # The new rule is really in charge: shortest first, unlike the reference's arrival order.
    assert first_prefill_order(engine) == sorted(PROMPTS, key=lambda r: len(PROMPTS[r]))
    reference = make_engine("continuous", FakeModel(), runner=FakeRunner, max_batch_size=4, prefill_step=64)
    run_all(reference)
    assert first_prefill_order(reference) == list(PROMPTS)
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks


@pytest.mark.slow
def test_readme_scheduler_on_the_real_model(lm):
    code, ns = readme_example(drop_engine_line=False)
    ns["lm"] = lm
    exec(code, ns)
    engine = ns["engine"]
    outputs = run_all(engine, max_new_tokens=6)
    for rid, prompt in PROMPTS.items():  # the sequential baseline, with mlx-lm's own KV cache
        assert outputs[rid] == generate(lm, prompt, 6, ignore_eos=True).token_ids, rid
    assert first_prefill_order(engine)[0] == "tiny"


class Threshold(StopRules, OnDemandKV, Scheduler):
    """A minimal scheduler of its own on the base and the on-demand KV mixin: prefill whole
    prompts one at a time, decode everyone together, but admit only prompts up to
    ``max_prompt`` tokens long at once."""

    kind = "threshold"

    def __init__(self, blocks, clock, max_batch_size: int = 2, max_prompt: int = 16):
        super().__init__(blocks, clock, max_batch_size)
        self.max_prompt = max_prompt

    def fits(self, req, max_tokens):  # its whole prompt, and a block for each decoding row
        decoding = sum(r.slot is not None for r in self.running)
        return self.blocks.blocks_for(req.prefill_len) + decoding <= self.blocks.num_free

    def grow(self, batch):  # its planning took every row's blocks (make_room) already
        return batch

    def batches(self):
        if self.queue and self.free_slot() is not None:
            req = self.queue[0]
            if req.prompt_len <= self.max_prompt and self.fits(req, req.prefill_len):
                self.take_slot(req)
                n = self.start(req, req.prefill_len)
                yield from self.one_pass(prefill=[(req, n)])
        rows = [r for r in self.slots if r is not None and r.prefill_left == 0 and not r.finished]
        for r in rows:
            self.make_room(r, 1)
        rows = [r for r in rows if r.slot is not None]
        if rows:
            yield from self.one_pass(decode=rows)

    def one_pass(self, **work):
        from batchlab.core.scheduler import Batch

        yield Batch(**work)


def test_options_come_from_the_constructor():
    assert Threshold.option_defaults() == {"max_batch_size": 2, "max_prompt": 16}
    engine = make_engine(Threshold, FakeModel(), runner=FakeRunner, max_prompt=8)
    ok = engine.submit([1, 2, 3], max_new_tokens=4, ignore_eos=True)
    engine.run_until_idle()
    assert engine.poll(ok) == (reference_output([1, 2, 3], 4, 64, frozenset()), "done", "length")
    with pytest.raises(ValueError, match="prefill_step does not apply to the threshold engine"):
        make_engine(Threshold, FakeModel(), runner=FakeRunner, prefill_step=4)
    with pytest.raises(ValueError, match="unknown engine kind"):
        make_engine("thresh", FakeModel(), runner=FakeRunner)
    with pytest.raises(ValueError, match="prefill_step does not apply to the static engine"):
        make_engine("static", FakeModel(), runner=FakeRunner, prefill_step=4)
    with pytest.raises(ValueError, match="enable_prefix_cache does not apply to the static"):
        make_engine("static", FakeModel(), runner=FakeRunner, enable_prefix_cache=True)
    assert make_engine(ContinuousScheduler, FakeModel(), runner=FakeRunner).trace.kind == "continuous"


def test_a_scheduler_that_only_calls_super_is_told_which_method_to_write():
    """The base decides nothing: a kind whose planning only delegates to it gets an error that
    names the method to write, not a schedule borrowed from a reference."""

    class Lazy(OnDemandKV, Scheduler):
        kind = "lazy"

        def batches(self):
            yield from super().batches()

    engine = make_engine(Lazy, FakeModel(), runner=FakeRunner, max_batch_size=2)
    engine.submit([1, 2, 3], max_new_tokens=2)
    with pytest.raises(NotImplementedError, match=r"Lazy must write batches\(\)"):
        engine.step()
    assert not any(hasattr(Scheduler, m) for m in ("admit", "place", "plan", "victim", "make_room"))
    with pytest.raises(NotImplementedError, match=r"must write finish_reason"):
        Scheduler.finish_reason(engine.scheduler, None, 0)
    with pytest.raises(NotImplementedError, match=r"Lazy must write fits"):  # on demand: the kind's rules
        engine.scheduler.fits(None, 1)
    with pytest.raises(NotImplementedError, match=r"Lazy must write grow"):
        engine.scheduler.grow(None)
    with pytest.raises(NotImplementedError, match=r"Lazy must write accept\(req, drafts, picks\)"):
        engine.scheduler.accept(None, [1], [1, 2])  # speculation: which drafts count is the kind's rule
