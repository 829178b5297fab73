from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSession(_message.Message):
    __slots__ = ("session_id", "start", "new_tokens", "k", "sampling", "round_index", "drafter", "min_confidence")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: _common_pb2.SamplingConfig
    round_index: int
    drafter: _common_pb2.Drafter
    min_confidence: float
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingConfig, _Mapping]] = ..., round_index: _Optional[int] = ..., drafter: _Optional[_Union[_common_pb2.Drafter, str]] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("sessions", "strict")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[DraftSession]
    strict: bool
    def __init__(self, sessions: _Optional[_Iterable[_Union[DraftSession, _Mapping]]] = ..., strict: _Optional[bool] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("session_id", "status", "tokens", "q")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _common_pb2.SessionStatus
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _common_pb2.SparseQ
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.SessionStatus, str]] = ..., tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[_common_pb2.SparseQ, _Mapping]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("results", "compute_ns", "replica_id", "batch_size")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DraftResult]
    compute_ns: int
    replica_id: str
    batch_size: int
    def __init__(self, results: _Optional[_Iterable[_Union[DraftResult, _Mapping]]] = ..., compute_ns: _Optional[int] = ..., replica_id: _Optional[str] = ..., batch_size: _Optional[int] = ...) -> None: ...
