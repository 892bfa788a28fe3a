"""The gateway's Prometheus metrics, on the service's own registry (no process-global state)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specinfer.serving.metrics import LATENCY_BUCKETS


@dataclass(frozen=True)
class GatewayMetrics:
    requests: Counter  # by method and final gRPC status code
    active_requests: Gauge  # generation workers running in this gateway
    request_latency: Histogram
    time_to_first_token: Histogram
    output_tokens: Counter
    admission_limit: Gauge  # requests the gateway lets run at once now (measured)
    queued_requests: Gauge  # requests waiting for a slot

    @classmethod
    def create(cls, registry: CollectorRegistry) -> "GatewayMetrics":
        return cls(
            requests=Counter("specinfer_gateway_requests", "Client RPCs, by method and gRPC status code",
                             ["method", "code"], registry=registry),
            active_requests=Gauge("specinfer_gateway_active_requests", "Requests generating right now",
                                  registry=registry),
            request_latency=Histogram("specinfer_gateway_request_latency_seconds", "Client RPC wall time",
                                      ["method"], buckets=LATENCY_BUCKETS, registry=registry),
            time_to_first_token=Histogram("specinfer_gateway_time_to_first_token_seconds",
                                          "From request arrival to its first generated token",
                                          buckets=LATENCY_BUCKETS, registry=registry),
            output_tokens=Counter("specinfer_gateway_output_tokens", "Tokens generated", registry=registry),
            admission_limit=Gauge("specinfer_gateway_admission_limit",
                                  "Requests admitted to run at once (measured from step times, capped)",
                                  registry=registry),
            queued_requests=Gauge("specinfer_gateway_queued_requests", "Requests waiting for a slot",
                                  registry=registry),
        )
