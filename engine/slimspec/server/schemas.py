"""Request/response bodies. Unknown fields are rejected where the API is ours (/infer).
The OpenAI routes keep the fields they do not model (pydantic extra="allow") and
openai_fields.py decides: ignored when they only describe the caller, otherwise
refused with a 400 naming them unless they carry their neutral value."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from slimspec.decoding.types import MAX_TOP_LOGPROBS

MAX_STOPS = 4
MAX_STOP_CHARS = 256  # per stop sequence; streaming holds back up to this many characters
INT64 = 2**63
MAX_CHOICES = 16  # n: choices per request (each is a row of the batch)


def _encodable(v: str) -> str:
    # JSON can carry lone surrogates ("\ud800"); they are not text and would break tokenizers.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("string is not valid Unicode (lone surrogate)") from None
    return v


def _stops(v: str | list[str] | None) -> list[str]:
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if len(items) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences")
    for s in items:
        if not s:
            raise ValueError("stop sequences must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        _encodable(s)
    return items


def _as_float(v: Any) -> Any:
    """Ints are fine for float fields (strict mode would refuse 1); an int too large for
    a float is out of range, not a server error."""
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:
            raise ValueError("number is far out of range") from None
    return v


class InferRequest(BaseModel):
    """POST /infer. max_length = most NEW tokens to generate; output starts with the input."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: Annotated[str, Field(min_length=1, description="prompt text")]
    max_length: Annotated[int, Field(ge=1, description="most new tokens to generate")] = 50
    temperature: Annotated[float, Field(ge=0.0, le=5.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: list[str] | str | None = None
    include_input: bool = True
    format: Literal["text", "json"] = "text"

    @field_validator("input")
    @classmethod
    def _input_text(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("input must contain non-whitespace text")
        return _encodable(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        return _stops(v)

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _int_ok(cls, v: Any) -> Any:
        return _as_float(v)


class InferResponse(BaseModel):
    output: Any  # text, or the parsed JSON value with format="json"
    latency_ms: float
    compression_ratio: float
    model_version: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


class _OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="allow")  # judged by openai_fields.check_extra_fields

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM's extension; -1 and 0: off
    seed: Annotated[int, Field(ge=-INT64, lt=2 * INT64)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        return _stops(v)

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        return None if v is None else v % INT64  # OpenAI allows negative seeds


NonEmpty = Annotated[str, Field(min_length=1)]


class CompletionRequest(_OpenAIBase):
    # One prompt, as a string or a one-item list: the OpenAPI document says so, so that
    # clients generated from it (and schemathesis) send what is served
    prompt: NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]
    echo: bool | None = False
    # the emitted tokens' log-probabilities with this many alternatives each
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str]) -> str | list[str]:
        # the field's constraints have checked one non-empty prompt already
        return _encodable(v[0] if isinstance(v, list) else v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An earlier turn's tool calls and a tool result's call id: rendered by the model's
    # chat template, or refused when it cannot (dropping them would be a silent
    # downgrade: openai_api.py).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: Any = None  # the legacy form: refused

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return _encodable(self.content)
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(_encodable(p["text"]))
        return "".join(parts)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # forced calls always follow the schema (tools.py)


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_OpenAIBase):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: dict[str, Any] | None = None  # text | json_object | json_schema
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # default true, as OpenAI's

    @property
    def logprobs_top(self) -> int | None:
        """Alternatives per position when log-probabilities are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None


class AdminSwapRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: Annotated[str, Field(min_length=1)]
    draft: str | None = None  # None or "none": target-only
    version: Annotated[str, Field(min_length=1, max_length=128)]
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    device: str | None = None
    wait: bool = True  # False: answer 202 at once, swap in the background


class AdminDrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    # keep answering new requests this long after readiness turns 503 (endpoint removal
    # propagating to every proxy), then refuse them
    delay_s: Annotated[float, Field(ge=0, le=600)] = 0.0
