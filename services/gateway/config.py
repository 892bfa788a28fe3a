"""Gateway configuration: CLI flags with environment-variable fallbacks, into one frozen dataclass.

Read once, in `main()`; nothing here touches `os.environ` at import time. The gateway is the
request-facing part of the serving system (SpecInfer, arXiv 2305.09781, Section 5): these are
its public limits and the addresses of what it depends on (the verifier, Redis).
"""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from specinfer.errors import UserError
from specinfer.limits import RequestLimits

T = TypeVar("T")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    verifier_addr: str = "127.0.0.1:50052"  # host:port, or a dns:///host:port target (round robin)
    redis_url: str | None = None  # None = embedded in-memory store
    model_dir: Path | None = None  # LLM checkpoint directory; only its tokenizer is loaded
    limits: RequestLimits = field(default_factory=RequestLimits)  # checked before anything goes downstream
    default_deadline_s: float = 300.0  # when the client sets no deadline
    request_ttl_s: int = 24 * 3600
    session_ttl_s: int = 24 * 3600
    stale_after_s: float = 30.0  # a "running" request with no progress for this long is taken over
    otlp_endpoint: str | None = None
    metrics_port: int = 0  # 0 = no metrics endpoint
    log_level: str = "info"
    grace_s: float = 10.0
    key_prefix: str = "specinfer:"
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def num_server_workers(self) -> int:
        """gRPC threads: one per streaming request plus headroom, so the limit check is reached
        instead of requests queueing silently inside the server's thread pool."""
        return self.limits.max_concurrent_requests + 32


def _flag(p: argparse.ArgumentParser, name: str, env: str, kind: type, help_text: str) -> None:
    p.add_argument(name, type=kind, default=None, help=f"{help_text} (env {env})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specinfer-gateway", description="The SpecInfer public gateway (gRPC).")
    _flag(p, "--host", "SPECINFER_GATEWAY_HOST", str, "bind address, default 127.0.0.1")
    _flag(p, "--port", "SPECINFER_GATEWAY_PORT", int, "port, default 50051")
    _flag(p, "--verifier-addr", "SPECINFER_VERIFIER_ADDR", str, "verifier host:port or dns:///host:port")
    _flag(p, "--redis-url", "SPECINFER_REDIS_URL", str, "redis://host:port/db; unset = in-memory store")
    _flag(p, "--model-dir", "SPECINFER_MODEL_DIR", Path, "LLM checkpoint directory (for its tokenizer)")
    _flag(p, "--max-prompt-tokens", "SPECINFER_MAX_PROMPT_TOKENS", int, "default 2048")
    _flag(p, "--max-tokens", "SPECINFER_MAX_TOKENS", int, "max generated tokens per request, default 512")
    _flag(p, "--default-max-tokens", "SPECINFER_DEFAULT_MAX_TOKENS", int, "when a request says 0, default 128")
    _flag(p, "--max-concurrent-requests", "SPECINFER_MAX_CONCURRENT_REQUESTS", int, "default 64")
    _flag(p, "--max-stop-sequences", "SPECINFER_MAX_STOP_SEQUENCES", int, "default 8")
    _flag(p, "--max-tree-depth", "SPECINFER_MAX_TREE_DEPTH", int, "default 16")
    _flag(p, "--default-deadline-s", "SPECINFER_DEFAULT_DEADLINE_S", float, "when the client sets none, default 300")
    _flag(p, "--request-ttl-s", "SPECINFER_REQUEST_TTL_S", int, "request state TTL, default 86400")
    _flag(p, "--session-ttl-s", "SPECINFER_SESSION_TTL_S", int, "session TTL, default 86400")
    _flag(p, "--otlp-endpoint", "SPECINFER_OTLP_ENDPOINT", str, "OTLP/gRPC trace endpoint; unset = off")
    _flag(p, "--metrics-port", "SPECINFER_METRICS_PORT", int, "Prometheus /metrics port; 0 = off")
    _flag(p, "--log-level", "SPECINFER_LOG_LEVEL", str, "debug, info, warning, error")
    _flag(p, "--grace-s", "SPECINFER_GRACE_S", float, "drain period on SIGTERM, default 10")
    return p


