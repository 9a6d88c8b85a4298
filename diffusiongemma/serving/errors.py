"""Errors in the shape OpenAI clients parse: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx
status, the field at fault in `param` (a dotted path such as `messages.0.content`)."""

from __future__ import annotations

import dataclasses

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          408: "timeout", 413: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable",
          504: "timeout"}


@dataclasses.dataclass
class APIError(Exception):
  """A request that is answered with an error: HTTP `status` and the OpenAI error body."""

  status: int
  message: str
  param: str | None = None
  code: str | None = None
  type: str | None = None

  def __post_init__(self):
    super().__init__(self.message)
    if self.type is None:
      self.type = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
  """A 400 naming the field `param`."""
  return APIError(400, message, param, code)


def unsupported(param: str, message: str) -> APIError:
  return APIError(400, message, param, "unsupported_parameter")
