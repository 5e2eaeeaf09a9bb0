"""The GPU path, the code a Mac runs on Metal, run on this machine's CPU and checked.

``BATCHLAB_GPU_PATH=1`` makes the runner take the GPU path on MLX's CPU backend: MLX's own
layers, ``mx.fast.scaled_dot_product_attention`` with its masks, float16 weights, greedy
picks and sampling on MLX arrays (``batchlab.model.backend``). Here every engine kind and the
learner's engine from the solved lessons must give the float32 reference's greedy answers,
except at near-ties: the learner's paged engine, its pool so small that it preempts, in
float16, as a Mac loads the model (its fused passes chunk prefills beside decodes, the batched
masks next to float16 queries; on the model's first two layers, checked against those layers in
float32), the others in float32 (``gpu_runs`` says why). The runs go under ``coverage``,
and every line under an ``if gpu_path():`` anywhere in batchlab, and every line of the
functions only that path calls, must have run: a new GPU-only branch that no test reaches
fails here.

The same runs check what a Mac's float16 weights do on their own: ``batchlab.generate`` (the
sequential loop, no engine) gives float32's answers except at near-ties; and a pool too small
for the batch (preemption by recompute) with the prefix cache on gives them too.
``test_learner_copies.py`` runs lesson 8's learner copy on the same path (in float32, for time).
"""

from __future__ import annotations

import argparse
import ast
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from learner_pieces import MyMemoryScheduler, MyVictimPolicy
from near_tie import NEAR_TIE_F16, parting_problem

import batchlab
from batchlab import generate, make_engine
from batchlab.model import backend
from batchlab.measurement import microbench
from batchlab.model.backend import GPU_PATH_ENV

pytestmark = pytest.mark.slow

SRC = Path(batchlab.__file__).parent
NEW_TOKENS = 12
# Called only on the GPU path: every line must run (with the bodies of ``if gpu_path():``).
GPU_ONLY = {
    "model_runner.py": ["greedy_mx", "ModelRunner._attention", "ModelRunner._row_context"],
}
CONFIGS = {  # every kind, each with prefill chunks over earlier context where it has them
    "sequential": ("sequential", {}),
    "static": ("static", {"max_batch_size": 4}),
    "continuous": ("continuous", {"max_batch_size": 4, "prefill_step": 32}),
    "stallfree": ("stallfree", {"max_batch_size": 4, "token_budget": 24}),
    "learner": (
        MyMemoryScheduler,
        {"max_batch_size": 4, "token_budget": 24, "policy": MyVictimPolicy(), "enable_prefix_cache": True},
    ),
    # 7 blocks of 16 tokens: any one request fits, all four at once do not (preemption)
    "learner, starved": (
        MyMemoryScheduler,
        {
            "max_batch_size": 4,
            "token_budget": 24,
            "policy": MyVictimPolicy(),
            "kv_block_size": 16,
            "num_kv_blocks": 7,
        },
    ),
}


SPECULATIVE = "stallfree, speculative"  # num_speculative_tokens=3, the long prompt alone

# In float16 (and the loop without an engine): the starved learner engine's fused,
# chunked, paged passes are every mask and KV layout the library's stall-free kind would take in
# float16 too, and it runs them in float32 beside (MLX's float16 CPU kernels are slow here).
FLOAT16 = {"learner, starved"}
# The float16 engine runs the model's first two layers (``load_model(layers=2)``), its answers
# checked against the same two layers in float32: the masks, KV layouts and preemptions are the
# same at any depth, at a fifth of the time. The loop without an engine (``generate``) takes all
# thirty layers in float16, so what float16 rounding does over a Mac's whole model is checked too.
FLOAT16_LAYERS = 2


