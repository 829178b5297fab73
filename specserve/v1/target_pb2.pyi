from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifySession(_message.Message):
    __slots__ = ("session_id", "start", "new_tokens", "draft_tokens", "q", "sampling", "round_index", "return_logprobs", "top_logprobs", "steps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _common_pb2.SparseQ
    sampling: _common_pb2.SamplingConfig
    round_index: int
    return_logprobs: bool
    top_logprobs: int
    steps: int
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[_common_pb2.SparseQ, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingConfig, _Mapping]] = ..., round_index: _Optional[int] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("sessions", "strict")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[VerifySession]
    strict: bool
    def __init__(self, sessions: _Optional[_Iterable[_Union[VerifySession, _Mapping]]] = ..., strict: _Optional[bool] = ...) -> None: ...

class PrefillSession(_message.Message):
    __slots__ = ("session_id", "tokens", "sampling", "round_index", "return_logprobs", "top_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingConfig
    round_index: int
    return_logprobs: bool
    top_logprobs: int
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingConfig, _Mapping]] = ..., round_index: _Optional[int] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[PrefillSession]
    def __init__(self, sessions: _Optional[_Iterable[_Union[PrefillSession, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("session_id", "status", "accepted", "next_token", "logprobs", "decoded", "token_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _common_pb2.SessionStatus
    accepted: int
    next_token: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    decoded: _containers.RepeatedScalarFieldContainer[int]
    token_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.SessionStatus, str]] = ..., accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., decoded: _Optional[_Iterable[int]] = ..., token_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "compute_ns", "batch_size", "replica_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    compute_ns: int
    batch_size: int
    replica_id: str
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., compute_ns: _Optional[int] = ..., batch_size: _Optional[int] = ..., replica_id: _Optional[str] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("key", "fingerprint", "layout", "start", "tokens", "data", "digest")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    fingerprint: bytes
    layout: KvLayout
    start: int
    tokens: int
    data: bytes
    digest: bytes
    def __init__(self, key: _Optional[bytes] = ..., fingerprint: _Optional[bytes] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., start: _Optional[int] = ..., tokens: _Optional[int] = ..., data: _Optional[bytes] = ..., digest: _Optional[bytes] = ...) -> None: ...

class ExportKvRequest(_message.Message):
    __slots__ = ("session_id", "chunk_tokens", "tokens", "first_chunk")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    chunk_tokens: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    first_chunk: int
    def __init__(self, session_id: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., first_chunk: _Optional[int] = ...) -> None: ...

class ExportKvResponse(_message.Message):
    __slots__ = ("chunks", "compute_ns", "replica_id")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[KvChunk]
    compute_ns: int
    replica_id: str
    def __init__(self, chunks: _Optional[_Iterable[_Union[KvChunk, _Mapping]]] = ..., compute_ns: _Optional[int] = ..., replica_id: _Optional[str] = ...) -> None: ...

class ImportKvRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "start", "chunks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    start: int
    chunks: _containers.RepeatedCompositeFieldContainer[KvChunk]
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[KvChunk, _Mapping]]] = ...) -> None: ...

class ImportKvResponse(_message.Message):
    __slots__ = ("tokens", "compute_ns", "replica_id")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    compute_ns: int
    replica_id: str
    def __init__(self, tokens: _Optional[int] = ..., compute_ns: _Optional[int] = ..., replica_id: _Optional[str] = ...) -> None: ...
