"""A stand-in for the OpenTelemetry Collector where its image cannot be had: an OTLP/gRPC trace
receiver (port 4317) that keeps the most recent spans in memory and shows them over HTTP.

    GET :13133/                      200 "ok" (the container healthcheck)
    GET :13133/spans                 every kept span as JSON
    GET :13133/spans?request_id=ID   the spans whose `request_id` attribute is ID

Each span is {"service", "name", "trace_id", "span_id", "parent_span_id", "attributes"}. Nothing is
forwarded and nothing is written to disk; one log line per received batch. It runs in the CPU
image (grpcio and opentelemetry-proto are already there):

    python otlp_sink.py [--grpc-port 4317] [--http-port 13133] [--max-spans 20000]
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class SinkConfig:
    grpc_port: int
    http_port: int
    max_spans: int


def any_value(value) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind) if kind else None


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append({"service": resource.get("service.name", ""), "name": span.name,
                              "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                              "parent_span_id": span.parent_span_id.hex(),
                              "attributes": {kv.key: any_value(kv.value) for kv in span.attributes}})
    return spans


class SpanStore:
    def __init__(self, max_spans: int):
        self._spans: collections.deque[dict] = collections.deque(maxlen=max_spans)
        self._lock = threading.Lock()

    def add(self, spans: list[dict]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def query(self, request_id: str | None) -> list[dict]:
        with self._lock:
            spans = list(self._spans)
        return [s for s in spans if request_id is None or s["attributes"].get("request_id") == request_id]


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: SpanStore):
        self.store = store

    def Export(self, request, context):
        spans = flatten(request)
        self.store.add(spans)
        print(f"otlp-sink: {len(spans)} spans from {sorted({s['service'] for s in spans})}", flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()


def http_handler(store: SpanStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urlparse(self.path)
            if url.path == "/":
                body, status = b"ok", 200
            elif url.path == "/spans":
                request_id = parse_qs(url.query).get("request_id", [None])[0]
                body, status = json.dumps(store.query(request_id)).encode(), 200
            else:
                body, status = b"not found", 404
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # the healthcheck polls every few seconds: keep the log quiet
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-port", type=int, default=4317)
    parser.add_argument("--http-port", type=int, default=13133)
    parser.add_argument("--max-spans", type=int, default=20000)
    args = parser.parse_args()
    config = SinkConfig(args.grpc_port, args.http_port, args.max_spans)
    store = SpanStore(config.max_spans)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceReceiver(store), server)
    server.add_insecure_port(f"0.0.0.0:{config.grpc_port}")
    server.start()
    http = ThreadingHTTPServer(("0.0.0.0", config.http_port), http_handler(store))
    print(f"otlp-sink: OTLP/gRPC on {config.grpc_port}, spans on http://0.0.0.0:{config.http_port}/spans", flush=True)
    try:
        http.serve_forever()
    finally:
        server.stop(0)


if __name__ == "__main__":
    main()