def gpu_branch_lines() -> dict[str, set[int]]:
    """Every line that runs only on the GPU path, by file: the bodies of ``if gpu_path():``
    (found in every module of batchlab) and the functions of ``GPU_ONLY``."""
    found: dict[str, set[int]] = {}
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        lines = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "gpu_path()" in ast.unparse(node.test):
                assert ast.unparse(node.test) == "gpu_path()", f"{path.name}:{node.lineno}: test it plainly"
                lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
            if isinstance(node, ast.IfExp) and "gpu_path()" in ast.unparse(node.test):
                pytest.fail(f"{path.name}:{node.lineno}: a GPU branch inside an expression cannot be traced")
        for qualname in GPU_ONLY.get(path.name, []):
            node = tree
            for part in qualname.split("."):
                node = next(n for n in node.body if getattr(n, "name", None) == part)
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
        if lines:
            found[str(path)] = lines
    return found


@pytest.fixture(scope="module")
def workload(lm):
    """Chat questions that end on EOS, and a long plain prompt whose prefill is chunked."""
    text = " ".join(textwrap.dedent(argparse.__doc__).split())
    chats = ["What is the capital of France?", "Say hello.", "Name a colour."]
    prompts = [lm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in chats]
    return prompts + [lm.tokenizer.encode(text)[:70]]


@pytest.fixture(scope="module")
def gpu_runs(lm, lm_two_layers, workload):
    """Every config's greedy answers on the GPU path, under coverage, plus a seeded sampled
    request alone and in a crowd; and the lines that ran. The runs that carry the dtype's risks
    (batched masks next to float16 queries, paged KV, the loop without an engine) take a Mac's
    float16 weights; the other kinds take the session's float32 weights on the same path: MLX's
    CPU kernels are several times slower in float16. Sampling takes float32 weights too: it draws
    from logits cast to float32 first (``model_runner.sample``), so float16 adds it no risk the
    greedy runs do not show."""
    import coverage

    with pytest.MonkeyPatch.context() as env:
        env.setenv(GPU_PATH_ENV, "1")
        env.delenv("BATCHLAB_DTYPE", raising=False)
        # traced: only the files that hold GPU-path lines (the scheduler's Python, run at every
        # step, is not what this measures, and tracing it would double the runs' time)
        cov = coverage.Coverage(data_file=None, include=sorted(gpu_branch_lines()))
        cov.start()
        try:
            lm16 = batchlab.load_model()  # no dtype given: the GPU path's own, as on a Mac
            cut16 = batchlab.load_model(layers=FLOAT16_LAYERS)
            answers, stats = {}, {}
            for label, (kind, options) in CONFIGS.items():
                engine = make_engine(kind, cut16 if label in FLOAT16 else lm, **options)
                assert not engine.runner.cpu_path
                ids = [engine.submit(p, max_new_tokens=NEW_TOKENS) for p in workload]
                engine.run_until_idle()
                answers[label] = [engine.poll(i)[:2] for i in ids]
                # the first chat again, alone (where the prefix cache is on, its full blocks are in it)
                again = engine.submit(workload[0], max_new_tokens=NEW_TOKENS)
                engine.run_until_idle()
                answers[label].append(engine.poll(again)[:2])
                stats[label] = engine.stats()
            # speculative decoding: verify rows (multi-token chunks over earlier context, the
            # LM head at each of their last 1 + k positions) on the GPU path, the long prompt alone
            engine = make_engine("stallfree", lm, max_batch_size=1, token_budget=24, num_speculative_tokens=3)
            rid = engine.submit(workload[3], max_new_tokens=NEW_TOKENS, ignore_eos=True)
            engine.run_until_idle()
            answers[SPECULATIVE], stats[SPECULATIVE] = [engine.poll(rid)[:2]], engine.stats()
            # the sequential loop of lesson 0, no engine: greedy, EOS ignored
            answers["generate"] = [
                (generate(lm16, p, NEW_TOKENS, ignore_eos=True).token_ids, "done") for p in workload[3:]
            ]
            sampled = []  # alone, in a crowd, in the same crowd again
            for crowd in (0, 2, 2):
                engine = make_engine("stallfree", lm, max_batch_size=4, token_budget=24)
                for j in range(crowd):
                    engine.submit(workload[j], max_new_tokens=6, temperature=1.0, seed=j)
                rid = engine.submit(workload[3], max_new_tokens=8, temperature=0.8, top_p=0.9, seed=7)
                engine.run_until_idle()
                sampled.append(engine.poll(rid))
            copy_rate = microbench.copy_gbps(megabytes=16, repeats=1)  # the bench's limit, on MLX
        finally:
            cov.stop()
        data = cov.get_data()
        # file -> (its executable lines, those that ran)
        ran = {f: (set(cov.analysis2(f)[1]), set(data.lines(f) or ())) for f in data.measured_files()}
    assert copy_rate > 0
    return lm16, answers, sampled, ran, stats


