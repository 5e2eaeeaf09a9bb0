"""Workloads: the requests a lesson or a benchmark sends, made the same way every time.

A *workload* is a list of requests, each with a prompt (token ids), how many tokens it
will generate, and when it arrives. Every number a lesson shows comes from one of these,
so anybody can run the same requests again and get the same work.

- **Real text, offline.** Prompts are chat messages built from real English: paragraphs
  of the Python Language Reference, shipped with batchlab in ``data/`` (see its README for
  where they come from and their licence). Nothing is downloaded.
- **Lengths in tokens.** A prompt's length is what the engine sees: the chat template,
  the instruction and the text together. The text is trimmed, token by token, until the
  prompt has exactly the target length. Output lengths are enforced with
  ``max_new_tokens`` and ``ignore_eos=True``, so a request generates exactly what the
  workload says, whatever the model would like to say. The one exception is a request with
  ``structured_outputs``: a constrained answer ends at EOS once it is complete, so
  ``max_new_tokens`` is its cap.
- **Deterministic.** Each workload draws everything from ``numpy.random.default_rng(seed)``;
  the same seed gives identical prompt ids, lengths and arrival times on every machine.

The kinds of workload:

``mixed``
    16 requests, all at once, prompts 40-300 tokens, outputs 4-64 tokens: the small
    fixed workload that lessons 1-5 share so their numbers compare.
``high_variance``
    output lengths from an exponential distribution: a few long answers among many short
    ones, the classic case where static batching wastes its slots.
``sharegpt``
    ShareGPT-like chat traffic: lognormal prompt and output lengths (clipped), arriving
    as a Poisson process.
``interference``
    a batch of short-prompt requests decoding, and long prompts (>= 512 tokens) arriving
    one after another while they decode: the prefill stall of lesson 3.
``echo``
    prompts that ask for a passage back word for word: the answer is already in the prompt,
    which is what speculative decoding by prompt lookup finds (``batchlab bench``).
``structured``
    prompts that ask for a JSON record about a passage, each request carrying the JSON schema
    its answer must match (``structured_outputs``, structured output): answers end at EOS
    once the record is complete, so their lengths are the model's, up to a cap.

Arrivals (the ``arrivals=`` option): ``"all"`` at time 0; ``"poisson"`` at rate λ
(exponential gaps); ``"bursty"``: gamma-distributed gaps with the same mean rate but a
coefficient of variation ``cv`` > 1, so requests come in clumps separated by lulls.

Every workload has a ``"quick"`` size (about a minute on a 2-core CPU) and a ``"full"`` size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np


CORPUS_FILE = Path(__file__).parents[1] / "data" / "python_reference.txt"

#: What each prompt asks for; the text follows after a blank line.
INSTRUCTIONS = (
    "Summarize the following text in two or three sentences.",
    "Continue the following text.",
    "Explain the following text to someone who is new to Python.",
    "List the main points of the following text.",
    "Write three questions that a student could answer from the following text.",
    "Rewrite the following text in simpler words.",
)

#: What each ``echo`` prompt asks for: the passage back, unchanged.
ECHO_INSTRUCTIONS = (
    "Repeat this passage exactly:",
    "Copy this text, fixing nothing:",
)

#: What each ``structured`` prompt asks for, and the JSON schema its answer must match.
STRUCTURED_INSTRUCTION = (
    "Describe this passage as JSON with a title, a topic, up to 5 keywords and its number of sentences:"
)
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "topic": {"type": "string", "maxLength": 40},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 5},
        "sentences": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["title", "topic", "keywords", "sentences"],
    "additionalProperties": False,
}

ARRIVALS = ("all", "poisson", "bursty")
SIZES = ("quick", "full")


# -- the pieces ------------------------------------------------------------------------------
@dataclass
class WorkloadRequest:
    """One request of a workload: send ``prompt_ids`` at ``arrival_s`` (seconds after the
    run starts) and generate exactly ``max_new_tokens`` tokens (EOS is ignored).
    ``messages`` is the same prompt as chat messages, for a server that takes text.
    ``structured_outputs`` (vLLM's form, e.g. ``{"json": schema}``): the answer must match
    it, and it ends at EOS once complete, so ``max_new_tokens`` is then a cap, not a length."""

    id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0
    messages: list[dict] = field(default_factory=list)
    structured_outputs: dict | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class Workload:
    """A named list of requests, with the parameters and seed that made it."""

    name: str
    description: str
    requests: list[WorkloadRequest]
    seed: int | None = None
    params: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    @property
    def prompt_lens(self) -> list[int]:
        return [r.prompt_len for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.max_new_tokens for r in self.requests]

    @property
    def arrivals(self) -> list[float]:
        return [r.arrival_s for r in self.requests]

    def head(self, n: int) -> "Workload":
        """The first ``n`` requests (a smaller workload for a quick try)."""
        return replace(
            self,
            name=f"{self.name}[:{n}]",
            requests=list(self.requests[:n]),
            params={**self.params, "head": n},
        )

    def capped(self, max_new_tokens: int) -> "Workload":
        """The same requests, each generating at most ``max_new_tokens`` tokens."""
        return replace(
            self,
            requests=[
                replace(r, max_new_tokens=min(r.max_new_tokens, max_new_tokens)) for r in self.requests
            ],
            params={**self.params, "capped": max_new_tokens},
        )

    def without_constraints(self) -> "Workload":
        """The same requests with no ``structured_outputs``: the same prompts answered freely."""
        return replace(
            self,
            requests=[replace(r, structured_outputs=None) for r in self.requests],
            params={**self.params, "constrained": False},
        )

    def with_arrivals(
        self, arrivals: str, rate: float | None = None, cv: float | None = None, seed: int | None = None
    ) -> "Workload":
        """The same requests arriving by another process (see :func:`arrival_times`)."""
        seed = self.seed if seed is None else seed
        rng = np.random.default_rng([seed if seed is not None else 0, 1])
        times = arrival_times(len(self.requests), arrivals, rate=rate, cv=cv, rng=rng)
        when = _arrivals_text(arrivals, rate, cv)
        if "all at once" in self.description:
            description = self.description.replace("all at once", when)
        elif "at once" in self.description:
            description = self.description.replace("at once", f"arriving {when}")
        else:
            description = f"{self.description}; arriving {when}"
        return replace(
            self,
            description=description,
            requests=[replace(r, arrival_s=float(t)) for r, t in zip(self.requests, times)],
            params={**self.params, "arrivals": arrivals, "rate": rate, "cv": cv},
        )

    def summary(self) -> dict:
        """Counts and lengths at a glance (for tables and lesson text)."""
        p, o, a = np.array(self.prompt_lens), np.array(self.output_lens), np.array(self.arrivals)
        n = len(self.requests)
        return {
            "name": self.name,
            "requests": n,
            "seed": self.seed,
            "prompt_tokens": int(p.sum()) if n else 0,
            "output_tokens": int(o.sum()) if n else 0,
            "prompt_len_min": int(p.min()) if n else None,
            "prompt_len_mean": float(p.mean()) if n else None,
            "prompt_len_max": int(p.max()) if n else None,
            "output_len_min": int(o.min()) if n else None,
            "output_len_mean": float(o.mean()) if n else None,
            "output_len_max": int(o.max()) if n else None,
            "last_arrival_s": float(a.max()) if n else None,
        }


@dataclass(frozen=True)
class Speeds:
    """How fast the machine is, used only to place the arrivals of ``interference`` so the
    long prompts land while the batch decodes. The defaults are the 2-core CPU the course
    was measured on (float32 + OpenBLAS); ``driver.measure_speeds(lm)`` measures yours."""

    decode_step_s: float = 0.10  # one decode step of a batch of 16
    prefill_tokens_per_s: float = 250.0


# -- text ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def corpus_paragraphs() -> tuple[str, ...]:
    """The shipped English paragraphs, in order (section titles left out)."""
    lines = CORPUS_FILE.read_text(encoding="utf-8").splitlines()
    return tuple(line for line in lines if line.strip() and not line.startswith("## "))


def _passage(rng: np.random.Generator, min_chars: int) -> str:
    """Consecutive paragraphs from a random starting point, at least ``min_chars`` long."""
    paras = corpus_paragraphs()
    i = int(rng.integers(len(paras)))
    out: list[str] = []
    while sum(len(p) + 2 for p in out) < min_chars:
        out.append(paras[i % len(paras)])
        i += 1
    return "\n\n".join(out)


class PromptMaker:
    """Builds chat prompts of an exact length in tokens from instructions and real text."""

    def __init__(self, tokenizer: Any):
        self.tok = getattr(tokenizer, "tokenizer", tokenizer)  # a LoadedModel or a Tokenizer
        # The chat template inserts the content verbatim: render it once around a marker
        # and encode prefix + content + suffix (the same ids as encode_chat, much faster).
        marker = "\x00CONTENT\x00"
        rendered = self.tok.apply_chat_template([{"role": "user", "content": marker}])
        if rendered.count(marker) != 1:
            raise ValueError("the chat template does not insert the message verbatim")
        self.prefix, self.suffix = rendered.split(marker)
        self._min_len: dict[str, int] = {}

    def encode(self, content: str) -> list[int]:
        return self.tok.encode(self.prefix + content + self.suffix)

    def min_len(self, instruction: str) -> int:
        """The shortest prompt with this instruction and one token of text."""
        if instruction not in self._min_len:
            self._min_len[instruction] = len(self.encode(instruction + "\n\nThe"))
        return self._min_len[instruction]

    def make(
        self, target_len: int, rng: np.random.Generator, instruction: str | None = None
    ) -> tuple[list[int], list[dict]]:
        """Prompt ids of exactly ``target_len`` tokens (chat template included), and the
        messages they encode: an instruction, a blank line, then real text trimmed to fit."""
        if instruction is None:  # a random instruction among those that leave room for text
            fits = [i for i in INSTRUCTIONS if self.min_len(i) <= target_len]
            fits = fits or [min(INSTRUCTIONS, key=self.min_len)]  # (then too short: an error)
            instruction = fits[int(rng.integers(len(fits)))]
        head = instruction + "\n\n"
        need = target_len - len(self.encode(head))  # tokens of text we need, roughly
        if need < 1:
            raise ValueError(
                f"a prompt of {target_len} tokens is too short for the chat "
                f"template and the instruction {instruction!r}"
            )
        best: tuple[list[int], str] | None = None
        for _ in range(8):  # a fresh passage when this one cannot hit the length exactly
            text_ids = self.tok.encode(_passage(rng, min_chars=6 * need + 200))
            while len(text_ids) < need + 16:  # very short words: take more text
                text_ids = self.tok.encode(_passage(rng, min_chars=12 * need + 400))
            # Re-encoding the joined text can merge or split a token at the seams, so the
            # length is not exactly header + k: step k by the difference until it fits.
            k, seen = need, set()
            while k not in seen and 1 <= k <= len(text_ids):
                seen.add(k)
                content = head + self.tok.decode(text_ids[:k]).rstrip()
                ids = self.encode(content)
                if len(ids) == target_len:
                    return ids, [{"role": "user", "content": content}]
                if len(ids) < target_len and (best is None or len(ids) > len(best[0])):
                    best = (ids, content)
                k += target_len - len(ids)
        if best is None:  # pragma: no cover (has not happened)
            raise ValueError(f"could not build a prompt of {target_len} tokens")
        return best[0], [{"role": "user", "content": best[1]}]  # pragma: no cover


@functools.lru_cache(maxsize=4)
def _maker(tokenizer: Any) -> PromptMaker:
    return PromptMaker(tokenizer)


# -- arrivals --------------------------------------------------------------------------------
def arrival_times(
    n: int,
    arrivals: str = "all",
    rate: float | None = None,
    cv: float | None = None,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Arrival times (seconds, the first at 0) of ``n`` requests.

    ``"all"``: everyone at 0. ``"poisson"``: independent exponential gaps of mean
    ``1/rate`` (a Poisson process at ``rate`` requests per second). ``"bursty"``: gamma
    gaps with the same mean and coefficient of variation ``cv`` (default 2; shape
    ``1/cv**2``), so gaps are mostly tiny with an occasional long lull.
    """
    if arrivals not in ARRIVALS:
        raise ValueError(f"unknown arrivals {arrivals!r}; choose one of {', '.join(ARRIVALS)}")
    if arrivals == "all" or n == 0:
        return np.zeros(n)
    if rate is None or not rate > 0:
        raise ValueError(f"{arrivals} arrivals need a rate > 0 (requests per second)")
    rng = rng if rng is not None else np.random.default_rng(0)
    if arrivals == "poisson":
        gaps = rng.exponential(1.0 / rate, n - 1)
    else:
        cv = 2.0 if cv is None else cv
        if not cv > 0:
            raise ValueError("cv must be > 0")
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


# -- the workloads ---------------------------------------------------------------------------
_SIZES: dict[str, dict[str, dict]] = {
    "high_variance": {"quick": dict(num_requests=32), "full": dict(num_requests=256)},
    "sharegpt": {"quick": dict(num_requests=24), "full": dict(num_requests=200)},
    "interference": {"quick": dict(num_long=3), "full": dict(num_long=8)},
}


def _size(kind: str, size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, not {size!r}")
    return _SIZES[kind][size]


def _requests(
    tokenizer, prefix: str, prompt_lens, output_lens, arrivals_s, rng: np.random.Generator
) -> list[WorkloadRequest]:
    maker = _maker(getattr(tokenizer, "tokenizer", tokenizer))
    width = max(3, len(str(len(prompt_lens) - 1)))
    out = []
    for i, (p, o, t) in enumerate(zip(prompt_lens, output_lens, arrivals_s)):
        ids, messages = maker.make(int(p), rng)
        out.append(WorkloadRequest(f"{prefix}-{i:0{width}d}", ids, int(o), float(t), messages))
    return out


def mixed(
    tokenizer,
    seed: int = 0,
    num_requests: int = 16,
    prompt_range: tuple[int, int] = (40, 300),
    output_range: tuple[int, int] = (4, 64),
) -> Workload:
    """The small fixed workload of lessons 1-5: ``num_requests`` requests at time 0,
    prompt and output lengths uniform over the given ranges (inclusive)."""
    rng = np.random.default_rng(seed)
    p = rng.integers(prompt_range[0], prompt_range[1] + 1, num_requests)
    o = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    reqs = _requests(tokenizer, "mix", p, o, np.zeros(num_requests), rng)
    return Workload(
        "mixed",
        f"{num_requests} requests at once; prompts {prompt_range[0]}-"
        f"{prompt_range[1]} tokens, outputs {output_range[0]}-{output_range[1]} tokens",
        reqs,
        seed,
        dict(num_requests=num_requests, prompt_range=prompt_range, output_range=output_range, arrivals="all"),
    )


def high_variance(
    tokenizer,
    size: str = "quick",
    seed: int = 0,
    num_requests: int | None = None,
    mean_output: float = 64.0,
    max_output: int = 512,
    prompt_range: tuple[int, int] = (40, 128),
    arrivals: str = "all",
    rate: float | None = None,
    cv: float | None = None,
) -> Workload:
    """Output lengths exponential with mean ``mean_output`` (rounded up, at most
    ``max_output``): most answers are short, a few are long. Prompts are short (uniform
    over ``prompt_range``) so decoding dominates. Static batching keeps every slot of a
    batch until its longest answer ends; continuous batching refills them."""
    n = num_requests if num_requests is not None else _size("high_variance", size)["num_requests"]
    return _exponential_outputs(
        tokenizer,
        "high_variance",
        "hv",
        "requests",
        n,
        size,
        seed,
        mean_output,
        max_output,
        prompt_range,
        arrivals,
        rate,
        cv,
    )


def _exponential_outputs(
    tokenizer, name, prefix, what, n, size, seed, mean_output, max_output, prompt_range, arrivals, rate, cv
) -> Workload:
    """``n`` requests with prompts uniform over ``prompt_range`` and output lengths
    exponential with mean ``mean_output`` (rounded up, at most ``max_output``): the shape
    ``high_variance`` and ``chat`` share, with their own defaults."""
    rng = np.random.default_rng(seed)
    p = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
    o = np.clip(np.ceil(rng.exponential(mean_output, n)), 1, max_output).astype(int)
    t = arrival_times(n, arrivals, rate, cv, rng)
    reqs = _requests(tokenizer, prefix, p, o, t, rng)
    return Workload(
        name,
        f"{n} {what}; outputs exponential, mean {mean_output:g} "
        f"tokens (max {max_output}); prompts {prompt_range[0]}-{prompt_range[1]} "
        f"tokens; arrivals {_arrivals_text(arrivals, rate, cv)}",
        reqs,
        seed,
        dict(
            size=size,
            num_requests=n,
            mean_output=mean_output,
            max_output=max_output,
            prompt_range=prompt_range,
            arrivals=arrivals,
            rate=rate,
            cv=cv,
        ),
    )


def sharegpt(
    tokenizer,
    size: str = "quick",
    seed: int = 0,
    num_requests: int | None = None,
    prompt_median: float = 128.0,
    prompt_sigma: float = 0.7,
    prompt_range: tuple[int, int] = (40, 1024),
    output_median: float = 64.0,
    output_sigma: float = 0.8,
    output_range: tuple[int, int] = (4, 512),
    arrivals: str = "poisson",
    rate: float | None = 0.5,
    cv: float | None = None,
) -> Workload:
    """ShareGPT-like chat traffic: prompt and output lengths lognormal (the log of the
    length is normal with ``log(median)`` and ``sigma``), rounded and clipped to the
    ranges. Real ShareGPT conversations are longer (a few hundred tokens each way); these
    medians are scaled down so a CPU gets through them. Poisson arrivals by default."""
    n = num_requests if num_requests is not None else _size("sharegpt", size)["num_requests"]
    rng = np.random.default_rng(seed)
    p = np.clip(np.rint(rng.lognormal(math.log(prompt_median), prompt_sigma, n)), *prompt_range)
    o = np.clip(np.rint(rng.lognormal(math.log(output_median), output_sigma, n)), *output_range)
    t = arrival_times(n, arrivals, rate, cv, rng)
    reqs = _requests(tokenizer, "sg", p.astype(int), o.astype(int), t, rng)
    return Workload(
        "sharegpt",
        f"{n} requests; prompts lognormal (median {prompt_median:g} "
        f"tokens), outputs lognormal (median {output_median:g} tokens); arrivals "
        f"{_arrivals_text(arrivals, rate, cv)}",
        reqs,
        seed,
        dict(
            size=size,
            num_requests=n,
            prompt_median=prompt_median,
            prompt_sigma=prompt_sigma,
            prompt_range=prompt_range,
            output_median=output_median,
            output_sigma=output_sigma,
            output_range=output_range,
            arrivals=arrivals,
            rate=rate,
            cv=cv,
        ),
    )


def interference(
    tokenizer,
    size: str = "quick",
    seed: int = 0,
    batch_size: int = 16,
    num_long: int | None = None,
    long_range: tuple[int, int] = (512, 1024),
    long_output: int = 16,
    short_range: tuple[int, int] = (40, 64),
    speeds: Speeds = Speeds(),
) -> Workload:
    """Long prompts arriving while a full batch decodes.

    ``batch_size - 1`` short-prompt requests arrive at 0 and decode together; one slot is
    left free so each long prompt (uniform over ``long_range``, >= 512 tokens) can decode
    right after its prefill -- its gaps then measure stalls, not a wait for a slot (and
    stall-free scheduling, which gives a prefilling request a slot, can admit it at all).
    The long prompts arrive one at a time, spaced so each is done before the next comes
    (with 50 % to spare, on a machine as fast as ``speeds``), and the short requests
    generate enough tokens to still be decoding when the last long one finishes. Arrival
    times are seconds, so on a machine much faster or slower than the default ``Speeds``
    pass ``speeds=Speeds.measure(lm, batch_size)``; otherwise the long prompts come after
    the batch is done, or pile up and wait for the free slot.
    """
    if batch_size < 2:
        raise ValueError("interference needs batch_size >= 2 (decoders plus a free slot)")
    if long_range[0] < 512:
        raise ValueError("long prompts are at least 512 tokens")
    k = num_long if num_long is not None else _size("interference", size)["num_long"]
    rng = np.random.default_rng(seed)
    n_short = batch_size - 1
    short = rng.integers(short_range[0], short_range[1] + 1, n_short)
    long = rng.integers(long_range[0], long_range[1] + 1, k)
    step, tps = speeds.decode_step_s, speeds.prefill_tokens_per_s
    # The short requests are prefilled (one a step) and decoding ~10 steps in...
    decoding_from = short.sum() / tps + n_short * step
    first = decoding_from + 10 * step
    # ...then long prompt i arrives; the next one after it has prefilled and finished,
    # with 50% to spare.
    arrivals, t = [], first
    for L in long:
        arrivals.append(t)
        t += 1.5 * (L / tps + (long_output + 10) * step)
    end = arrivals[-1] + long[-1] / tps + long_output * step if k else first
    short_output = int(math.ceil((end - decoding_from) / step)) + 20
    p = np.concatenate([short, long])
    o = [short_output] * n_short + [long_output] * k
    times = [0.0] * n_short + arrivals
    reqs = _requests(tokenizer, "if", p, o, times, rng)
    for r in reqs[n_short:]:
        r.id = r.id.replace("if-", "if-long-")
    return Workload(
        "interference",
        f"{n_short} short requests decoding {short_output} tokens "
        f"each; "
        + (
            f"{k} long prompts ({long_range[0]}-{long_range[1]} tokens, {long_output} output tokens) "
            f"arriving one at a time from {first:.1f} s"
            if k != 1
            else f"1 long prompt ({long_range[0]}-{long_range[1]} tokens, {long_output} output tokens) "
            f"arriving at {first:.1f} s"
        ),
        reqs,
        seed,
        dict(
            size=size,
            batch_size=batch_size,
            num_long=k,
            long_range=long_range,
            long_output=long_output,
            short_range=short_range,
            short_output=short_output,
            speeds=vars(speeds),
        ),
    )


def _arrivals_text(arrivals: str, rate: float | None, cv: float | None) -> str:
    if arrivals == "all":
        return "all at once"
    if arrivals == "poisson":
        return f"Poisson at {rate:g}/s"
    return f"bursty at {rate:g}/s (gap CV {2.0 if cv is None else cv:g})"


def shared_prefix(
    tokenizer,
    size: str = "quick",
    seed: int = 0,
    num_requests: int | None = None,
    system_chars: int = 1200,
    output_len: int = 8,
) -> Workload:
    """Requests that share one long system prompt (a passage of real text) and differ only in
    a short question, each on another sentence of the course's text (no two the same): the case
    a prefix cache is for (lesson 8). All arrive at time 0. 8 requests at size "quick", 32 at
    "full"."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    num_requests = num_requests or (8 if size == "quick" else 32)
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    rng = np.random.default_rng(seed)
    system = "Answer questions about the following text.\n\n" + _passage(rng, system_chars)
    paras = corpus_paragraphs()

    def first_sentence(para: str) -> str:
        topic = para.split(". ")[0]
        return topic if len(topic) <= 80 else topic[:80].rsplit(" ", 1)[0]

    available = len(set(map(first_sentence, paras)))
    if num_requests > available:
        raise ValueError(
            f"num_requests: at most {available} (distinct questions the text gives), got {num_requests}"
        )
    reqs, topics = [], set()
    for i in range(num_requests):
        while True:  # a topic not asked yet (paragraphs can open with the same sentence)
            topic = first_sentence(paras[int(rng.integers(len(paras)))])
            if topic not in topics:
                break
        topics.add(topic)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"What does the text say about this: {topic}?"},
        ]
        reqs.append(WorkloadRequest(f"shared-{i:03d}", tok.encode_chat(messages), output_len, 0.0, messages))
    return Workload(
        "shared_prefix",
        f"{num_requests} requests sharing a system prompt of {len(system)} characters "
        f"({len(tok.encode(system))} tokens); outputs of {output_len} tokens",
        reqs,
        seed,
        dict(num_requests=num_requests, system_chars=system_chars, output_len=output_len, arrivals="all"),
    )


# -- for the simulator: lengths only ----------------------------------------------------
def synthetic_workload(
    num_requests: int,
    rate: float,
    seed: int = 0,
    prompt_median: float = 128.0,
    prompt_sigma: float = 0.7,
    prompt_range: tuple[int, int] = (16, 1024),
    output_median: float = 64.0,
    output_sigma: float = 0.8,
    output_range: tuple[int, int] = (4, 512),
    arrivals: str = "poisson",
    prefix: str = "sim",
) -> Workload:
    """ShareGPT-like lengths (lognormal, as ``sharegpt``) arriving at ``rate``
    per second, with placeholder prompt tokens: the simulator needs lengths, not text,
    and building 10,000 real prompts would take longer than simulating them."""
    rng = np.random.default_rng(seed)
    p = np.clip(np.rint(rng.lognormal(math.log(prompt_median), prompt_sigma, num_requests)), *prompt_range)
    o = np.clip(np.rint(rng.lognormal(math.log(output_median), output_sigma, num_requests)), *output_range)
    t = arrival_times(num_requests, arrivals, rate, rng=rng)
    width = len(str(num_requests - 1))
    reqs = [
        WorkloadRequest(f"{prefix}-{i:0{width}d}", [1] * int(pi), int(oi), float(ti))
        for i, (pi, oi, ti) in enumerate(zip(p, o, t))
    ]
    return Workload(
        "synthetic",
        f"{num_requests} requests, Poisson at {rate:g}/s, ShareGPT-like lengths",
        reqs,
        seed,
        dict(
            num_requests=num_requests,
            rate=rate,
            prompt_median=prompt_median,
            output_median=output_median,
            arrivals=arrivals,
            prefix=prefix,
        ),
    )


def merge(*workloads: Workload) -> Workload:
    """Several workloads' requests as one, in order of arrival (ids must differ)."""
    reqs = sorted((r for w in workloads for r in w.requests), key=lambda r: r.arrival_s)
    if len({r.id for r in reqs}) != len(reqs):
        raise ValueError("merged workloads share request ids; give each a different prefix")
    return Workload(
        "+".join(w.name for w in workloads),
        "; ".join(w.description for w in workloads),
        reqs,
        None,
        {"parts": [w.params for w in workloads]},
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "mixed": mixed,
    "high_variance": high_variance,
    "sharegpt": sharegpt,
    "interference": interference,
    "shared_prefix": shared_prefix,
}


def make_workload(name: str, tokenizer, **kwargs) -> Workload:
    """``make_workload("sharegpt", lm, size="full", seed=1)``: a workload by name."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name](tokenizer, **kwargs)


def chat(
    tokenizer,
    size: str = "quick",
    seed: int = 0,
    num_requests: int | None = None,
    mean_output: float = 72.0,
    max_output: int = 256,
    prompt_range: tuple[int, int] = (40, 128),
    arrivals: str = "all",
    rate: float | None = None,
    cv: float | None = None,
) -> Workload:
    """Chat-shaped traffic: the answers are longer than the questions, as in real chat
    (ShareGPT's outputs run to hundreds of tokens). Prompts as ``high_variance``'s (real
    text, uniform over ``prompt_range`` tokens); output lengths exponential with mean
    ``mean_output`` (rounded up, at most ``max_output``: high variance, a coefficient of
    variation near 1), so decoding, not prefill, dominates the work. ``size``: "quick"
    32 requests, "full" 128."""
    sizes = {"quick": 32, "full": 128}
    if size not in sizes:
        raise ValueError(f"size must be one of {', '.join(sizes)}, not {size!r}")
    n = num_requests if num_requests is not None else sizes[size]
    return _exponential_outputs(
        tokenizer,
        "chat",
        "chat",
        "chat requests",
        n,
        size,
        seed,
        mean_output,
        max_output,
        prompt_range,
        arrivals,
        rate,
        cv,
    )


WORKLOADS["chat"] = chat


def echo(
    tokenizer,
    size: str = "quick",
    seed: int = 0,
    num_requests: int | None = None,
    output_range: tuple[int, int] | None = None,
    prompt_range: tuple[int, int] = (112, 160),
) -> Workload:
    """Echo-heavy traffic: each prompt asks for a passage of the shipped text back unchanged
    ("Repeat this passage exactly:", "Copy this text, fixing nothing:", then the passage), so
    a faithful answer is already in its prompt. That is what speculative decoding by prompt
    lookup is for (``num_speculative_tokens``): it finds the answer's next tokens in the prompt
    and the model only has to check them. Prompts uniform over ``prompt_range`` tokens (the
    passage runs longer than any answer); outputs uniform over ``output_range`` (inclusive),
    all at time 0. ``size``: "quick" 8 requests of 16-24 new tokens, "full" 16 of 48-64.
    Where a model strays from the passage, prompt lookup finds less: the bench's acceptance
    rate says how often it did not."""
    sizes = {"quick": (8, (16, 24)), "full": (16, (48, 64))}
    if size not in sizes:
        raise ValueError(f"size must be one of {', '.join(sizes)}, not {size!r}")
    n = num_requests if num_requests is not None else sizes[size][0]
    output_range = output_range or sizes[size][1]
    rng = np.random.default_rng(seed)
    p = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
    o = rng.integers(output_range[0], output_range[1] + 1, n)
    maker = _maker(getattr(tokenizer, "tokenizer", tokenizer))
    width = max(3, len(str(n - 1)))
    reqs = []
    for i, (pi, oi) in enumerate(zip(p, o)):
        instruction = ECHO_INSTRUCTIONS[int(rng.integers(len(ECHO_INSTRUCTIONS)))]
        ids, messages = maker.make(int(pi), rng, instruction)
        reqs.append(WorkloadRequest(f"echo-{i:0{width}d}", ids, int(oi), 0.0, messages))
    return Workload(
        "echo",
        f"{n} requests at once asking for a passage back unchanged; prompts "
        f"{prompt_range[0]}-{prompt_range[1]} tokens, outputs {output_range[0]}-{output_range[1]} tokens",
        reqs,
        seed,
        dict(
            size=size,
            num_requests=n,
            output_range=output_range,
            prompt_range=prompt_range,
            arrivals="all",
        ),
    )


WORKLOADS["echo"] = echo


def structured(
    tokenizer,
    size: str = "quick",
    seed: int = 0,
    num_requests: int | None = None,
    max_new_tokens: int | None = None,
    prompt_range: tuple[int, int] = (64, 112),
) -> Workload:
    """Structured output: each prompt asks for a JSON record about a passage of the shipped
    text (``STRUCTURED_INSTRUCTION``, then the passage) and each request carries the schema
    its answer must match, ``structured_outputs={"json": STRUCTURED_SCHEMA}`` (a title, a
    topic, up to 5 keywords and a number of sentences; nothing else). An engine that
    constrains ends each answer at EOS once the record is complete; ``max_new_tokens`` caps
    it (a record cut there is not JSON). Prompts uniform over ``prompt_range`` tokens, all at
    time 0. ``size``: "quick" 8 requests of at most 64 new tokens, "full" 16 of at most 96
    (room for most records: SmolLM2-135M's took 36-81 tokens on seed 0's prompts)."""
    sizes = {"quick": (8, 64), "full": (16, 96)}
    if size not in sizes:
        raise ValueError(f"size must be one of {', '.join(sizes)}, not {size!r}")
    n = num_requests if num_requests is not None else sizes[size][0]
    cap = max_new_tokens if max_new_tokens is not None else sizes[size][1]
    rng = np.random.default_rng(seed)
    p = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
    maker = _maker(getattr(tokenizer, "tokenizer", tokenizer))
    width = max(3, len(str(n - 1)))
    reqs = []
    for i, pi in enumerate(p):
        ids, messages = maker.make(int(pi), rng, STRUCTURED_INSTRUCTION)
        reqs.append(
            WorkloadRequest(
                f"json-{i:0{width}d}", ids, cap, 0.0, messages, structured_outputs={"json": STRUCTURED_SCHEMA}
            )
        )
    return Workload(
        "structured",
        f"{n} requests at once asking for a JSON record about a passage, each with its JSON schema; "
        f"prompts {prompt_range[0]}-{prompt_range[1]} tokens, answers ending at EOS, at most {cap} tokens",
        reqs,
        seed,
        dict(
            size=size,
            num_requests=n,
            max_new_tokens=cap,
            prompt_range=prompt_range,
            arrivals="all",
            constrained=True,
        ),
    )


WORKLOADS["structured"] = structured
