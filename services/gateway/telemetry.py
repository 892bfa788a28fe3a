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
    routed_requests: Counter  # verifier calls, by verifier address and why it was picked (routing.REASONS)
    routed_prefix_tokens: Counter  # prompt tokens the picked verifier was already sent (cache-aware hits)
    verifier_failovers: Counter  # calls made again on another verifier after one failed (UNAVAILABLE)
    verifiers_serving: Gauge  # verifiers whose health says SERVING

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
            routed_requests=Counter("specinfer_gateway_routed_requests",
                                    "Verifier calls, by verifier and why it was picked: cache (it holds the "
                                    "prompt's prefix), balance (least loaded) or affinity (the session's verifier)",
                                    ["verifier", "reason"], registry=registry),
            routed_prefix_tokens=Counter("specinfer_gateway_routed_prefix_tokens",
                                         "Prompt tokens whose prefix the picked verifier had been sent before",
                                         registry=registry),
            verifier_failovers=Counter("specinfer_gateway_verifier_failovers",
                                       "Verifier calls that failed (UNAVAILABLE) and went on on another verifier",
                                       registry=registry),
            verifiers_serving=Gauge("specinfer_gateway_verifiers_serving", "Verifiers whose health says SERVING",
                                    registry=registry),
        )