def test_the_switch_loads_float16_and_takes_the_gpu_path(gpu_runs):
    lm16 = gpu_runs[0]
    assert lm16.info.dtype == "float16"
    assert lm16.model.model.embed_tokens.weight.dtype == mx.float16


def test_every_gpu_branch_ran(gpu_runs):
    ran = gpu_runs[3]
    branches = gpu_branch_lines()
    assert {Path(f).name for f in branches} >= {"model_runner.py", "load.py"}
    never = (set(), set())
    missed = {f: sorted(lines & ran.get(f, never)[0] - ran.get(f, never)[1]) for f, lines in branches.items()}
    missed = {Path(f).name: lines for f, lines in missed.items() if lines}
    assert not missed, f"GPU-path lines no run reached (file: lines): {missed}"


@pytest.mark.parametrize("label", [*CONFIGS, "generate"])
def test_every_kind_on_the_gpu_path_gives_the_float32_answers(lm, lm_two_layers, workload, gpu_runs, label):
    eos = label != "generate"
    # an engine ran the first chat again; generate, the long prompt
    prompts = workload + [workload[0]] if eos else workload[3:]
    assert len(gpu_runs[1][label]) == len(prompts)
    for prompt, (tokens, status) in zip(prompts, gpu_runs[1][label]):
        assert status == "done"
        assert eos or len(tokens) == NEW_TOKENS
        reference = lm_two_layers if label in FLOAT16 else lm  # float32, as deep as the run
        wrong = parting_problem(reference, prompt, tokens, NEW_TOKENS, NEAR_TIE_F16, ignore_eos=not eos)
        assert wrong is None, f"{label}: {wrong}"


def test_speculation_on_the_gpu_path_gives_the_float32_answer(lm, workload, gpu_runs):
    (tokens, status), stats = gpu_runs[1][SPECULATIVE][0], gpu_runs[4][SPECULATIVE]
    assert stats["spec_drafted"] > 0, "prompt lookup proposed drafts: verify rows ran"
    assert status == "done" and len(tokens) == NEW_TOKENS
    wrong = parting_problem(lm, workload[3], tokens, NEW_TOKENS, NEAR_TIE_F16, ignore_eos=True)
    assert wrong is None, f"{SPECULATIVE}: {wrong}"


def test_the_starved_pool_preempted_and_the_prefix_cache_hit(gpu_runs):
    starved, roomy = gpu_runs[4]["learner, starved"], gpu_runs[4]["learner"]
    assert starved["preemptions"] > 0, "7 blocks cannot hold four requests: somebody must give way"
    assert starved["free_kv_blocks"] == starved["num_kv_blocks"] == 7
    assert roomy["prefix_cache_hits"] > 0, "a prompt run again finds its blocks in the prefix cache"


def test_sampling_on_the_gpu_path_is_per_request(gpu_runs):
    """A seeded request samples from its own stream: the same tokens in the same batch,
    every time. Alone or among others it samples the same tokens only where the logits do
    not depend on the batch: MLX's CPU kernels here, not CUDA's on an H200, whose matrix
    products round differently at other batch sizes (docs/results/gpu_path_cuda_h200.md);
    Metal's were not measured."""
    alone, crowd, again = gpu_runs[2]
    assert alone[1:] == crowd[1:] == again[1:] == ("done", "length")
    assert crowd[0] == again[0], "a seeded request in the same batch samples the same tokens"
    if backend.device() == "cpu":
        assert alone[0] == crowd[0], "a seeded request samples the same tokens alone and in a crowd"
