"""The one error type a client ever sees: an HTTP status with a JSON body {"error": {"code", "message"}}."""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    """A request-level failure; picklable so inference workers can return it for a single item of a batch."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(status, code, message, retry_after)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    def response(self) -> JSONResponse:
        """The HTTP answer for this error."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        body = {"error": {"code": self.code, "message": self.message}}
        return JSONResponse(body, status_code=self.status, headers=headers)
