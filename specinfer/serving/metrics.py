"""Prometheus metrics, served at /metrics on every service.

Names follow vLLM's speculative-decoding metrics where one exists (`*_spec_decode_*`), prefixed
`specinfer_`. Each service builds its own registry (no process-global state) and passes it down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from http.server import ThreadingHTTPServer
from threading import Thread

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

from specinfer.errors import BindError

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


@dataclass
class RpcMetrics:
    """Per-RPC outcome counters and latency, shared by all services."""

    service: str
    requests: Counter
    latency: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry, service: str) -> "RpcMetrics":
        return cls(
            service=service,
            requests=Counter("specinfer_rpc_requests", "RPCs handled, by method and gRPC status code",
                             ["service", "method", "code"], registry=registry),
            latency=Histogram("specinfer_rpc_latency_seconds", "RPC wall time", ["service", "method"],
                              buckets=LATENCY_BUCKETS, registry=registry),
        )


@dataclass
class ModelMetrics:
    """A model worker's batching and KV-cache figures (verifier and speculator alike)."""

    batch_size: Histogram
    iteration_tokens: Histogram
    step_seconds: Histogram
    kv_blocks_used: Gauge
    kv_blocks_free: Gauge
    kv_usage: Gauge
    requests_running: Gauge
    requests_waiting: Gauge
    ahead_trees: Any  # trees drafted ahead, by whether they stood (speculator)
    prefix_cache_queries: Any  # prompt tokens looked up in the prefix cache (verifier), as vLLM counts them
    prefix_cache_hits: Any  # of those, the tokens found cached

    @classmethod
    def create(cls, registry: CollectorRegistry, service: str) -> "ModelMetrics":
        def hist(name, doc, buckets):
            return Histogram(name, doc, ["service"], buckets=buckets, registry=registry).labels(service)

        def gauge(name, doc):
            return Gauge(name, doc, ["service"], registry=registry).labels(service)

        return cls(
            batch_size=hist("specinfer_batch_size", "Requests in one model iteration", BATCH_BUCKETS),
            iteration_tokens=hist("specinfer_iteration_tokens", "Tokens in one forward pass", TOKEN_BUCKETS),
            step_seconds=hist("specinfer_step_seconds", "Wall time of one model iteration", LATENCY_BUCKETS),
            kv_blocks_used=gauge("specinfer_kv_cache_blocks_used", "KV-cache blocks in use"),
            kv_blocks_free=gauge("specinfer_kv_cache_blocks_free", "KV-cache blocks free"),
            kv_usage=gauge("specinfer_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use"),
            requests_running=gauge("specinfer_num_requests_running", "Requests being served"),
            requests_waiting=gauge("specinfer_num_requests_waiting", "Jobs queued for the model worker"),
            ahead_trees=Counter("specinfer_ahead_trees", "Trees drafted while the previous one was verified, by "
                                "whether the verdict let them stand", ["service", "outcome"], registry=registry),
            prefix_cache_queries=Counter("specinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                         "cache", ["service"], registry=registry).labels(service),
            prefix_cache_hits=Counter("specinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                      ["service"], registry=registry).labels(service),
        )

    def observe_kv(self, num_used: int, num_free: int) -> None:
        self.kv_blocks_used.set(num_used)
        self.kv_blocks_free.set(num_free)
        self.kv_usage.set(num_used / max(1, num_used + num_free))

    def observe_prefix_cache(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries.inc(num_queried)
        self.prefix_cache_hits.inc(num_hit)


@dataclass
class SpecDecodeMetrics:
    """Speculative decoding outcomes at the verifier, named like vLLM's spec_decode metrics."""

    num_drafts: Counter
    num_draft_tokens: Counter
    num_accepted_tokens: Counter
    accepted_per_pos: Counter
    accepted_length: Histogram
    tree_nodes: Histogram
    time_per_output_token: Histogram
    fallbacks: Counter
    late_trees: Counter
    output_tokens: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> "SpecDecodeMetrics":
        return cls(
            num_drafts=Counter("specinfer_spec_decode_num_drafts", "Token trees verified", registry=registry),
            num_draft_tokens=Counter("specinfer_spec_decode_num_draft_tokens", "Speculated tree nodes verified",
                                     registry=registry),
            num_accepted_tokens=Counter("specinfer_spec_decode_num_accepted_tokens", "Tree tokens accepted",
                                        registry=registry),
            accepted_per_pos=Counter("specinfer_spec_decode_num_accepted_tokens_per_pos",
                                     "Tree tokens accepted, by tree depth", ["position"], registry=registry),
            accepted_length=Histogram("specinfer_spec_decode_accepted_length", "Tree tokens accepted per step",
                                      buckets=tuple(range(0, 17)), registry=registry),
            tree_nodes=Histogram("specinfer_tree_nodes_per_step", "Token-tree nodes verified per step (root included)",
                                 buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128), registry=registry),
            time_per_output_token=Histogram("specinfer_time_per_output_token_seconds",
                                            "Request latency divided by its output tokens", buckets=LATENCY_BUCKETS,
                                            registry=registry),
            fallbacks=Counter("specinfer_speculator_fallbacks", "Speculators dropped mid-request", registry=registry),
            late_trees=Counter("specinfer_speculator_late_trees",
                               "Speculator trees not in time for their step (the step went on without them)",
                               registry=registry),
            output_tokens=Counter("specinfer_output_tokens", "Tokens generated", registry=registry),
        )

    def observe_step(self, num_nodes: int, num_accepted: int, is_speculated: bool) -> None:
        self.tree_nodes.observe(num_nodes)
        if not is_speculated:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(num_nodes - 1)
        self.num_accepted_tokens.inc(num_accepted)
        self.accepted_length.observe(num_accepted)
        for depth in range(1, num_accepted + 1):
            self.accepted_per_pos.labels(str(depth)).inc()


class MetricsServer:
    """Serves a registry over HTTP at /metrics on its own thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        handler = MetricsHandler.factory(registry)
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise BindError("metrics endpoint", host, port, exc.strerror or str(exc)) from None
        self.port = self.httpd.server_address[1]
        self.thread = Thread(target=self.httpd.serve_forever, daemon=True, name="metrics-http")
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
