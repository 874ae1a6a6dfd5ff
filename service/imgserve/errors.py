"""The one error type a client ever sees: an HTTP status with a JSON body {"error": {"code", "message"}}, or on the
Open Inference Protocol's routes (/v2...) that protocol's own body {"error": "message"}."""

from __future__ import annotations

from http import HTTPStatus

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse


class ApiError(Exception):
    """A request-level failure: raise it in a hook to answer that request with `status` and a JSON error
    {"error": {"code": code, "message": message}} (and Retry-After when `retry_after` is set)."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(status, code, message, retry_after)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    def response(self, path: str = "") -> JSONResponse:
        """The HTTP answer for this error, in the envelope of the protocol that `path` belongs to."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        v2 = path == "/v2" or path.startswith("/v2/")
        body = {"error": self.message} if v2 else {"error": {"code": self.code, "message": self.message}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def from_exception(exc: BaseException) -> ApiError | None:
    """The ApiError a hook's exception answers with: itself, or Starlette's / FastAPI's / LitServe's HTTPException
    as its status and detail; None for any other exception (a fault: 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StarletteHTTPException):
        code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_").replace("-", "_")
        return ApiError(exc.status_code, code, str(exc.detail))
    return None


def fault(exc: BaseException, where: str) -> ApiError:
    """The 500 for an unexpected exception in `where` (a hook): one line naming it, never the traceback."""
    return ApiError(500, "api_error", f"{where} failed: {type(exc).__name__}: {exc}"[:300])


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """404, 405 and Starlette's other HTTP errors, in the envelope (FastAPI would answer {"detail": ...})."""
    if not isinstance(exc, StarletteHTTPException):  # registered for it only
        return await internal_error(request, exc)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"[:200]
    response = ApiError(exc.status_code, code, message).response(request.url.path)
    response.headers.update(exc.headers or {})  # Allow, for a 405
    return response


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """An unexpected exception: a 500 envelope; uvicorn logs the traceback and closes, so the client is told."""
    response = ApiError(500, "internal_error", "the server failed on this request").response(request.url.path)
    response.headers["Connection"] = "close"
    return response


def install_handlers(app: Starlette) -> None:
    """Every error the application answers is the JSON envelope, whatever raised it."""
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
