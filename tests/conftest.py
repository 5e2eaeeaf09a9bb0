"""Shared fixtures: the real model (loaded once per session) and independent references.

The references come from ``transformers`` (a test-only dependency): its own GGUF code
builds the tokenizer, the config and the float32 weights, and its own PyTorch Llama
runs them. Nothing here reuses batchlab's loading code, so agreement is evidence.
"""

from __future__ import annotations

import batchlab  # first: loads OpenBLAS before anything imports mlx

import pytest

from batchlab.course import guard
from batchlab.model.load import gguf_path

# A checker stops a learner's case after ``guard.CASE_LIMIT_S`` (10 s) of wall time and asks
# "an endless loop?". Under the suite's two workers on two cores a correct but slow answer
# (lesson 0's greedy decoding without a cache) took longer than that in CI at a425d5d, and
# was counted as a loop. Tests that are about the limit set their own (0.5 s); the rest wait
# as long as a stuck test would anyway be noticed.
guard.CASE_LIMIT_S = 120.0


@pytest.fixture(scope="session")
def gguf_file():
    return gguf_path()


@pytest.fixture(scope="session")
def lm():
    """The course's model as batchlab loads it (exact float32 dequantization)."""
    return batchlab.load_model()


@pytest.fixture(scope="session")
def lm_two_layers():
    """The course's model cut to its first two layers (``load_model(layers=2)``): the same weights,
    tokenizer and code computing about a quarter of a decode step. For tests of plumbing that
    runs the real model but checks neither its answers nor its speed (the bench's figures exist,
    a server streams what its engine makes); what the model says is checked on ``lm``."""
    return batchlab.load_model(layers=2)


@pytest.fixture(scope="session")
def gguf_reader(gguf_file):
    import gguf

    return gguf.GGUFReader(str(gguf_file))


@pytest.fixture(scope="session")
def gguf_meta(gguf_reader):
    """The GGUF metadata in the form ``config_from_gguf`` and ``Tokenizer.from_gguf_metadata`` take."""
    meta = {name: field.contents() for name, field in gguf_reader.fields.items()}
    meta["_tensor_names"] = [t.name for t in gguf_reader.tensors]
    return meta


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_file):
    """Reference tokenizer: transformers' own conversion of the GGUF tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="session")
def hf_gguf(gguf_file):
    """transformers' own GGUF reading: config and float32 tensors under Hugging Face names
    (q and k un-permuted back to Hugging Face's rotary layout)."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # One thread: the reference's speed hardly matters, and OpenMP threads spinning next to
    # MLX's and OpenBLAS's own threads on a 2-core machine slow everything down badly.
    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)["tensors"]
    return config, model, tensors


@pytest.fixture(scope="session")
def hf_model(hf_gguf):
    """Reference model: Hugging Face's PyTorch Llama (non-interleaved rotary embedding)
    holding transformers' dequantization of the GGUF.

    ``from_pretrained(..., gguf_file=...)`` would do the same but insists on the
    ``accelerate`` package, which nothing else needs; so we build the model and load
    transformers' GGUF tensors into it ourselves."""
    config, model, tensors = hf_gguf
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding
    assert config.tie_word_embeddings
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def pytest_report_header(config):
    """Which path the model runs (``BATCHLAB_GPU_PATH`` can force the GPU path on the CPU)."""
    from batchlab.model.backend import describe

    return f"path: {describe()}"
