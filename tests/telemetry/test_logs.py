"""Log lines carry the current trace and span ids, in text and in JSON."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from specserve.telemetry.config import LogConfig
from specserve.telemetry.logs import JsonFormatter, TraceIds, setup_logging


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, restored after the test (setup_logging replaces its handlers)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield root
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


def capture(root: logging.Logger) -> io.StringIO:
    """Point the handler setup_logging installed at a buffer."""
    [handler] = root.handlers
    assert isinstance(handler, logging.StreamHandler)
    buf = io.StringIO()
    handler.setStream(buf)
    return buf


def test_text_lines_carry_ids_inside_a_span(root_logger: logging.Logger) -> None:
    setup_logging(LogConfig("text", "INFO"), "specserve-test")
    buf = capture(root_logger)
    log = logging.getLogger("specserve.test")
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("work") as span:
        log.info("inside")
    log.info("outside")
    log.debug("not at INFO")
    inside, outside = buf.getvalue().splitlines()
    ctx = span.get_span_context()
    ids = f"[trace={ctx.trace_id:032x} span={ctx.span_id:016x}]"
    assert inside.endswith(f" INFO specserve.test {ids}: inside")
    assert "[trace=- span=-]: outside" in outside


def test_json_lines_parse_and_carry_ids(root_logger: logging.Logger) -> None:
    setup_logging(LogConfig("json", "DEBUG"), "specserve-draft")
    buf = capture(root_logger)
    log = logging.getLogger("specserve.test")
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("work") as span:
        log.debug("with %s", "args")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    log.warning("no span")
    first, second, third = (json.loads(line) for line in buf.getvalue().splitlines())
    ctx = span.get_span_context()
    assert first["message"] == "with args" and first["level"] == "DEBUG"
    assert first["trace_id"] == f"{ctx.trace_id:032x}" and first["span_id"] == f"{ctx.span_id:016x}"
    assert first["service"] == "specserve-draft" and first["logger"] == "specserve.test"
    assert first["time"].endswith("Z")
    assert "ValueError: boom" in second["exception"]
    assert "trace_id" not in third and third["level"] == "WARNING"


def test_formatter_alone_without_the_filter() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "plain", (), None)
    assert TraceIds().filter(record) and record.trace_id == "-"  # type: ignore[attr-defined]
    assert "trace_id" not in json.loads(JsonFormatter("s").format(record))
