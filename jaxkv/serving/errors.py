"""`ClientError`: a request the client must fix, answered as OpenAI answers it: HTTP
`status` (400 unless said otherwise) with `{"error": {"message", "type", "param",
"code"}}`, `param` naming the field at fault."""

from __future__ import annotations

__all__ = ["ClientError"]


class ClientError(ValueError):
    """A request the client must fix: HTTP `status` with OpenAI's error object."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        }
