"""The public Gateway gRPC service: protobuf at the edge, `GatewayCore` behind it.

The gateway is the request-facing part of SpecInfer's serving system (arXiv 2305.09781,
Section 5): clients send text, the gateway tokenizes it, asks the Verifier (which hosts the LLM
and drives speculation) to generate, and streams detokenized text back. Each servicer method is
thin: convert the request, open the `gateway.generate` span (continuing the client's trace),
count the outcome, and convert the core's results back to protobuf. Exceptions become gRPC
statuses in the shared ErrorInterceptor.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from services.gateway.config import GatewayConfig, config_from_args
from services.gateway.core import CallContext, GatewayCore
from services.gateway.http_api import HttpServer, start_http
from services.gateway.runs import Chunk
from services.gateway.store import RequestRecord, Store, make_store
from services.gateway.telemetry import GatewayMetrics
from services.gateway.validation import NewRequest
from services.gateway.routing import Router
from services.gateway.verifier_client import VerifierClient
from services.gateway.verifier_pool import SERVING, RoutedVerifiers, VerifierPool
from specinfer.errors import EXIT_CANNOT_BIND, BindError, UnavailableError, UserError
from specinfer.limits import MAX_LOGPROBS, MAX_SAMPLES
from specinfer.serving import convert
from specinfer.serving.grpc_server import (
    RunningServer, ServerConfig, bind_message, remaining_timeout, start_server, status_for,
)
from specinfer.serving.logs import setup_logging
from specinfer.serving.metrics import MetricsServer, new_registry
from specinfer.serving.tracing import incoming_context, outgoing_metadata, setup_tracing
from specinfer.stats import GenerationStats
from specinfer.tokenizer import TextTokenizer
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Gateway"].full_name


# -- protobuf <-> domain, at the edge only ---------------------------------------------------
def new_request_from_proto(msg: pb.GenerateRequest) -> NewRequest:
    """The client's request as domain types; the parameters validate themselves on the way."""
    if msg.HasField("max_tokens") and msg.max_tokens <= 0:  # unset means the default; 0 is a mistake
        raise UserError(f"max_tokens: must be >= 1 (leave it unset for the server default), got {msg.max_tokens}")
    return NewRequest(msg.prompt, convert.params_from_generate_request(msg), msg.session_id, msg.request_id)


def stats_to_proto(stats: GenerationStats | None) -> pb.GenerationStats | None:
    return None if stats is None else convert.stats_to_proto(stats)


def chunk_to_proto(chunk: Chunk) -> pb.GenerateStreamResponse:
    finish_reason = chunk.finish_reason if chunk.is_done else ""
    return pb.GenerateStreamResponse(request_id=chunk.request_id, text_delta=chunk.text_delta,
                                     token_ids=list(chunk.token_ids), token_offset=chunk.token_offset,
                                     finish_reason=finish_reason, stats=stats_to_proto(chunk.stats),
                                     finish=convert.finish_to_proto(finish_reason),
                                     logprobs=convert.logprobs_to_proto(chunk.logprobs),
                                     logprob_space=convert.space_to_proto(chunk.logprob_space), index=chunk.index)


def record_to_proto(rec: RequestRecord) -> pb.RequestState:
    return pb.RequestState(request_id=rec.request_id, status=rec.status, text=rec.text,
                           token_ids=list(rec.generated_ids), finish_reason=rec.finish_reason,
                           stats=stats_to_proto(rec.stats), session_id=rec.session_id, error=rec.error,
                           finish=convert.finish_to_proto(rec.finish_reason))


def _ended_code(context: grpc.ServicerContext) -> str:
    if context.is_active():
        return "OK"
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"


def downstream_timeout(remaining_s: float) -> float:
    """The verifier's deadline: the caller's remaining time less a 1% margin for the reply (gRPC
    also rounds deadlines up on the wire), so the verifier never outlives the client's deadline."""
    return max(0.001, remaining_s * 0.99 - 0.002)