def _pick(value: T | None, env: Mapping[str, str], name: str, cast: Callable[[str], T], default: T) -> T:
    if value is not None:
        return value
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not a valid {cast.__name__}") from None


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise UserError(f"{name} must be > 0, got {value}")


def config_from_args(argv: list[str] | None, env: Mapping[str, str]) -> GatewayConfig:
    """Parses flags; every unset flag falls back to its environment variable, then the default."""
    a = build_parser().parse_args(argv)
    d, dl = GatewayConfig(), RequestLimits()
    values = {
        "max_prompt_tokens": _pick(a.max_prompt_tokens, env, "SPECINFER_MAX_PROMPT_TOKENS", int, dl.max_prompt_tokens),
        "max_new_tokens": _pick(a.max_tokens, env, "SPECINFER_MAX_TOKENS", int, dl.max_new_tokens),
        "default_max_new_tokens": _pick(a.default_max_tokens, env, "SPECINFER_DEFAULT_MAX_TOKENS", int,
                                        dl.default_max_new_tokens),
        "max_concurrent_requests": _pick(a.max_concurrent_requests, env, "SPECINFER_MAX_CONCURRENT_REQUESTS", int,
                                         dl.max_concurrent_requests),
        "max_stop_sequences": _pick(a.max_stop_sequences, env, "SPECINFER_MAX_STOP_SEQUENCES", int,
                                    dl.max_stop_sequences),
        "max_tree_depth": _pick(a.max_tree_depth, env, "SPECINFER_MAX_TREE_DEPTH", int, dl.max_tree_depth),
    }
    for name, flag in (("max_prompt_tokens", "--max-prompt-tokens"), ("max_new_tokens", "--max-tokens"),
                       ("default_max_new_tokens", "--default-max-tokens"),
                       ("max_concurrent_requests", "--max-concurrent-requests"),
                       ("max_tree_depth", "--max-tree-depth")):
        _positive(flag, values[name])
    limits = RequestLimits(**values)
    model_dir = _pick(a.model_dir, env, "SPECINFER_MODEL_DIR", Path, None)
    if model_dir is None:
        raise UserError("the gateway needs the LLM's directory for its tokenizer: --model-dir or SPECINFER_MODEL_DIR")
    cfg = GatewayConfig(
        host=_pick(a.host, env, "SPECINFER_GATEWAY_HOST", str, d.host),
        port=_pick(a.port, env, "SPECINFER_GATEWAY_PORT", int, d.port),
        verifier_addr=_pick(a.verifier_addr, env, "SPECINFER_VERIFIER_ADDR", str, d.verifier_addr),
        redis_url=_pick(a.redis_url, env, "SPECINFER_REDIS_URL", str, None),
        model_dir=model_dir,
        limits=limits,
        default_deadline_s=_pick(a.default_deadline_s, env, "SPECINFER_DEFAULT_DEADLINE_S", float,
                                 d.default_deadline_s),
        request_ttl_s=_pick(a.request_ttl_s, env, "SPECINFER_REQUEST_TTL_S", int, d.request_ttl_s),
        session_ttl_s=_pick(a.session_ttl_s, env, "SPECINFER_SESSION_TTL_S", int, d.session_ttl_s),
        otlp_endpoint=_pick(a.otlp_endpoint, env, "SPECINFER_OTLP_ENDPOINT", str, None),
        metrics_port=_pick(a.metrics_port, env, "SPECINFER_METRICS_PORT", int, 0),
        log_level=_pick(a.log_level, env, "SPECINFER_LOG_LEVEL", str, d.log_level),
        grace_s=_pick(a.grace_s, env, "SPECINFER_GRACE_S", float, d.grace_s),
    )
    for name in ("default_deadline_s", "request_ttl_s", "session_ttl_s"):
        _positive(name, getattr(cfg, name))
    return cfg
