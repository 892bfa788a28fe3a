"""gRPC plumbing shared by the gateway, verifier and speculator services.

One interceptor maps exceptions to status codes; every server gets grpc.health.v1 and server
reflection; SIGTERM flips health to NOT_SERVING and drains in-flight RPCs within a grace period.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specinfer.errors import CapacityError, NotFoundError, UnavailableError, UserError
from specinfer.serving.metrics import RpcMetrics

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping from exceptions to gRPC status codes."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code(), exc.details() or str(exc)
    if isinstance(exc, (UserError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0] if exc.args else exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, (UnavailableError, ConnectionError)):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, exc: BaseException):
    code, details = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in RPC", exc_info=exc)
    context.abort(code, details)


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns exceptions raised by servicers (also mid-stream) into proper gRPC statuses, and
    counts every RPC's outcome when given metrics."""

    def __init__(self, metrics: RpcMetrics | None = None):
        self.metrics = metrics

    def _record(self, method: str, code: grpc.StatusCode, start: float) -> None:
        if self.metrics is not None:
            service = self.metrics.service
            self.metrics.requests.labels(service, method, code.name).inc()
            self.metrics.latency.labels(service, method).observe(time.monotonic() - start)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]

        def wrap_unary(fn):
            def wrapped(request, context):
                start, code = time.monotonic(), grpc.StatusCode.OK
                try:
                    return fn(request, context)
                except Exception as exc:  # noqa: BLE001 - the one place exceptions become statuses
                    if context.code() is not None and context.code() != grpc.StatusCode.OK:
                        code = context.code()
                        raise
                    code = status_for(exc)[0]
                    _abort(context, exc)
                finally:
                    self._record(method, code, start)

            return wrapped

        def wrap_stream(fn):
            def wrapped(request, context):
                start, code = time.monotonic(), grpc.StatusCode.OK
                try:
                    yield from fn(request, context)
                except GeneratorExit:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except Exception as exc:  # noqa: BLE001
                    if context.code() is not None and context.code() != grpc.StatusCode.OK:
                        code = context.code()
                        raise
                    code = status_for(exc)[0]
                    _abort(context, exc)
                finally:
                    self._record(method, code, start)

            return wrapped

        if handler.unary_unary:
            return handler._replace(unary_unary=wrap_unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=wrap_unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=wrap_stream(handler.unary_stream))
        if handler.stream_stream:
            return handler._replace(stream_stream=wrap_stream(handler.stream_stream))
        return handler


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # internal services are not exposed by default
    port: int = 0
    max_workers: int = 64
    grace_s: float = 10.0
    max_connection_age_s: int = 300


class RunningServer:
    """A started gRPC server with its health service; `stop` drains within the grace period."""

    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 service_names: list[str], grace_s: float, on_stop: Callable[[], None] | None):
        self.server = server
        self.port = port
        self.health = health_servicer
        self.service_names = service_names
        self.grace_s = grace_s
        self._on_stop = on_stop
        self._stopped = threading.Event()

    def set_serving(self, is_serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace_s: float | None = None) -> None:
        if self._stopped.is_set():
            return
        self.set_serving(False)
        done = self.server.stop(self.grace_s if grace_s is None else grace_s)
        done.wait()
        if self._on_stop:
            self._on_stop()
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: NOT_SERVING first, then drain in-flight work, then exit."""

        def handler(signum, _frame):
            log.info("signal %s: draining for up to %.1fs", signum, self.grace_s)
            threading.Thread(target=self.stop, daemon=True).start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def start_server(
    cfg: ServerConfig,
    add_servicers: list[Callable[[grpc.Server], None]],
    service_names: list[str],
    on_stop: Callable[[], None] | None = None,
    rpc_metrics: RpcMetrics | None = None,
) -> RunningServer:
    """Builds, starts and returns a server with the error interceptor, health and reflection."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.max_workers),
        interceptors=[ErrorInterceptor(rpc_metrics)],
        # Clients re-resolve DNS only when a connection closes: cycling connections lets them
        # find replicas added by scaling; open streams get the grace period to finish.
        options=CHANNEL_OPTIONS + [("grpc.max_connection_age_ms", cfg.max_connection_age_s * 1000),
                                   ("grpc.max_connection_age_grace_ms", int(cfg.grace_s * 1000) + 600_000)],
        maximum_concurrent_rpcs=None,
    )
    for add in add_servicers:
        add(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names) + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    address = f"{cfg.host}:{cfg.port}"
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    server.start()
    running = RunningServer(server, port, health_servicer, service_names, cfg.grace_s, on_stop)
    running.set_serving(True)
    log.info("serving %s on %s:%d", ", ".join(service_names), cfg.host, port)
    return running


def remaining_timeout(context: grpc.ServicerContext, default_s: float) -> float:
    """The caller's remaining time, or `default_s` when it set no deadline."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e8:
        return default_s
    return max(0.0, remaining)


def start_model_server(service: str, host: str, port: int, grace_s: float, metrics_port: int,
                       registry, add_servicer: Callable[[grpc.Server], None], full_name: str,
                       stop_worker: Callable[[], None]) -> RunningServer:
    """Starts a model-hosting service (verifier, speculator): its gRPC server with RPC metrics,
    and its /metrics endpoint when a port is set; stopping drains RPCs, then the model worker."""
    from specinfer.serving.metrics import MetricsServer

    metrics = MetricsServer(registry, host, metrics_port) if metrics_port else None

    def on_stop():
        stop_worker()
        if metrics:
            metrics.stop()

    return start_server(ServerConfig(host, port, grace_s=grace_s), [add_servicer], [full_name], on_stop,
                        RpcMetrics.create(registry, service))


def serve_until_signalled(service: str, log_level: str, num_threads: int, build: Callable[[], tuple]) -> int:
    """A model service's `main`: JSON logs, torch threads, then the model worker loop on this
    (the loading) thread while gRPC threads take requests, until SIGTERM drains it.

    `build` returns (server, worker loop) with the worker not yet running."""
    from specinfer.cli.main import configure_cpu_runtime
    from specinfer.serving.logs import setup_logging

    configure_cpu_runtime()  # before the first BLAS call, which is when MKL reads it
    setup_logging(service, log_level)
    if num_threads > 0:
        import torch

        torch.set_num_threads(num_threads)
    server, run_worker = build()
    server.install_signal_handlers()
    run_worker()  # returns once stopping the server has stopped the worker
    server.wait()
    return 0