class _Collected:
    """One sample's chunks, gathered for a unary Generate."""

    def __init__(self):
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list = []
        self.last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text_delta)
        self.ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.last = chunk

    def to_sample(self, index: int) -> pb.Sample:
        last = self.last
        return pb.Sample(index=index, request_id=last.request_id, text="".join(self.text), token_ids=self.ids,
                         finish_reason=last.finish_reason, finish=convert.finish_to_proto(last.finish_reason),
                         stats=stats_to_proto(last.stats), logprobs=convert.logprobs_to_proto(self.logprobs))


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore, tracer: trace.Tracer, metrics: GatewayMetrics):
        self.core = core
        self.tracer = tracer
        self.metrics = metrics

    @contextmanager
    def _rpc(self, method: str, context: grpc.ServicerContext, span_name: str, **attrs) -> Iterator[trace.Span]:
        """A SERVER span continuing the client's trace, plus the outcome counter and latency."""
        start = time.monotonic()
        span = self.tracer.start_span(span_name, context=incoming_context(context), kind=trace.SpanKind.SERVER,
                                      attributes={k: v for k, v in attrs.items() if v not in (None, "")})
        code = "OK"
        try:
            yield span
            code = _ended_code(context)
        except GeneratorExit:
            code = "CANCELLED"
            span.add_event("client_disconnected")
            raise
        except Exception as exc:
            code = status_for(exc)[0].name
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            raise
        finally:
            span.set_attribute("rpc.grpc.status_code", code)
            span.end()
            self.metrics.requests.labels(method, code).inc()
            self.metrics.request_latency.labels(method).observe(time.monotonic() - start)

    def _call(self, context: grpc.ServicerContext, span: trace.Span) -> CallContext:
        with trace.use_span(span, end_on_exit=False):
            metadata = tuple(outgoing_metadata())
        deadline_s = downstream_timeout(remaining_timeout(context, self.core.cfg.default_deadline_s))
        return CallContext(context, deadline_s, metadata, lambda name, attrs: span.add_event(name, attrs),
                           time.monotonic())

    @staticmethod
    def _annotate(span: trace.Span, chunk: Chunk) -> None:
        span.set_attribute("request_id", chunk.request_id)
        span.set_attribute("output_tokens", chunk.num_tokens)
        if chunk.is_done:
            span.set_attribute("finish_reason", chunk.finish_reason)
            if chunk.status == "cancelled":
                span.add_event("cancelled", {"request_id": chunk.request_id})
            if chunk.stats is not None:
                span.set_attribute("prompt_tokens", chunk.stats.prompt_tokens)

    def _stream(self, method: str, context, chunks_for, **attrs) -> Iterator[pb.GenerateStreamResponse]:
        with self._rpc(method, context, "gateway.generate", **attrs) as span:
            for chunk in chunks_for(self._call(context, span)):
                self._annotate(span, chunk)
                yield chunk_to_proto(chunk)

    # -- RPCs --------------------------------------------------------------------------------
    def Generate(self, request, context):
        with self._rpc("Generate", context, "gateway.generate", session_id=request.session_id) as span:
            samples: dict[int, _Collected] = {}
            for chunk in self.core.generate(new_request_from_proto(request), self._call(context, span)):
                self._annotate(span, chunk)
                samples.setdefault(chunk.index, _Collected()).add(chunk)
            if not samples or not all(s.last.is_done for s in samples.values()):
                if not context.is_active():  # the client left; nobody reads this
                    return pb.GenerateResponse()
                raise UnavailableError("the request ended without a result; resume it")
            first = samples[0].to_sample(0)
            response = pb.GenerateResponse(request_id=first.request_id, text=first.text, token_ids=first.token_ids,
                                           finish_reason=first.finish_reason, stats=first.stats, finish=first.finish,
                                           logprobs=first.logprobs, logprob_space=convert.space_to_proto(samples[0].last.logprob_space))
            if len(samples) > 1:  # the request's id; each sample's own is in `samples`
                response.request_id = samples[0].last.group_id
                response.samples.extend(samples[i].to_sample(i) for i in sorted(samples))
            return response

    def GenerateStream(self, request, context):
        req = new_request_from_proto(request)
        yield from self._stream("GenerateStream", context, lambda call: self.core.generate(req, call),
                                session_id=request.session_id)

    def ResumeStream(self, request, context):
        yield from self._stream("ResumeStream", context,
                                lambda call: self.core.resume(request.request_id, request.token_offset, call),
                                request_id=request.request_id, resumed=True)

    def CancelRequest(self, request, context):
        with self._rpc("CancelRequest", context, "gateway.cancel", request_id=request.request_id) as span:
            is_cancelled = self.core.cancel(request.request_id)
            span.add_event("cancelled" if is_cancelled else "already_ended")
            return pb.CancelRequestResponse(cancelled=is_cancelled)

    def GetRequest(self, request, context):
        with self._rpc("GetRequest", context, "gateway.get_request", request_id=request.request_id):
            return record_to_proto(self.core.get_request(request.request_id))

    def CreateSession(self, request, context):
        with self._rpc("CreateSession", context, "gateway.create_session"):
            return pb.Session(session_id=self.core.create_session(request.prefix))

    def DeleteSession(self, request, context):
        with self._rpc("DeleteSession", context, "gateway.delete_session", session_id=request.session_id) as span:
            call = self._call(context, span)
            return pb.DeleteSessionResponse(deleted=self.core.delete_session(request.session_id, call.metadata))

    def Info(self, request, context):
        with self._rpc("Info", context, "gateway.info") as span:
            v = self.core.verifier_info(self._call(context, span).metadata)
            lim = self.core.limits
            return pb.GatewayInfo(
                model=v.model, ssm_names=list(v.ssm_names), max_prompt_tokens=lim.max_prompt_tokens,
                max_tokens=lim.max_new_tokens, max_concurrent_requests=lim.max_concurrent_requests,
                default_shape=pb.TreeShape(widths=list(v.default_widths), max_nodes=v.default_max_nodes),
                max_stop_sequences=lim.max_stop_sequences, max_logprobs=MAX_LOGPROBS, max_samples=MAX_SAMPLES,
                admission_limit=self.core.admission.limit, num_running=self.core.admission.num_running,
                num_queued=self.core.admission.num_queued, num_verifiers_serving=self.core.verifier.num_serving())


