from specserve.v1 import common_pb2 as _common_pb2
from specserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvOwnership(_message.Message):
    __slots__ = ("replica_id", "endpoint", "tokens")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    endpoint: str
    tokens: int
    def __init__(self, replica_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class KvSnapshot(_message.Message):
    __slots__ = ("fingerprint", "chunk_tokens", "chunks", "head")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    chunk_tokens: int
    chunks: int
    head: bytes
    def __init__(self, fingerprint: _Optional[bytes] = ..., chunk_tokens: _Optional[int] = ..., chunks: _Optional[int] = ..., head: _Optional[bytes] = ...) -> None: ...

class SessionRecord(_message.Message):
    __slots__ = ("schema_version", "session_id", "version", "state", "tokens", "turn_starts", "completion_start", "sampling", "max_new_tokens", "stop", "drafter", "k", "round_index", "draft", "target", "usage", "created_unix_ms", "updated_unix_ms", "keep", "kv_snapshot", "owner")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURN_STARTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_START_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    session_id: str
    version: int
    state: _generate_pb2.SessionState
    tokens: _containers.RepeatedScalarFieldContainer[int]
    turn_starts: _containers.RepeatedScalarFieldContainer[int]
    completion_start: int
    sampling: _common_pb2.SamplingConfig
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    drafter: _common_pb2.Drafter
    k: int
    round_index: int
    draft: KvOwnership
    target: KvOwnership
    usage: _generate_pb2.Usage
    created_unix_ms: int
    updated_unix_ms: int
    keep: bool
    kv_snapshot: KvSnapshot
    owner: bytes
    def __init__(self, schema_version: _Optional[int] = ..., session_id: _Optional[str] = ..., version: _Optional[int] = ..., state: _Optional[_Union[_generate_pb2.SessionState, str]] = ..., tokens: _Optional[_Iterable[int]] = ..., turn_starts: _Optional[_Iterable[int]] = ..., completion_start: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingConfig, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., drafter: _Optional[_Union[_common_pb2.Drafter, str]] = ..., k: _Optional[int] = ..., round_index: _Optional[int] = ..., draft: _Optional[_Union[KvOwnership, _Mapping]] = ..., target: _Optional[_Union[KvOwnership, _Mapping]] = ..., usage: _Optional[_Union[_generate_pb2.Usage, _Mapping]] = ..., created_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., keep: _Optional[bool] = ..., kv_snapshot: _Optional[_Union[KvSnapshot, _Mapping]] = ..., owner: _Optional[bytes] = ...) -> None: ...

class SessionDelta(_message.Message):
    __slots__ = ("version", "state", "round_index", "draft", "target", "usage", "updated_unix_ms", "kv_snapshot", "tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: _generate_pb2.SessionState
    round_index: int
    draft: KvOwnership
    target: KvOwnership
    usage: _generate_pb2.Usage
    updated_unix_ms: int
    kv_snapshot: KvSnapshot
    tokens: int
    def __init__(self, version: _Optional[int] = ..., state: _Optional[_Union[_generate_pb2.SessionState, str]] = ..., round_index: _Optional[int] = ..., draft: _Optional[_Union[KvOwnership, _Mapping]] = ..., target: _Optional[_Union[KvOwnership, _Mapping]] = ..., usage: _Optional[_Union[_generate_pb2.Usage, _Mapping]] = ..., updated_unix_ms: _Optional[int] = ..., kv_snapshot: _Optional[_Union[KvSnapshot, _Mapping]] = ..., tokens: _Optional[int] = ...) -> None: ...
