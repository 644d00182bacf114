"""The OpenAI server's errors: one shape for every failure, and the handlers that give it.

Every error a client sees is OpenAI's shape, {"error": {"message", "type", "param",
"code"}} with `code` the HTTP status: a bad field is a 400 naming it in `param`, an
unknown path a 404, an unexpected exception a 500 that names only its type (logged
here with its traceback, never sent). Code below the routes raises `APIError`; the
handlers `install_error_handlers` adds turn it, FastAPI's validation errors and
Starlette's HTTP errors into that shape.
"""

from __future__ import annotations

import fastapi
import pydantic
from absl import logging
from fastapi import responses
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException


class APIError(Exception):
  """A request's failure as the client should see it: `status`, OpenAI's `err_type`
  ("BadRequestError", ...), the request field at fault (`param`), extra `headers`
  (a 429's Retry-After)."""

  def __init__(self, status: int, message: str, param: str | None = None,
               err_type: str = "BadRequestError", headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.err_type = status, message, param, err_type
    self.headers = headers


def error_response(status: int, message: str, param: str | None = None,
                   err_type: str = "BadRequestError",
                   headers: dict | None = None) -> responses.JSONResponse:
  """The JSON response of an error, in OpenAI's shape."""
  return responses.JSONResponse(
      {"error": {"message": message, "type": err_type, "param": param, "code": status}},
      status_code=status, headers=headers)


class ErrorInfo(pydantic.BaseModel):
  message: str
  type: str
  param: str | None
  code: int


class ErrorResponse(pydantic.BaseModel):
  """Every error's body (OpenAI's shape; `code` is the HTTP status)."""

  error: ErrorInfo


def install_error_handlers(app: fastapi.FastAPI) -> None:
  """Every exception a route or FastAPI raises answers in the error shape: a body that
  fails validation is a 400 naming its first bad field (never FastAPI's 422), an
  `APIError` its own status, an unknown path or method its 404 / 405, anything else a
  500 (logged with its traceback)."""

  @app.exception_handler(RequestValidationError)
  async def _invalid(_request, exc: RequestValidationError):
    first = exc.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
      return error_response(400, f"the request body is not valid JSON: {first.get('msg')}")
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return error_response(400, f"{where}: {first.get('msg')}", param)

  @app.exception_handler(APIError)
  async def _api_error(_request, exc: APIError):
    return error_response(exc.status, exc.message, exc.param, exc.err_type, exc.headers)

  @app.exception_handler(HTTPException)
  async def _http_error(_request, exc: HTTPException):  # (an unknown path, a wrong method)
    return error_response(exc.status_code, str(exc.detail), None,
                          "NotFoundError" if exc.status_code == 404 else "BadRequestError",
                          exc.headers)  # (405's Allow)

  @app.exception_handler(Exception)
  async def _unexpected(_request, exc: Exception):
    logging.exception("request failed")
    return error_response(500, f"internal error ({type(exc).__name__})", None,
                          "InternalServerError")
