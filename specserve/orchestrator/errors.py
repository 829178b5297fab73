"""Typed errors of the orchestrator and the status codes they map to.

The draft and target services map engine errors in
:class:`specserve.serving.errors.ErrorInterceptor`; the orchestrator adds the
errors of sessions shared between replicas and reuses that table for the rest
(:func:`status_for`). Its interceptor wraps streaming handlers too, because
``GenerateStream`` is the main public call.
"""

from __future__ import annotations

import grpc

from specserve.engine.errors import EngineError
from specserve.orchestrator.fleet.scheduler import NoReplica
from specserve.serving import errors as serving_errors


class VersionConflict(EngineError):
    """Another writer changed the session record since it was read (ABORTED)."""


class SessionBusy(EngineError):
    """A generation is already running on this session (FAILED_PRECONDITION)."""


class SessionCancelled(EngineError):
    """The session was cancelled with CancelSession: it cannot be continued, and no write
    may end it other than CANCELLED (FAILED_PRECONDITION)."""


class RecordError(EngineError):
    """A stored record cannot be read: corrupt, or written by a newer schema (INTERNAL)."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (VersionConflict, grpc.StatusCode.ABORTED),
    (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionCancelled, grpc.StatusCode.FAILED_PRECONDITION),
    (NoReplica, grpc.StatusCode.UNAVAILABLE),
)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a public call that raised ``error`` is answered with."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code, str(error)
    return serving_errors.status_for(error)
