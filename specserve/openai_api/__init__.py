"""The OpenAI-compatible HTTP API: a thin front door over the public gRPC ``Generation`` API.

See ``docs/openai-api.md``. Nothing here decodes tokens or holds sessions: each HTTP
request becomes one gRPC call per choice on the orchestrator, carrying the caller's
``Authorization`` header and trace context, so limits, authentication and tracing
are the gRPC API's own.
"""
