"""The HTTP API's error shape (OpenAI's), without pydantic: what the engine glue
(openai/api.py) raises and what every endpoint answers with, SGLang's worker routes
(sglang/worker.py) included."""

from __future__ import annotations

from typing import Any, Literal

Endpoint = Literal["completion", "chat"]
Message = dict[str, Any]


class ApiError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> Message:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": err}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
