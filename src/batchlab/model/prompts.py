"""Turning what a user sends (text, chat messages or token ids) into checked token ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.request import check_prompt_ids

if TYPE_CHECKING:
    from .load import LoadedModel


def prompt_ids(lm: LoadedModel, prompt: Any) -> list[int]:
    """Token ids for ``prompt``: a str (encoded as is), a list of chat messages
    (chat template applied, assistant turn opened), or a list of token ids."""
    if isinstance(prompt, str):
        ids = lm.tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = lm.tokenizer.encode_chat(list(prompt))
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise ValueError(f"a prompt must be text, chat messages or token ids, not {type(prompt).__name__}")
    check_prompt_ids(ids, lm.tokenizer.vocab_size, lm.max_seq_len)
    return ids
