"""gRPC plumbing shared by the gateway, verifier and speculator services.

One interceptor maps exceptions to status codes (a request that does not parse is
INVALID_ARGUMENT); every server gets grpc.health.v1 and server reflection and bounds its message
sizes; SIGTERM flips health to NOT_SERVING and drains in-flight RPCs within a grace period.
A server may require a bearer token and serve TLS (`specinfer.serving.security`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_v1alpha
from grpc_reflection.v1alpha import reflection_pb2_grpc as reflection_v1alpha_grpc

from specinfer.errors import EXIT_CANNOT_BIND, BindError, CapacityError, NotFoundError, UnavailableError, UserError
from specinfer.limits import DEFAULT_MAX_MESSAGE_BYTES, MAX_STATUS_DETAILS_CHARS, PARENT_WATCH_S
from specinfer.serving.drain import Drainable, drain, handover_margin
from specinfer.serving.metrics import MetricsServer, RpcMetrics, new_registry
from specinfer.serving.security import AuthInterceptor, ServerSecurity, server_credentials
from specinfer.serving.settings import DEFAULT_GRACE_S, LOCAL_HOST, bind_problem, message_options
from specinfer.serving.tracing import error_trace_id, setup_tracing
from specinfer.serving import logs

log = logging.getLogger(__name__)
S = TypeVar("S")


def status_for(exc: BaseException, trace_id: str | None = None) -> tuple[grpc.StatusCode, str]:
    """The one mapping from exceptions to gRPC status codes. Only a `UserError` is the caller's
    fault (INVALID_ARGUMENT); an exception of no known kind is a server bug (INTERNAL), whose
    details name only its type and the trace to look it up under."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):  # a downstream call's status
        return exc.code(), exc.details() or str(exc)
    if isinstance(exc, UserError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0] if exc.args else exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, (UnavailableError, ConnectionError)):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    where = f" (trace {trace_id})" if trace_id else ""
    return grpc.StatusCode.INTERNAL, f"internal error{where}: {type(exc).__name__}"


def retry_after_metadata(exc: CapacityError) -> tuple[tuple[str, str], ...]:
    """A refusal's retry hint as trailers: `retry-after` in whole seconds (as HTTP's header), and
    gRPC's own `grpc-retry-pushback-ms`, which a channel with a retry policy obeys."""
    return (("retry-after", str(exc.retry_after_whole_s)),
            ("grpc-retry-pushback-ms", str(max(0, round(exc.retry_after_s * 1000)))))


class _Outcome:
    """One RPC, unary or streaming: an exception leaving the servicer becomes its status (with
    the traceback logged when it is a server bug), and the outcome is counted."""

    def __init__(self, metrics: RpcMetrics | None, method: str, context: grpc.ServicerContext):
        self.metrics, self.method, self.context = metrics, method, context
        self.start = time.monotonic()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        code, details = self._status(exc)
        if self.metrics is not None:
            service = self.metrics.service
            self.metrics.requests.labels(service, self.method, code.name).inc()
            self.metrics.latency.labels(service, self.method).observe(time.monotonic() - self.start)
        if details is not None:
            if len(details) > MAX_STATUS_DETAILS_CHARS:  # e.g. a long bad value quoted back
                details = details[:MAX_STATUS_DETAILS_CHARS - 3] + "..."
            if isinstance(exc, CapacityError) and exc.retry_after_s is not None:
                self.context.set_trailing_metadata(retry_after_metadata(exc))
            self.context.abort(code, details)  # raises, in place of the servicer's exception
        return False

    def _status(self, exc: BaseException | None) -> tuple[grpc.StatusCode, str | None]:
        """The RPC's code, and the details to abort with (None: nothing to abort)."""
        already = self.context.code()
        if exc is None:
            return already or grpc.StatusCode.OK, None
        if isinstance(exc, GeneratorExit):  # the client went away mid-stream
            return grpc.StatusCode.CANCELLED, None
        if not isinstance(exc, Exception):
            return grpc.StatusCode.UNKNOWN, None
        if already is not None and already != grpc.StatusCode.OK:  # e.g. `context.abort`: it stands
            return already, None
        code, details = status_for(exc)
        if code == grpc.StatusCode.INTERNAL and not isinstance(exc, grpc.RpcError):
            trace_id = error_trace_id(exc, self.context)
            log.error("internal error in %s (trace %s): %s: %s", self.method, trace_id, type(exc).__name__, exc,
                      exc_info=exc, extra={"fields": {"trace_id": trace_id, "rpc": self.method}})
            code, details = status_for(exc, trace_id)
        return code, details


