"""OpenTelemetry tracing: one trace per client request across gateway, verifier and speculators.

Context travels in gRPC metadata (W3C traceparent). Export is OTLP/gRPC when an endpoint is
configured, off otherwise; tests pass an in-memory exporter.
"""

from __future__ import annotations

import logging
import uuid
from contextlib import contextmanager
from typing import Iterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

log = logging.getLogger(__name__)
_TRACE_ID_ATTR = "specinfer_trace_id"  # set on an exception that leaves a server span


def setup_tracing(service_name: str, otlp_endpoint: str | None, exporter: SpanExporter | None = None) -> trace.Tracer:
    """Returns the service's tracer. With neither an endpoint nor an exporter, spans are no-ops."""
    if otlp_endpoint is None and exporter is None:
        return trace.NoOpTracer()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # only with an endpoint

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
        log.info("exporting traces to %s", otlp_endpoint)
    return provider.get_tracer(service_name)


def outgoing_metadata(extra: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the current trace context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items()) + list(extra or [])


def incoming_context(context: grpc.ServicerContext) -> otel_context.Context:
    """The caller's trace context, from the RPC's metadata."""
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


@contextmanager
def server_span(tracer: trace.Tracer, name: str, context: grpc.ServicerContext, **attributes) -> Iterator[trace.Span]:
    """A SERVER span that continues the caller's trace."""
    with tracer.start_as_current_span(
        name, context=incoming_context(context), kind=trace.SpanKind.SERVER, attributes=attributes
    ) as span:
        try:
            yield span
        except Exception as exc:
            note_trace(exc, span)
            raise


def _hex_trace_id(span_context: trace.SpanContext) -> str | None:
    return format(span_context.trace_id, "032x") if span_context.is_valid else None


def note_trace(exc: BaseException, span: trace.Span) -> None:
    """Remembers on the exception the trace of the span it is leaving, for the error interceptor
    (the span has ended by the time the exception reaches it)."""
    trace_id = _hex_trace_id(span.get_span_context())
    if trace_id is not None and getattr(exc, _TRACE_ID_ATTR, None) is None:
        try:
            setattr(exc, _TRACE_ID_ATTR, trace_id)
        except AttributeError:  # an exception type with __slots__
            pass


def error_trace_id(exc: BaseException, context: grpc.ServicerContext) -> str:
    """The trace id to report an RPC's failure under: the server span the exception left, else
    the current span, else the caller's trace; with tracing off everywhere, a fresh id of the
    same form, so the client's message and the server's log line still name one id."""
    return (
        getattr(exc, _TRACE_ID_ATTR, None)
        or _hex_trace_id(trace.get_current_span().get_span_context())
        or _hex_trace_id(trace.get_current_span(incoming_context(context)).get_span_context())
        or uuid.uuid4().hex
    )
