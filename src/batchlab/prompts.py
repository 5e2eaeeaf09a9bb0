"""Turning what a user sends (text, chat messages or token ids) into checked token ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # no MLX at import: the engine uses this module with fake models too
    from .model import LoadedModel


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


def check_prompt_ids(ids: list, vocab_size: int, max_seq_len: int) -> None:
    """Raise ValueError unless ``ids`` is a usable prompt for a model with these limits."""
    if len(ids) == 0:
        raise ValueError("the prompt is empty: it needs at least one token")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids must be integers in [0, {vocab_size}); got {bad[:5]!r}")
    if len(ids) >= max_seq_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the maximum sequence length is "
            f"{max_seq_len}, which must leave room for at least one new token"
        )


def clamp_new_tokens(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> int:
    """How many tokens a request may generate: ``max_new_tokens``, cut so prompt + output
    fits in ``max_seq_len`` (such a request finishes with reason "length" at the limit)."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return min(max_new_tokens, max_seq_len - prompt_len)