@dataclass(frozen=True)
class _Malformed:
    """What a request deserializer gives for bytes that do not parse: the handler wrapper turns
    it into INVALID_ARGUMENT (gRPC itself would answer INTERNAL)."""

    reason: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # whatever the parser raises, the bytes are the caller's
            return _Malformed(str(exc) or type(exc).__name__)

    return parse


def _parsed(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise UserError(f"malformed request: {request.reason}")
    return request


def _parsed_stream(requests: Iterator[Any]) -> Iterator[Any]:
    for request in requests:
        yield _parsed(request)


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns exceptions raised by servicers (also mid-stream) into proper gRPC statuses, and
    counts every RPC's outcome when given metrics. A request message that does not parse (first
    or mid-stream) is INVALID_ARGUMENT and never reaches the servicer."""

    def __init__(self, metrics: RpcMetrics | None = None):
        self.metrics = metrics

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        check = _parsed_stream if handler.request_streaming else _parsed

        def unary(fn):
            def wrapped(request, context):
                with _Outcome(self.metrics, method, context):
                    return fn(check(request), context)

            return wrapped

        def stream(fn):
            def wrapped(request, context):
                with _Outcome(self.metrics, method, context):
                    yield from fn(check(request), context)

            return wrapped

        handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        if handler.unary_unary:
            return handler._replace(unary_unary=unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=stream(handler.unary_stream))
        if handler.stream_stream:
            return handler._replace(stream_stream=stream(handler.stream_stream))
        return handler


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
INSTANCE_PREFIX = "specinfer.instance."


def instance_health_name(instance_id: str) -> str:
    """The health-check service name a process started with `--instance-id ID` answers SERVING
    for: whoever started it asks for this name, and tells its own process from any other that
    answers on the port (which does not know the name: NOT_FOUND)."""
    return INSTANCE_PREFIX + instance_id


def _add_reflection_v1_descriptor() -> None:
    """Puts grpc.reflection.v1's file in the default descriptor pool, so that the service is
    described like any other. grpcio-reflection ships only v1alpha; v1 is the same file (same
    messages, same field numbers) under another package."""
    name = "grpc/reflection/v1/reflection.proto"
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_v1alpha.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = name, "grpc.reflection.v1"
    for message in proto.message_type:
        for f in message.field:
            if f.type_name:
                f.type_name = f.type_name.replace(old, new, 1)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new, 1)
        method.output_type = method.output_type.replace(old, new, 1)
    pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(service_names: list[str], server: grpc.Server) -> None:
    """Server reflection, both grpc.reflection.v1 (what current clients ask first) and v1alpha.
    One servicer answers both: their messages are the same on the wire."""
    _add_reflection_v1_descriptor()
    servicer = reflection.ReflectionServicer([*service_names, reflection.SERVICE_NAME, REFLECTION_V1])
    reflection_v1alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_v1alpha.ServerReflectionRequest.FromString,
            response_serializer=reflection_v1alpha.ServerReflectionResponse.SerializeToString),
    }),))


@dataclass(frozen=True)
class ServerConfig:
    host: str = LOCAL_HOST  # internal services are not exposed by default
    port: int = 0
    max_workers: int = 64
    grace_s: float = DEFAULT_GRACE_S
    max_connection_age_s: int = 300
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    security: ServerSecurity = field(default_factory=ServerSecurity)  # token, TLS; default: open plaintext
    instance_id: str = ""  # health also answers for `instance_health_name(instance_id)` when set


class RunningServer:
    """A started gRPC server with its health service; `stop` drains within the grace period."""

    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 service_names: list[str], grace_s: float, on_stop: Callable[[], None] | None,
                 on_drain: Callable[[], None] | None = None, work: Drainable | None = None):
        self.server = server
        self.port = port
        self.health = health_servicer
        self.service_names = service_names
        self.health_names = ["", *service_names]  # what health answers for (also the instance name)
        self.grace_s = grace_s
        self._on_stop = on_stop
        self._on_drain = on_drain  # called as draining starts (another API of the process drains alongside)
        self.work = work  # the requests in flight: the drain lasts as long as they need (drain.py)
        self._stopped = threading.Event()
        self.run_worker: Callable[[], None] | None = None  # a model service's unthreaded worker loop

    def set_serving(self, is_serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.health_names:
            self.health.set(name, status)

    def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, then a drain of at most `grace_s` (the configured grace by default): as
        long as the requests in flight need, handing over those that cannot finish in it."""
        if self._stopped.is_set():
            return
        self.set_serving(False)
        if self._on_drain:
            self._on_drain()
        cap_s = self.grace_s if grace_s is None else grace_s
        if self.work is not None:  # the requests finish (or are handed over) while the server still answers
            drain(self.work, cap_s)
            cap_s = handover_margin(cap_s)  # for the handed-over streams' last message
        self.server.stop(cap_s).wait()  # done as soon as the requests are
        if self._on_stop:
            self._on_stop()
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()

    def install_signal_handlers(self, parent_pid: int = 0) -> None:
        """SIGTERM/SIGINT: NOT_SERVING first, then drain in-flight work, then exit. With a
        `parent_pid` (the process that started this one), the same once that process is gone,
        however it ended: a service never outlives the launcher that supervises it."""

        def handler(signum, _frame):
            log.info("signal %s: draining within %.1fs", signum, self.grace_s)
            threading.Thread(target=self.stop, daemon=True).start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        if parent_pid:
            threading.Thread(target=self._stop_with_parent, args=(parent_pid,), daemon=True,
                             name="parent-watch").start()

    def _stop_with_parent(self, parent_pid: int) -> None:
        """Drains once this process's parent is no longer `parent_pid` (it exited: the process was
        re-parented), checking every PARENT_WATCH_S."""
        while os.getppid() == parent_pid:
            if self._stopped.wait(PARENT_WATCH_S):
                return
        log.warning("the process that started this one (pid %d) is gone: draining within %.1fs",
                    parent_pid, self.grace_s)
        self.stop()


