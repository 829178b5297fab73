"""Typed errors raised by the engine for bad input or exhausted resources.

Servers map these to gRPC status codes in one interceptor; the CLI prints their
message. Internal invariants use ``assert`` instead.
"""


class EngineError(Exception):
    """Base class for errors a caller can act on."""


class InvalidArgument(EngineError):
    """The request itself is wrong (bad parameter, unknown drafter, bad token id)."""


class NotFound(EngineError):
    """A session, model or file that the request names does not exist."""


class FailedPrecondition(EngineError):
    """The request is well formed but this replica's state does not allow it (e.g. KV
    chunks of another model, or a cache shorter than the call assumes)."""


class KVBudgetExceeded(EngineError):
    """The KV pool cannot hold the tokens asked for, even after evicting idle sessions."""


class ModelLoadError(EngineError):
    """A checkpoint could not be read or is of an unsupported architecture."""
