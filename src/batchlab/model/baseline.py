"""Sequential generation: one request, a KV cache, one token per forward pass.

This is the baseline every batching lesson improves on. It uses mlx-lm's model and
its ``KVCache`` directly: prefill the whole prompt in one pass, then decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .load import LoadedModel
from ..core.request import Sampler, SamplingParams, clamp_new_tokens
from .prompts import prompt_ids
from .model_runner import sample


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (an EOS token) or "length" (max_new_tokens or context limit)
    ttft_s: float  # time to first token
    token_times_s: list[float] = field(default_factory=list)  # each token's time since start


def generate(
    lm: LoadedModel,
    prompt: Any,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    ignore_eos: bool = False,
) -> Generation:
    """Generate a continuation of ``prompt`` (text, chat messages or token ids)."""
    sampler = Sampler(SamplingParams(temperature, top_p, top_k, seed))
    ids = prompt_ids(lm, prompt)
    budget = clamp_new_tokens(len(ids), max_new_tokens, lm.max_seq_len)
    cache = lm.model.make_cache()
    start = time.perf_counter()
    logits = lm.model(mx.array(ids)[None], cache=cache)[:, -1, :]  # prefill: all prompt tokens
    tokens: list[int] = []
    times: list[float] = []
    while True:
        token = sample(logits, [sampler])[0]
        tokens.append(token)
        times.append(time.perf_counter() - start)
        if not ignore_eos and token in lm.tokenizer.eos_token_ids:
            reason = "stop"
            break
        if len(tokens) >= budget:
            reason = "length"
            break
        logits = lm.model(mx.array([[token]]), cache=cache)[:, -1, :]  # decode: one token
    text = lm.tokenizer.decode(tokens, skip_special_tokens=True)
    return Generation(tokens, text, reason, times[0], times)
