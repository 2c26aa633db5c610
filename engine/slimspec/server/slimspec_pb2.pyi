from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class InferRequest(_message.Message):
    __slots__ = ("input", "max_length", "temperature", "top_p", "seed", "stop", "include_input")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_INPUT_FIELD_NUMBER: _ClassVar[int]
    input: str
    max_length: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_input: bool
    def __init__(self, input: _Optional[str] = ..., max_length: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., include_input: _Optional[bool] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("output", "latency_ms", "compression_ratio", "model_version", "prompt_tokens", "completion_tokens", "finish_reason")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    output: str
    latency_ms: float
    compression_ratio: float
    model_version: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    def __init__(self, output: _Optional[str] = ..., latency_ms: _Optional[float] = ..., compression_ratio: _Optional[float] = ..., model_version: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class ErrorResponse(_message.Message):
    __slots__ = ("error", "message")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    error: str
    message: str
    def __init__(self, error: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
