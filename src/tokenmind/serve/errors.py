"""Every failure leaves the server as OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`.

OpenAI clients read `error.message` and `error.param` to tell the user what to fix, so bad JSON,
wrong types, out-of-range values and engine rejections all become a 4xx naming the field,
never a bare 500 or FastAPI's own `{"detail": ...}`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tokenmind.serve")


class APIError(Exception):
    """An error to answer with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for the OpenAPI description."""

    error: ErrorDetail


# What each error status means here, for the OpenAPI description of the routes that can return it.
STATUS_MEANINGS = {
    400: "invalid request: bad JSON, a wrong type or value, a prompt too long, an uncompilable schema "
         "(`error.param` names the field)",
    401: "missing or wrong `Authorization: Bearer` key (only when the server has an API key)",
    404: "no such model (see GET /v1/models)",
    413: "the request body is larger than the server accepts",
    429: "too many requests running and queued; retry after the `Retry-After` header's seconds",
    500: "generation failed inside the engine",
    503: "not ready, shutting down, overloaded (waited too long in the queue; `Retry-After`), or the engine failed",
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that may answer with these error statuses."""
    return {status: {"model": ErrorResponse, "description": STATUS_MEANINGS[status]} for status in statuses}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(exc: RequestValidationError) -> APIError:
    """The most specific problem pydantic found, with `param` as the dotted path inside the JSON body.

    A union field (`stop`: string or list of strings) yields one error per branch; the deepest one
    (inside the list, say) is the one that says what is wrong.
    """
    errors = exc.errors()
    err = max(errors, key=lambda e: len(_fields(e.get("loc", ())))) if errors else {}
    kind, value = err.get("type"), err.get("input")
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')}); "
                             "send a JSON object", code="invalid_json")
    param = ".".join(_fields(err.get("loc", ()))) or None
    if param is None and (kind == "missing" or isinstance(value, bytes)):
        return APIError(400, "the request has no JSON body; send a JSON object with Content-Type: application/json",
                        code="invalid_json")
    if param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        return APIError(400, f"the request body must be a JSON object, got {_short(value)}", code="invalid_json")
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind not in ("missing", "value_error"):
        message += f" (got {_short(value)})"
    return APIError(400, f"{param or 'body'}: {message}", param=param, code="invalid_value")


def _fields(loc: tuple) -> list[str]:
    """The JSON path in a pydantic error location, without `body` and union branch tags like `list[str]`."""
    return [str(part) for part in loc[1:] if isinstance(part, int) or re.fullmatch(r"[a-z_][a-z0-9_]*", part)
            and part not in ("str", "int", "float", "bool")]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Route FastAPI's validation errors, HTTP errors and anything unexpected into OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += "; the API lives under /v1 (/v1/chat/completions, /v1/completions, /v1/models)"
        return APIError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {exc!r}", type="server_error").response()
