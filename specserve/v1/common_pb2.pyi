from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLING_RULE_UNSPECIFIED: _ClassVar[SamplingRule]
    SAMPLING_RULE_COUPLED: _ClassVar[SamplingRule]
    SAMPLING_RULE_REJECTION: _ClassVar[SamplingRule]

class Drafter(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_UNSPECIFIED: _ClassVar[Drafter]
    DRAFTER_MODEL: _ClassVar[Drafter]
    DRAFTER_NGRAM: _ClassVar[Drafter]
    DRAFTER_NONE: _ClassVar[Drafter]

class SessionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATUS_UNSPECIFIED: _ClassVar[SessionStatus]
    SESSION_STATUS_OK: _ClassVar[SessionStatus]
    SESSION_STATUS_NEEDS_HISTORY: _ClassVar[SessionStatus]
SAMPLING_RULE_UNSPECIFIED: SamplingRule
SAMPLING_RULE_COUPLED: SamplingRule
SAMPLING_RULE_REJECTION: SamplingRule
DRAFTER_UNSPECIFIED: Drafter
DRAFTER_MODEL: Drafter
DRAFTER_NGRAM: Drafter
DRAFTER_NONE: Drafter
SESSION_STATUS_UNSPECIFIED: SessionStatus
SESSION_STATUS_OK: SessionStatus
SESSION_STATUS_NEEDS_HISTORY: SessionStatus

class SamplingConfig(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "rule")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    rule: SamplingRule
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., rule: _Optional[_Union[SamplingRule, str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs", "token", "top_tokens")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token: str
    top_tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., token: _Optional[str] = ..., top_tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class SparseQ(_message.Message):
    __slots__ = ("support", "ids", "probs")
    SUPPORT_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    support: int
    ids: bytes
    probs: bytes
    def __init__(self, support: _Optional[int] = ..., ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("replica_id", "role", "model", "sessions", "kv_bytes_used", "kv_bytes_free", "queue_depth", "tp_size", "dtype", "kv_fingerprint", "kv_bytes_per_token", "data_port", "progress_steps", "busy", "model_cpu_ns", "max_context_tokens", "kv_capacity_tokens")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FREE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    MODEL_CPU_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    role: str
    model: str
    sessions: int
    kv_bytes_used: int
    kv_bytes_free: int
    queue_depth: int
    tp_size: int
    dtype: str
    kv_fingerprint: bytes
    kv_bytes_per_token: int
    data_port: int
    progress_steps: int
    busy: bool
    model_cpu_ns: int
    max_context_tokens: int
    kv_capacity_tokens: int
    def __init__(self, replica_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., sessions: _Optional[int] = ..., kv_bytes_used: _Optional[int] = ..., kv_bytes_free: _Optional[int] = ..., queue_depth: _Optional[int] = ..., tp_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_fingerprint: _Optional[bytes] = ..., kv_bytes_per_token: _Optional[int] = ..., data_port: _Optional[int] = ..., progress_steps: _Optional[int] = ..., busy: _Optional[bool] = ..., model_cpu_ns: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ...) -> None: ...

class CallHeader(_message.Message):
    __slots__ = ("request_id", "timeout_ms", "traceparent", "tracestate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    timeout_ms: int
    traceparent: str
    tracestate: str
    def __init__(self, request_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class AnswerHeader(_message.Message):
    __slots__ = ("request_id", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error: CallError
    def __init__(self, request_id: _Optional[int] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
