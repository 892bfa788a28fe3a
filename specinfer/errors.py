"""Error types shared by the engine, the CLI and the services.

`UserError` is bad input that the caller can fix: the CLI prints it on one line and exits
with code 2, and the gRPC interceptor maps it to INVALID_ARGUMENT.
"""

import math


class UserError(ValueError):
    """Input the caller can fix (bad path, bad flag, bad prompt)."""


class CapacityError(RuntimeError):
    """The KV cache or the request queue is full (gRPC RESOURCE_EXHAUSTED). `retry_after_s`: when
    a retry is predicted to be admitted (None: unknown); the gRPC trailers carry it as
    `retry-after` (whole seconds) and `grpc-retry-pushback-ms`, HTTP as `Retry-After`."""

    def __init__(self, message: str = "", retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_whole_s(self) -> int | None:
        """The hint in whole seconds (HTTP's Retry-After has no fractions), at least 1."""
        return None if self.retry_after_s is None else max(1, math.ceil(self.retry_after_s))


class NotFoundError(LookupError):
    """An unknown request or session id (gRPC NOT_FOUND)."""


class UnavailableError(RuntimeError):
    """A dependency (Redis, the verifier) cannot be reached (gRPC UNAVAILABLE)."""


EXIT_CANNOT_BIND = 98  # a service's exit code when a port it serves on is taken (as errno EADDRINUSE)


class BindError(OSError):
    """A server cannot listen on its address (most often: another process holds the port).
    `what` names the listener: "gRPC API", "HTTP API" or "metrics endpoint"."""

    def __init__(self, what: str, host: str, port: int, reason: str):
        super().__init__(f"cannot bind the {what} to {host}:{port}: {reason}")
        self.what, self.host, self.port, self.reason = what, host, port, reason


class PeerError(RuntimeError):
    """A call to another service failed. `cause` is the error its status stands for (one of the
    above, a TimeoutError, or a RuntimeError naming the status); `is_resumable` says whether a
    later call may carry the request on (the peer was unreachable, slow or full, or the call was
    cancelled)."""

    def __init__(self, cause: Exception, is_resumable: bool):
        super().__init__(str(cause))
        self.cause = cause
        self.is_resumable = is_resumable
