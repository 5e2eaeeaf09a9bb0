"""A load generator: send a workload to any OpenAI-compatible server and measure what its
clients see, the way ``vllm bench serve`` does.

Every request is a streaming chat completion sent with the official ``openai`` client
(temperature 0, ``max_tokens`` = the workload's output length). The client notes when each
chunk with text arrives, and from those times alone (nothing from the server's insides):

- **TTFT**: from sending the request to the first chunk with text;
- **ITL** (inter-token latency): every gap between consecutive text chunks;
- **TPOT** (time per output token): ``(latency - TTFT) / (output tokens - 1)``;
- **output tokens**: the server's ``usage.completion_tokens`` when it sends usage
  (``stream_options={"include_usage": True}``), otherwise the number of text chunks;
  each request records which (``tokens_from``).

A request is *good* when its TTFT and its mean TPOT are within the SLOs (vLLM's ``--goodput``
rule); goodput is good requests per second of the run. (``metrics.SLO``, on a trace, bounds
the *largest* gap between tokens instead, ``max_tbt_s``: there one stall fails a request,
here it is averaged over the answer.) Failures (HTTP 4xx/5xx, dropped
connections, timeouts) are counted by kind with the server's message, and never stop the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from ..core.metrics import percentile
from ..measurement.workloads import Workload


@dataclass
class RequestResult:
    """One request as its client saw it. Times are seconds; ``sent_s`` counts from the
    start of the run, the others from when this request was sent."""

    id: str
    prompt_len: int
    max_tokens: int
    sent_s: float
    ok: bool = False
    error: str | None = None  # the kind: "HTTP 429", "disconnected", "timeout", ...
    error_message: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks that carried text
    output_tokens: int = 0
    tokens_from: str = "chunks"  # "usage" when the server reported usage
    finish_reason: str | None = None
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token: the mean gap after the first token (None with fewer than 2)."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def is_good(self, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
        """Completed, first token within ``slo_ttft_s`` and TPOT (the mean gap, ``tpot_s``)
        within ``slo_tpot_s`` (a missing SLO is no constraint; a single-token answer has no
        TPOT to miss)."""
        if not self.ok or self.ttft_s is None:
            return False
        if slo_ttft_s is not None and self.ttft_s > slo_ttft_s:
            return False
        tpot = self.tpot_s
        return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def _stats(values, scale: float = 1000.0) -> dict:
    """mean, p50 and p99 (numpy's linear percentiles, as in ``metrics``), times ``scale``
    (seconds to milliseconds by default); None where there are no values."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return {"mean": None, "p50": None, "p99": None}
    return {
        "mean": float(arr.mean()) * scale,
        "p50": percentile(arr, 50) * scale,
        "p99": percentile(arr, 99) * scale,
    }


@dataclass
class LoadgenResult:
    """A whole run: the settings, the wall time, and every request's result."""

    base_url: str
    model: str
    workload: str
    settings: dict
    duration_s: float
    requests: list[RequestResult]

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.requests if r.ok]

    def summary(self) -> dict:
        """The headline numbers (times in ms), JSON-ready."""
        done, d = self.completed, self.duration_s
        slo_ttft, slo_tpot = self.settings.get("slo_ttft_s"), self.settings.get("slo_tpot_s")
        good = [r for r in done if r.is_good(slo_ttft, slo_tpot)]
        tokens = sum(r.output_tokens for r in done)
        sources = sorted({r.tokens_from for r in done})
        out = {
            "completed": len(done),
            "failed": len(self.requests) - len(done),
            "failures": dict(Counter(r.error for r in self.requests if not r.ok)),
            "duration_s": d,
            "output_tokens": tokens,
            "tokens_from": "+".join(sources) if sources else None,
            "request_throughput": len(done) / d if d > 0 else None,
            "output_throughput": tokens / d if d > 0 else None,
            "good_requests": len(good) if (slo_ttft or slo_tpot) else None,
            "goodput": len(good) / d if d > 0 and (slo_ttft or slo_tpot) else None,
        }
        for name, values in (
            ("ttft_ms", [r.ttft_s for r in done]),
            ("tpot_ms", [r.tpot_s for r in done if r.tpot_s is not None]),
            ("itl_ms", [g for r in done for g in r.itl_s]),
        ):
            for k, v in _stats(values).items():
                out[f"{name}_{k}"] = v
        return out

    def to_json(self) -> dict:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "workload": self.workload,
            "settings": self.settings,
            "summary": self.summary(),
            "requests": [{**asdict(r), "tpot_s": r.tpot_s} for r in self.requests],
        }

    def write_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def table(self) -> str:
        """The summary as ``vllm bench serve`` prints it."""
        s = self.summary()
        fmt = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        rows = [
            ("Model", self.model),
            ("Workload", self.workload),
            ("Successful requests", s["completed"]),
            ("Failed requests", s["failed"]),
        ]
        rows += [(f"  failed: {kind}", n) for kind, n in s["failures"].items()]
        rows += [
            ("Benchmark duration (s)", fmt(s["duration_s"])),
            (f"Total generated tokens (from {s['tokens_from'] or '-'})", s["output_tokens"]),
            ("Request throughput (req/s)", fmt(s["request_throughput"])),
            ("Output token throughput (tok/s)", fmt(s["output_throughput"])),
        ]
        if s["goodput"] is not None:
            slo = self.settings
            rows += [
                (
                    f"Goodput (req/s; TTFT <= {slo.get('slo_ttft_s')} s, TPOT <= {slo.get('slo_tpot_s')} s)",
                    fmt(s["goodput"]),
                ),
                ("Good requests", s["good_requests"]),
            ]
        for name, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
            for k in ("mean", "p50", "p99"):
                rows.append(
                    (f"{k.capitalize() if k == 'mean' else k.upper()} {label} (ms)", fmt(s[f"{name}_{k}"]))
                )
        width = max(len(str(k)) for k, _ in rows) + 2
        return "\n".join(f"{k:<{width}}{v}" for k, v in rows)


