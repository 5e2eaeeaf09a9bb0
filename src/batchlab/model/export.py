"""``batchlab export-mlx DIR``: write the loaded model as an mlx-lm model folder, so that
``mlx_lm.server --model DIR`` (or ``mlx_lm.load(DIR)``) serves exactly the same weights
and tokenizer as batchlab, for side-by-side measurements."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .load import LoadedModel


def export_mlx(lm: LoadedModel, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(lm.model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {k: v for k, v in asdict(lm.args).items() if v is not None}
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = lm.info.dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = lm.tokenizer
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": tok.chat_template,
                "bos_token": tok.bos_token or None,
                "eos_token": tok.eos_token,
                "pad_token": tok.eos_token,
                "unk_token": None,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": lm.max_seq_len,
            },
            indent=2,
        )
    )
    # mlx-lm stops on these ids (the chat turn's end, and the end of a document)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": sorted(tok.eos_token_ids)}, indent=2)
    )
    return out
