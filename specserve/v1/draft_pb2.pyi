from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSession(_message.Message):
    __slots__ = ("session_id", "start", "new_tokens", "k", "sampling", "round_index", "drafter")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: _common_pb2.SamplingConfig
    round_index: int
    drafter: _common_pb2.Drafter
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingConfig, _Mapping]] = ..., round_index: _Optional[int] = ..., drafter: _Optional[_Union[_common_pb2.Drafter, str]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[DraftSession]
    def __init__(self, sessions: _Optional[_Iterable[_Union[DraftSession, _Mapping]]] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("session_id", "status", "tokens", "support", "q_ids", "q_probs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _common_pb2.SessionStatus
    tokens: _containers.RepeatedScalarFieldContainer[int]
    support: int
    q_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.SessionStatus, str]] = ..., tokens: _Optional[_Iterable[int]] = ..., support: _Optional[int] = ..., q_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("results", "compute_ns", "replica_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DraftResult]
    compute_ns: int
    replica_id: str
    def __init__(self, results: _Optional[_Iterable[_Union[DraftResult, _Mapping]]] = ..., compute_ns: _Optional[int] = ..., replica_id: _Optional[str] = ...) -> None: ...