def _failure(e: BaseException) -> tuple[str, str]:
    """(kind, message) for an exception raised while sending or streaming. Transport errors
    are told apart by class name, since the ``openai`` client may use ``httpx`` or its
    fork ``httpx2``."""
    import openai

    if isinstance(e, openai.APIStatusError):
        message = e.message
        try:
            message = e.response.json()["error"]["message"]
        except Exception:  # not an OpenAI-style body: keep the client's message
            pass
        return f"HTTP {e.status_code}", message
    kinds = {c.__name__ for c in type(e).__mro__}
    if isinstance(e, (openai.APITimeoutError, asyncio.TimeoutError)) or "TimeoutException" in kinds:
        return "timeout", str(e) or "timed out"
    if isinstance(e, (openai.APIConnectionError, ConnectionError)) or "TransportError" in kinds:
        return "disconnected", str(e) or type(e).__name__
    return type(e).__name__, str(e)


async def _one(
    client, model: str, req, t0: float, usage: bool, user: str | None, extra_body: dict | None
) -> RequestResult:
    start = time.perf_counter()
    out = RequestResult(req.id, req.prompt_len, req.max_new_tokens, start - t0)
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    if user is not None:
        extra["user"] = user
    if extra_body:
        extra["extra_body"] = extra_body
    last = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=req.messages,
            max_tokens=req.max_new_tokens,
            temperature=0,
            stream=True,
            **extra,
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                out.output_tokens, out.tokens_from = chunk.usage.completion_tokens, "usage"
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    if last is None:
                        out.ttft_s = now - start
                    else:
                        out.itl_s.append(now - last)
                    last = now
                    out.chunks += 1
                    out.text += choice.delta.content
                if choice.finish_reason:
                    out.finish_reason = choice.finish_reason
        out.latency_s = time.perf_counter() - start
        if out.finish_reason is None:
            out.error, out.error_message = "disconnected", "the stream ended without a finish reason"
        elif out.ttft_s is None:
            out.error, out.error_message = "no text", f"finished ({out.finish_reason}) without any text"
        else:
            out.ok = True
            if out.tokens_from == "chunks":
                out.output_tokens = out.chunks
    except Exception as e:  # counted, never fatal: the run goes on
        out.error, out.error_message = _failure(e)
    return out


def first_model(base_url: str, api_key: str = "unused") -> str:
    """The first model id the server lists at ``GET /v1/models``."""
    from openai import OpenAI

    models = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key).models.list().data
    if not models:
        raise ValueError(f"{base_url} lists no models at /v1/models; pass a model name")
    return models[0].id


async def _run(
    base_url, workload: Workload, model, concurrency, usage, timeout_s, progress, api_key, user, extra_body
) -> tuple[float, list[RequestResult]]:
    from openai import AsyncOpenAI
    from tqdm.auto import tqdm

    client = AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key=api_key, timeout=timeout_s, max_retries=0
    )
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(
        total=len(workload.requests), unit="req", desc=f"loadgen {workload.name}", disable=not progress
    )
    t0 = time.perf_counter()

    async def send(req):
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
        if gate is None:
            result = await _one(client, model, req, t0, usage, user, extra_body)
        else:
            async with gate:
                result = await _one(client, model, req, t0, usage, user, extra_body)
        bar.update(1)
        return result

    try:
        results = await asyncio.gather(*(send(r) for r in workload.requests))
    finally:
        bar.close()
        await client.close()
    return time.perf_counter() - t0, list(results)


def _run_to_end(coro):
    """``asyncio.run(coro)``, in a helper thread if this thread already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run_loadgen(
    base_url: str,
    workload: Workload,
    model: str | None = None,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    usage: bool = True,
    timeout_s: float = 600.0,
    progress: bool = True,
    api_key: str = "unused",
    user: str | None = None,
    extra_body: dict | None = None,
) -> LoadgenResult:
    """Send every request of ``workload`` to the server at ``base_url`` and measure.

    ``rate``: Poisson arrivals at that many requests per second (seeded by ``seed``);
    None sends them all at once. ``concurrency``: at most that many in flight (None: no
    limit). ``model``: default the first one the server lists. ``usage=False`` for a server
    that refuses ``stream_options``. ``api_key``: the server's key (``batchlab serve --api-key``);
    ``user``: the OpenAI ``user`` field sent with every request, which a shared server's
    dashboard shows and its per-user limit counts. ``extra_body``: more fields for every
    request's body, e.g. vLLM's ``{"ignore_eos": True}`` for answers of exactly
    ``max_tokens`` (``batchlab loadgen --ignore-eos``). Works in a notebook too (whose asyncio loop is busy:
    the run then gets a thread of its own)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if not workload.requests:
        raise ValueError("the workload has no requests")
    if any(not r.messages for r in workload.requests):
        raise ValueError("every request needs chat messages (WorkloadRequest.messages)")
    workload = workload.with_arrivals("poisson" if rate else "all", rate=rate, seed=seed)
    model = model or first_model(base_url, api_key)
    duration, results = _run_to_end(
        _run(base_url, workload, model, concurrency, usage, timeout_s, progress, api_key, user, extra_body)
    )
    settings = {
        "requests": len(results),
        "concurrency": concurrency,
        "rate": rate,
        "seed": seed,
        "user": user,
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
        "usage": usage,
        "extra_body": extra_body,
        "max_tokens_total": sum(r.max_new_tokens for r in workload.requests),
    }
    return LoadgenResult(base_url, model, workload.name, settings, duration, results)