def start_server(
    cfg: ServerConfig,
    add_servicers: list[Callable[[grpc.Server], None]],
    service_names: list[str],
    on_stop: Callable[[], None] | None = None,
    rpc_metrics: RpcMetrics | None = None,
    on_drain: Callable[[], None] | None = None,
) -> RunningServer:
    """Builds, starts and returns a server with the error interceptor, health and reflection;
    with a token configured every call but health checks must carry it, with a certificate the
    port serves TLS."""
    interceptors: list[grpc.ServerInterceptor] = [ErrorInterceptor(rpc_metrics)]
    if cfg.security.token is not None:  # inside the error interceptor: refusals are counted
        interceptors.append(AuthInterceptor(cfg.security.token))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.max_workers),
        interceptors=interceptors,
        # Clients re-resolve DNS only when a connection closes: cycling connections lets them
        # find replicas added by scaling; open streams get the grace period to finish.
        options=message_options(cfg.max_message_bytes) + [
            ("grpc.so_reuseport", 0),  # a port another server holds is a bind error, never a shared port
            ("grpc.max_connection_age_ms", cfg.max_connection_age_s * 1000),
            ("grpc.max_connection_age_grace_ms", int(cfg.grace_s * 1000) + 600_000)],
        maximum_concurrent_rpcs=None,
    )
    for add in add_servicers:
        add(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(list(service_names) + [health.SERVICE_NAME], server)
    address = f"{cfg.host}:{cfg.port}"
    credentials = server_credentials(cfg.security)
    problem = bind_problem(cfg.host, cfg.port) if cfg.port else None  # said plainly, before grpc's own log line
    if problem:
        raise BindError("gRPC API", cfg.host, cfg.port, problem)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind to address"
        port = 0
    if port == 0:
        raise BindError("gRPC API", cfg.host, cfg.port, "address already in use, or not an address of this host")
    server.start()
    running = RunningServer(server, port, health_servicer, service_names, cfg.grace_s, on_stop, on_drain)
    if cfg.instance_id:
        running.health_names.append(instance_health_name(cfg.instance_id))
    running.set_serving(True)
    log.info("serving %s on %s:%d (%s, %s)", ", ".join(service_names), cfg.host, port,
             "mTLS" if cfg.security.tls_client_ca else "TLS" if cfg.security.is_tls else "plaintext",
             "token required" if cfg.security.token else "no token")
    return running


def remaining_timeout(context: grpc.ServicerContext, default_s: float) -> float:
    """The caller's remaining time, or `default_s` when it set no deadline."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e8:
        return default_s
    return max(0.0, remaining)


class WorkerLoop(Protocol):
    """A model service's worker loop (the engine's batch worker)."""

    def run(self) -> None: ...

    def stop(self) -> None: ...


def start_model_server(service: str, host: str, port: int, grace_s: float, metrics_port: int,
                       registry, add_servicer: Callable[[grpc.Server], None], full_name: str,
                       stop_worker: Callable[[], None],
                       max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                       security: ServerSecurity | None = None, instance_id: str = "") -> RunningServer:
    """Starts a model-hosting service (verifier, speculator): its gRPC server with RPC metrics,
    and its /metrics endpoint when a port is set; stopping drains RPCs, then the model worker."""
    def on_stop():
        stop_worker()
        if metrics:
            metrics.stop()

    metrics = MetricsServer(registry, host, metrics_port) if metrics_port else None
    try:
        return start_server(ServerConfig(host, port, grace_s=grace_s, max_message_bytes=max_message_bytes,
                                         security=security or ServerSecurity(), instance_id=instance_id),
                            [add_servicer], [full_name], on_stop, RpcMetrics.create(registry, service))
    except BaseException:
        if metrics:
            metrics.stop()
        raise


def start_model_service(service: str, cfg, exporter, create: Callable[[Any, Any], tuple[S, WorkerLoop]],
                        add_servicer: Callable[[S, grpc.Server], None], full_name: str) -> tuple[RunningServer, S]:
    """The shared start of a model service once its models are loaded: its tracer and metrics
    registry, `create(tracer, registry)` -> (servicer, worker loop), then `start_model_server`.

    `cfg` has host, port, grace_s, metrics_port, otlp_endpoint, max_message_bytes and maybe
    server_security (a `ServerSecurity`); `exporter`
    is for tests. Stopping the server drains RPCs, then stops the worker loop; an unthreaded loop
    is run by the caller with `server.run_worker()`."""
    tracer = setup_tracing(f"specinfer-{service}", cfg.otlp_endpoint, exporter)
    registry = new_registry()
    servicer, loop = create(tracer, registry)
    server = start_model_server(service, cfg.host, cfg.port, cfg.grace_s, cfg.metrics_port, registry,
                                lambda s: add_servicer(servicer, s), full_name, loop.stop, cfg.max_message_bytes,
                                getattr(cfg, "server_security", None), getattr(cfg, "instance_id", ""))
    server.run_worker = loop.run
    return server, servicer


def serve_until_signalled(service: str, log_level: str, num_threads: int, build: Callable[[], tuple],
                          parent_pid: int = 0) -> int:
    """A model service's serving loop: JSON logs, torch threads, then the model worker loop on
    this (the loading) thread while gRPC threads take requests, until SIGTERM drains it.

    `build` returns (server, worker loop) with the worker not yet running. A UserError while
    loading (a missing checkpoint, no CUDA) is one log line and exit code 2; a port it cannot
    bind is one line naming the address and the setting that moves it, and EXIT_CANNOT_BIND.
    With `parent_pid`, it also drains once that process is gone (`install_signal_handlers`)."""
    from specinfer.engine.runtime.cpu import configure_cpu_runtime  # the gateway serves without the engine

    configure_cpu_runtime()  # before the first BLAS call, which is when MKL reads it
    logs.setup_logging(service, log_level)
    if num_threads > 0:
        import torch  # torch: after configure_cpu_runtime, and never in the gateway

        torch.set_num_threads(num_threads)
    try:
        server, run_worker = build()
    except BindError as exc:
        print(f"specinfer-{service}: error: {bind_message(exc, service)}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_BIND
    except UserError as exc:
        log.error("cannot start: %s", exc)
        return 2
    server.install_signal_handlers(parent_pid)
    run_worker()  # returns once stopping the server has stopped the worker
    server.wait()
    return 0


def model_service_main(service: str, argv: list[str] | None, parse_config: Callable[[list[str] | None], Any],
                       build: Callable[..., tuple[RunningServer, Any]]) -> int:
    """A model service's `main`: its configuration (a bad value is one line on stderr and exit
    code 2), then `build(cfg, is_worker_threaded=False)` and `serve_until_signalled`, the worker
    loop on this thread. `build` starts its server with `start_model_service`."""
    try:
        cfg = parse_config(argv)
    except UserError as exc:
        print(f"specinfer-{service}: error: {exc}", file=sys.stderr)
        return 2

    def build_inline():
        server, _ = build(cfg, is_worker_threaded=False)
        return server, server.run_worker

    return serve_until_signalled(service, cfg.log_level, cfg.num_threads, build_inline, cfg.parent_pid)


def bind_message(exc: BindError, service: str) -> str:
    """A bind failure in words, with the flag (and variable) of the service that moves the port."""
    flags = {"gRPC API": ("--port", f"SPECINFER_{service.upper()}_PORT"), "HTTP API": ("--http-port", "SPECINFER_HTTP_PORT"),
             "metrics endpoint": ("--metrics-port", "SPECINFER_METRICS_PORT")}
    flag, env = flags.get(exc.what, ("--port", f"SPECINFER_{service.upper()}_PORT"))
    return f"{exc}; choose another port with {flag} (or {env})"
