"""A request body, bounded and decoded, refused with an OpenAI error body when it is hostile.

* :func:`read` enforces ``--max-body-bytes`` before anything is parsed: a declared
  ``Content-Length`` over the limit is refused unread, and a chunked body is refused
  as soon as its bytes pass the limit (413, ``code`` ``request_too_large``).
* :func:`decode` turns the bytes into JSON values or raises a 400: bytes that are not
  UTF-8 JSON, JSON nested deeper than the parser's recursion limit (a body of 100,000
  ``[`` is a ``RecursionError`` inside :func:`json.loads`, not a crash), and strings
  that are not valid Unicode (``"\\ud800"``, a lone surrogate, is valid JSON but cannot
  be encoded as UTF-8 for the gRPC request nor echoed in a JSON reply). The 400 names
  the offending field in ``param``.

Both run before the body's values reach any other code, so nothing after them sees
a string protobuf would refuse to encode.
"""

from __future__ import annotations

import json

from starlette.requests import Request

from specserve.openai_api.errors import ApiError, bad_request


def too_large(size: int | str, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is {size} bytes; at most {limit} are accepted "
        "(the server's --max-body-bytes)",
        "invalid_request_error",
        code="request_too_large",
    )


async def read(request: Request, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes (raises a 413 :class:`ApiError` past it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode(raw: bytes) -> object:
    """The JSON value of ``raw`` with every string valid Unicode (raises a 400)."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request(
            "the request body nests JSON arrays or objects too deeply to be a request"
        ) from None
    where = _invalid_text(value)
    if where is not None:
        field, what = where
        raise bad_request(
            f"{what} of {field or 'the request body'} is not valid Unicode (a lone "
            "surrogate such as \\ud800?): strings must be encodable as UTF-8",
            field or None,
        )
    return value


def _valid(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid_text(value: object) -> tuple[str, str] | None:
    """(the field's path, "a string" or "a key") of the first string that is not valid
    Unicode, or None. Iterative, so any depth the parser produced is walked; the items
    of a list that are not containers or strings (token ids) are skipped cheaply."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _valid(item):
                return path, "a string"
        elif isinstance(item, dict):
            for key, child in item.items():
                if not _valid(key):
                    return path, "a key"
                if isinstance(child, str | list | dict):
                    stack.append((child, f"{path}.{key}" if path else key))
        elif isinstance(item, list):
            for i, child in enumerate(item):
                if isinstance(child, str | list | dict):
                    stack.append((child, f"{path}[{i}]"))
    return None