# -- assembling and running the service -----------------------------------------------------
@dataclass
class GatewayServer:
    running: RunningServer
    core: GatewayCore
    metrics_server: MetricsServer | None
    http: HttpServer | None = None  # the OpenAI-compatible HTTP API

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def http_port(self) -> int:
        return self.http.port if self.http is not None else 0

    def stop(self, grace_s: float | None = None) -> None:
        self.running.stop(grace_s)


def connect_verifiers(cfg: GatewayConfig, metrics: GatewayMetrics) -> RoutedVerifiers:
    """The verifiers behind one routing client: one channel and health watcher per address."""
    targets = cfg.verifier_targets
    router = Router(cfg.routing)
    tls_name = targets.tls_name()

    def on_change(address: str, state: str) -> None:
        if state == SERVING:  # it may have restarted with an empty cache
            router.drop(address)
        metrics.verifiers_serving.set(len(pool.serving()))
        pool.on_load()  # admission counts the verifiers that serve

    pool = VerifierPool(targets, lambda address: VerifierClient(address, cfg.max_message_bytes,
                                                                cfg.verifier_security, tls_name),
                        cfg.pool, on_change, router.load)
    pool.start()
    return RoutedVerifiers(pool, router, metrics)


def serve(cfg: GatewayConfig, tracer: trace.Tracer, registry: CollectorRegistry, *,
          store: Store | None = None, tokenizer: TextTokenizer | None = None) -> GatewayServer:
    """Builds the gateway from its config and starts serving (health, reflection included)."""
    tokenizer = tokenizer or TextTokenizer.from_dir(cfg.model_dir)
    store = store or make_store(cfg.redis_url, cfg.request_ttl_s, cfg.session_ttl_s, cfg.key_prefix)
    try:
        store.ping()
    except UnavailableError as exc:
        log.warning("request store not reachable at startup (requests fail with UNAVAILABLE until it is): %s", exc)
    metrics = GatewayMetrics.create(registry)
    verifier = connect_verifiers(cfg, metrics)
    core = GatewayCore(cfg, tokenizer, store, verifier, metrics)
    verifier.pool.on_load = core.refresh_verifiers
    core.refresh_verifiers()
    core.start()
    servicer = GatewayServicer(core, tracer, metrics)
    metrics_server: MetricsServer | None = None
    http: HttpServer | None = None

    def on_stop() -> None:
        if http:
            http.stop()
        core.shutdown()
        verifier.close()
        store.close()
        if metrics_server:
            metrics_server.stop()

    try:  # a port that is taken stops what already started (so the process can exit at once)
        metrics_server = MetricsServer(registry, cfg.host, cfg.metrics_port) if cfg.metrics_port else None
        http = start_http(core, tracer, metrics, registry, cfg.http_port) if cfg.http_port else None
        running = start_server(
            ServerConfig(host=cfg.host, port=cfg.port, max_workers=cfg.num_server_workers, grace_s=cfg.grace_s,
                         max_message_bytes=cfg.max_message_bytes, security=cfg.server_security,
                         instance_id=cfg.instance_id),
            [lambda server: pb_grpc.add_GatewayServicer_to_server(servicer, server)], [SERVICE_NAME], on_stop,
            on_drain=http.begin_stop if http else None)
        running.work = core  # SIGTERM: its runs finish, or are handed over
    except BaseException:
        on_stop()
        raise
    log.info("gateway %s: verifier %s, store %s", cfg.gateway_id, cfg.verifier_addr,
             "redis" if cfg.redis_url else "in-memory")
    return GatewayServer(running, core, metrics_server, http)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config_from_args(argv, os.environ)
        setup_logging("gateway", cfg.log_level)
        tracer = setup_tracing("specinfer-gateway", cfg.otlp_endpoint)
        server = serve(cfg, tracer, new_registry())
    except BindError as exc:  # one line, and a code of its own: restarting will not free the port
        print(f"specinfer-gateway: error: {bind_message(exc, 'gateway')}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_BIND
    except (UserError, OSError) as exc:
        print(f"specinfer-gateway: error: {exc}", file=sys.stderr)
        return 2
    server.running.install_signal_handlers(cfg.parent_pid)
    server.running.wait()
    return 0
