"""Process logging: every line carries the current trace and span ids; text or JSON.

The ids come from the OpenTelemetry context of the code that logs, so a line
written while a request is handled — on the event loop, or on a model thread
that attached the request's context — can be found from its trace and back.
Outside any span they are ``-`` (text) or absent (JSON).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from opentelemetry import trace

from specserve.telemetry.config import LogConfig

TEXT_FORMAT = (
    "%(asctime)s %(levelname)s %(name)s [trace=%(trace_id)s span=%(span_id)s]: %(message)s"
)


class TraceIds(logging.Filter):
    """Adds ``trace_id`` and ``span_id`` (hex, or ``-``) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            record.trace_id = format(ctx.trace_id, "032x")
            record.span_id = format(ctx.span_id, "016x")
        else:
            record.trace_id = record.span_id = "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, ids, service, exception."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": self.service,
        }
        trace_id = getattr(record, "trace_id", "-")
        if trace_id != "-":
            out["trace_id"] = trace_id
            out["span_id"] = record.span_id  # type: ignore[attr-defined]
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(config: LogConfig, service: str) -> None:
    """Replace the root logger's handlers with one stderr handler in the configured format."""
    handler = logging.StreamHandler()
    handler.addFilter(TraceIds())
    if config.format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level)
