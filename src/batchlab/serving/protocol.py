"""The OpenAI-style requests the server takes, and what it refuses in them.

The pydantic models of both endpoints' bodies (``ChatRequest`` for
``/v1/chat/completions``, ``CompletionRequest`` for ``/v1/completions``), the checks that
refuse a well-formed request asking for what this server does not do (``refusal``,
``chat_turns``), a body's ``SamplingParams`` for the engine (``sampling_params``), and
OpenAI's error body.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..core.request import SamplingParams
from ..core.structured import StructuredOutputs

DEFAULT_MAX_TOKENS = 512  # an answer's length when the request gives no max_tokens


class ContentPart(BaseModel):
    """One part of a message's content in OpenAI's array form; only text parts are read."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # "developer" is what newer OpenAI clients send for "system"; tool and function
    # messages parse only so that they get a clear refusal (see chat_turns)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None
    tool_calls: list | None = None
    function_call: dict | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the usage
    # vLLM's extension (GuideLLM sends it, aiperf with --per-chunk-usage): with include_usage,
    # every chunk also carries the usage so far
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's API does;
    known fields of the wrong type or out of range are a 400."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    priority: int = 0  # vLLM's extension: lower is served first and preempted last
    user: str | None = Field(None, max_length=256)  # who sent it: the dashboard's label, per-user limits
    logprobs: bool | int | None = None  # refused (see refusal), never silently ignored
    top_logprobs: int | None = None
    # vLLM's extensions that benchmark clients send (vllm bench serve, GuideLLM, aiperf):
    ignore_eos: bool = False  # keep going past EOS (fixed output lengths)
    min_tokens: int = Field(0, ge=0)  # no stop token before this many tokens
    stop_token_ids: list[int] | None = None  # more tokens that end the answer
    top_k: int = Field(0, ge=0)  # sample among the k most likely (0: all)
    # fields that would change the answer and that this server does not do: refused unless
    # they ask for nothing (see refusal)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    best_of: int | None = None
    logit_bias: dict | None = None
    # structured output: OpenAI's response_format ({"type": "json_schema", "json_schema":
    # {"schema": ...}} or {"type": "json_object"}), or vLLM's structured_outputs ({"regex": ...},
    # {"choice": [...]}, {"json": schema}, {"json_object": true}); see ``structured``
    response_format: dict | None = None
    structured_outputs: dict | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    echo: bool = False  # the prompt in front of the answer: refused (see refusal)
    suffix: str | None = None  # text after the insertion point: refused


class Unsupported(ValueError):
    """A well-formed request asking for what this server does not do: a 400 naming ``param``."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


NO_TOOLS = "tool calls are not supported: this server only generates text"
# Known fields this server does not implement, with the values that ask for nothing
UNSUPPORTED_UNLESS = {
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_p": (0.0,),
    "best_of": (None, 1),
}


def refusal(req: SamplingFields) -> Unsupported | None:
    """Why the server cannot serve this request as asked, if it cannot (rather than
    ignoring a field that would change the answer's form)."""
    if req.logprobs is not None and req.logprobs is not False:
        return Unsupported("logprobs are not supported by this server", "logprobs")
    if req.top_logprobs:
        return Unsupported("top_logprobs are not supported by this server", "top_logprobs")
    for field, neutral in UNSUPPORTED_UNLESS.items():
        if getattr(req, field) not in neutral:
            return Unsupported(f"{field} is not supported by this server (only {neutral[0]!r})", field)
    try:
        structured(req)
    except Unsupported as e:
        return e
    if req.stream_options is not None and not req.stream:  # as vLLM: it would be silently unused
        return Unsupported("stream_options can only be given with stream: true", "stream_options")
    if req.logit_bias:  # {} and null ask for nothing
        return Unsupported("logit_bias is not supported by this server", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            return Unsupported("echo is not supported by this server: it sends the answer only", "echo")
        if req.suffix:
            return Unsupported("suffix (insertion) is not supported by this server", "suffix")
    if isinstance(req, ChatRequest):
        for field in ("tools", "functions"):
            if getattr(req, field):
                return Unsupported(NO_TOOLS, field)
        for field in ("tool_choice", "function_call"):
            if getattr(req, field) not in (None, "none"):
                return Unsupported(NO_TOOLS, field)
    return None


def structured(req: SamplingFields) -> StructuredOutputs | None:
    """What the answer must match, from ``response_format`` or ``structured_outputs`` (not
    both); None for plain text. A malformed one raises ``Unsupported`` naming its field. (Whether
    the grammar library can compile it is the engine's question: ``structured.CompileError``.)"""
    form = req.response_format
    form_type = None if form is None else form.get("type")
    if form_type not in (None, "text") and req.structured_outputs is not None:
        return _refuse("give response_format or structured_outputs, not both", "structured_outputs")
    if req.structured_outputs is not None:
        try:
            return StructuredOutputs.from_dict(req.structured_outputs)
        except ValueError as e:
            return _refuse(f"structured_outputs: {e}", "structured_outputs")
    if form_type in (None, "text"):
        return None
    if form_type == "json_object":
        return StructuredOutputs(json_object=True)
    if form_type != "json_schema":
        return _refuse(
            f"response_format type {form_type!r} is not supported (text, json_object or json_schema)",
            "response_format",
        )
    spec = form.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        return _refuse("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return StructuredOutputs(json=spec["schema"])  # strict or not, the schema is enforced


def _refuse(message: str, param: str):
    raise Unsupported(message, param)


def sampling_params(req: SamplingFields) -> SamplingParams:
    """The engine's ``SamplingParams`` for a request's body: OpenAI's fields and vLLM's
    extensions (``top_k``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, structured
    output). ``priority`` is the engine's order, given beside it; stop strings are the
    server's (the engine sees tokens only). A value the engine cannot take is a ValueError;
    call ``refusal`` first, or a malformed structured output raises ``Unsupported``."""
    max_new = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        max_new_tokens=max_new,
        min_new_tokens=min(req.min_tokens, max_new),
        ignore_eos=req.ignore_eos,
        stop_token_ids=req.stop_token_ids or (),
        structured_outputs=structured(req),
    )


def chat_turns(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them: role "developer" read as "system",
    content-part arrays joined into one text. Raises ``Unsupported`` for tool calls and
    for parts that are not text (images, audio, files)."""
    turns = []
    for i, message in enumerate(messages):
        if message.role in ("tool", "function") or message.tool_calls or message.function_call:
            raise Unsupported(NO_TOOLS, f"messages.{i}")
        content = message.content
        if isinstance(content, list):
            for k, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise Unsupported(
                        f"content part type {part.type!r} is not supported: this model reads text only",
                        f"messages.{i}.content.{k}",
                    )
            content = "".join(part.text for part in content)
        role = "system" if message.role == "developer" else message.role
        turns.append({"role": role, "content": content or ""})
    return turns


def error(
    status: int,
    message: str,
    error_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
):
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": error_type, "param": param, "code": code}},
    )
