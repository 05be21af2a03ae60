"""JSON answers that always serialize, whatever a sandbox or a request put in them.

Text from a sandbox (an exception's message, a type's name) or from a request (a field that
failed validation) may hold lone surrogates (``'\\ud800'``), which UTF-8 cannot encode, and
numbers may be NaN or infinite, which JSON has not. Either made the answer fail to render
(HTTP 500), and a stored result then failed every later read of its batch. So:

- :func:`clean_text` escapes lone surrogates (``\\ud800`` as those six characters) and
  :func:`clean` does that to every string of a JSON-ready value, turns non-finite floats into
  their names (``"nan"``, ``"inf"``) and cuts nesting at :data:`MAX_DEPTH`;
- :class:`SafeJSONResponse` and :func:`dumps` render with :func:`clean` when plain rendering
  fails (the fast path first: what the service stores is already clean);
- :func:`install` makes every error answer of the app a :class:`SafeJSONResponse` with a
  one-line ``detail``: request validation errors name the field and the problem, never echo
  the input (which may be hostile, huge or nested deeper than any encoder recurses).
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

#: nesting kept by :func:`clean` (deeper values become a marker string)
MAX_DEPTH = 32


def clean_text(s: str) -> str:
    """``s`` with each lone surrogate written as its escape (``\\ud800``): text that UTF-8
    encodes. Other characters are kept."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def clean(value: Any, depth: int = 0) -> Any:
    """A copy of the JSON-ready ``value`` that JSON and UTF-8 can encode: strings (keys too)
    through :func:`clean_text`, NaN and infinities as ``"nan"``/``"inf"``/``"-inf"``, other
    objects as their cleaned ``str``, nesting beyond :data:`MAX_DEPTH` as ``"..."``."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return clean_text(value)
    if depth >= MAX_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {clean_text(str(k)): clean(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v, depth + 1) for v in value]
    return clean_text(str(value))


def dumps(value: Any) -> str:
    """``value`` as compact JSON text that UTF-8 encodes (see :func:`clean`)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        text.encode("utf-8")
        return text
    except (ValueError, UnicodeEncodeError, RecursionError, TypeError):
        return json.dumps(clean(value), ensure_ascii=False, separators=(",", ":"))


class SafeJSONResponse(JSONResponse):
    """A JSON answer that renders whatever its content holds (see :func:`dumps`)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def validation_detail(errors: list[dict]) -> str:
    """One line naming each bad field and its problem, e.g. ``body.size: Input should be a
    valid integer``; the input itself is not echoed."""
    parts = []
    for err in errors[:10]:
        loc = ".".join(clean_text(str(x))[:64] for x in err.get("loc", ())) or "request"
        parts.append(f"{loc}: {clean_text(str(err.get('msg', 'invalid')))[:200]}")
    more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
    return "; ".join(parts) + more


def install(app: FastAPI) -> None:
    """Every error answer of ``app`` as a :class:`SafeJSONResponse` with a one-line
    ``detail`` (422 for a malformed request, naming the fields)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return SafeJSONResponse({"detail": validation_detail(exc.errors())}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        headers = dict(exc.headers or {})
        if exc.status_code in (408, 413):  # the body was not read whole: end the connection
            headers["Connection"] = "close"
        return SafeJSONResponse(
            {"detail": clean_text(detail)}, status_code=exc.status_code, headers=headers
        )
