"""Prometheus metrics, served at /metrics on every service.

Names follow vLLM's speculative-decoding metrics where one exists (`*_spec_decode_*`), prefixed
`specinfer_`. Each service builds its own registry (no process-global state) and passes it down.
"""

from __future__ import annotations

from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from threading import Thread

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass
class RpcMetrics:
    """Per-RPC outcome counters and latency, shared by all services."""

    requests: Counter
    latency: Histogram
    in_flight: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry, service: str) -> "RpcMetrics":
        return cls(
            requests=Counter("specinfer_rpc_requests", "RPCs handled, by method and gRPC status code",
                             ["service", "method", "code"], registry=registry),
            latency=Histogram("specinfer_rpc_latency_seconds", "RPC wall time", ["service", "method"],
                              buckets=LATENCY_BUCKETS, registry=registry),
            in_flight=Gauge("specinfer_rpc_in_flight", "RPCs in progress", ["service", "method"], registry=registry),
        )


class MetricsServer:
    """Serves a registry over HTTP at /metrics on its own thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        handler = MetricsHandler.factory(registry)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.port = self.httpd.server_address[1]
        self.thread = Thread(target=self.httpd.serve_forever, daemon=True, name="metrics-http")
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
