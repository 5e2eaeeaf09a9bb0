"""The tokenizer, the chat template and a streaming detokenizer.

SmolLM2 uses GPT-2-style byte-level BPE. The GGUF file carries everything needed
to rebuild it: the vocabulary, the merges, which tokens are special, and the
chat template. We rebuild it with Hugging Face's ``tokenizers`` library (which
does the BPE) and render the template with jinja2, as ``transformers`` does.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type): 3 = control (special) token.
_CONTROL = 3


class Tokenizer:
    """Text <-> token ids, plus the special tokens a server needs to know."""

    def __init__(
        self,
        backend: _HFTokenizer,
        eos_token_ids: Iterable[int],
        chat_template: str | None,
        bos_token: str = "",
        eos_token: str = "",
    ):
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {
            t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special
        }

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Rebuild the byte-level BPE tokenizer stored in a GGUF file's metadata."""
        if meta["tokenizer.ggml.model"] != "gpt2":
            raise ValueError(
                f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, "
                f"not {meta['tokenizer.ggml.model']!r}"
            )
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        types = list(meta["tokenizer.ggml.token_type"])
        backend = _HFTokenizer(
            models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False)
        )
        # llama.cpp's "smollm" pre-tokenizer: every digit on its own, then GPT-2's regex.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, kind in enumerate(types)
                if kind == _CONTROL
            ]
        )
        eos = int(meta["tokenizer.ggml.eos_token_id"])
        eos_ids = {eos}
        if "<|endoftext|>" in tokens:  # end of document: a sensible stop for any prompt
            eos_ids.add(tokens.index("<|endoftext|>"))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend,
            eos_ids,
            meta.get("tokenizer.chat_template"),
            bos_token=tokens[int(bos)] if bos is not None else "",
            eos_token=tokens[eos],
        )

    @classmethod
    def from_transformers(cls, hf_tokenizer, eos_token_ids: Iterable[int]) -> "Tokenizer":
        """Wrap a fast ``transformers`` tokenizer (what ``mlx_lm.load`` returns inside)."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("batchlab needs a fast (tokenizers-backed) tokenizer")
        return cls(
            backend,
            eos_token_ids,
            hf_tokenizer.chat_template,
            bos_token=hf_tokenizer.bos_token or "",
            eos_token=hf_tokenizer.eos_token or "",
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised."""
        if not isinstance(text, str):
            raise ValueError(f"expected text (str), got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's own template (it adds the default system prompt)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        if not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
        return (
            _template_env()
            .from_string(self.chat_template)
            .render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self)


def _template_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Same settings as transformers: templates are data, so render them sandboxed.
    return jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, never splitting a character.

    One token can end in the middle of a UTF-8 character (an emoji is often 2-4
    byte tokens). Decoding it alone gives U+FFFD, the replacement character. So we
    decode a short window of recent tokens and only emit text once it no longer ends
    in U+FFFD. (The same idea as vLLM's and text-generation-inference's.)
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the window we re-decode
        self.read_offset = 0  # tokens before this are already emitted

    def add(self, token_id: int) -> str:
        """Feed one token; return the new text that is now safe to show (maybe "")."""
        self.tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (call once the stream has ended)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        shown = decode(self.tokens[self.prefix_offset : self.read_offset])
        text = decode(self.tokens[self.prefix_offset :])
        if len(text) > len(shown) and (final or not text.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return text[len(shown) :]
        return ""
