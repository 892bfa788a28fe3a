"""Gateway configuration: CLI flags with environment-variable fallbacks, into one frozen dataclass.

Read once, in `main()`; nothing here touches `os.environ` at import time. The gateway is the
request-facing part of the serving system (SpecInfer, arXiv 2305.09781, Section 5): these are
its public limits and the addresses of what it depends on (the verifier, Redis).
"""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Mapping

from services.gateway.admission import AdmissionConfig
from specinfer.chat_template import ChatTemplate
from services.gateway.routing import RoutingConfig
from services.gateway.verifier_pool import PoolConfig, VerifierTargets
from specinfer.errors import UserError
from specinfer.limits import DEFAULT_DEADLINE_S, DEFAULT_MAX_MESSAGE_BYTES, RequestLimits
from specinfer.limits import DEFAULT_REQUEST_TTL_S, DEFAULT_SESSION_TTL_S, GATEWAY_PORT, VERIFIER_PORT
from specinfer.serving.settings import DEFAULT_GRACE_S, LOCAL_HOST, Flag, add_flag, read_flags
from specinfer.serving.shared_flags import (
    chat_template_flag, common_flags, default_deadline_flag, host_flag, http_port_flag, max_prompt_tokens_flag,
    max_tokens_flag, port_flag, redis_url_flag, security_flags,
)
from specinfer.serving.security import (
    GATEWAY_TOKEN_ENV, INTERNAL_TOKEN_ENV, ChannelSecurity, ServerSecurity, channel_security, resolve_token,
    server_security,
)


@dataclass(frozen=True)
class GatewayConfig:
    host: str = LOCAL_HOST
    port: int = GATEWAY_PORT
    # host:port, several comma-separated, or dns:///host:port (every address the name resolves to)
    verifier_addr: str = f"{LOCAL_HOST}:{VERIFIER_PORT}"
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # which verifier a request goes to
    pool: PoolConfig = field(default_factory=PoolConfig)  # finding the verifiers and following their health
    http_port: int = 0  # the OpenAI-compatible HTTP API; 0 = off (the stacks we ship set HTTP_PORT)
    redis_url: str | None = None  # None = embedded in-memory store
    model_dir: Path | None = None  # the LLM's checkpoint directory or GGUF file; only its tokenizer is loaded
    chat_template: Path | None = None  # a Jinja file overriding the checkpoint's chat template
    limits: RequestLimits = field(default_factory=RequestLimits)  # checked before anything goes downstream
    default_deadline_s: float = DEFAULT_DEADLINE_S  # when the client sets no deadline
    request_ttl_s: int = DEFAULT_REQUEST_TTL_S
    session_ttl_s: int = DEFAULT_SESSION_TTL_S
    stale_after_s: float = 30.0  # a "running" request with no progress for this long is taken over
    lease_ttl_s: float = 5.0  # a gateway silent this long is gone: its running requests are taken over
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # max_running: limits' cap
    otlp_endpoint: str | None = None
    metrics_port: int = 0  # 0 = no metrics endpoint
    log_level: str = "info"
    instance_id: str = ""  # health answers for it too (`specinfer up` tells its own processes apart)
    parent_pid: int = 0  # drains and exits once this process (its launcher) is gone; 0 = none
    grace_s: float = DEFAULT_GRACE_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # this server's and the verifier channel's bound
    key_prefix: str = "specinfer:"
    server_security: ServerSecurity = field(default_factory=ServerSecurity)  # the public token, TLS
    verifier_security: ChannelSecurity = field(default_factory=ChannelSecurity)  # the internal token, TLS
    gateway_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def verifier_targets(self) -> VerifierTargets:
        return VerifierTargets.parse(self.verifier_addr)

    @property
    def num_server_workers(self) -> int:
        """gRPC threads: one per running or queued request plus headroom, so admission is reached
        instead of requests queueing silently inside the server's thread pool."""
        return self.limits.max_concurrent_requests + self.admission.max_queued + 32


def _flags() -> list[Flag]:
    d = {f.name: f.default for f in fields(GatewayConfig)
         if f.name not in ("limits", "gateway_id", "admission", "routing", "pool")}
    dl, da, dr, dp = RequestLimits(), AdmissionConfig(), RoutingConfig(), PoolConfig()
    return [
        host_flag("gateway"), port_flag("gateway"),
        Flag("--verifier-addr", "SPECINFER_VERIFIER_ADDR", str, d["verifier_addr"],
             "the verifiers: host:port, several comma-separated, or dns:///host:port (every address the name "
             "resolves to, resolved again every --verifier-dns-refresh-s)"),
        Flag("--verifier-dns-refresh-s", "SPECINFER_VERIFIER_DNS_REFRESH_S", float, dp.dns_refresh_s,
             "how often a dns:/// verifier address is resolved again", is_positive=True),
        Flag("--routing-balance-threshold", "SPECINFER_ROUTING_BALANCE_THRESHOLD", int, dr.balance_abs,
             "a request goes to the least loaded verifier instead of the one holding its prefix when that one "
             "has more than this many requests in flight beyond the least loaded's (and --routing-balance-ratio "
             "times as many)", low=0),
        Flag("--routing-balance-ratio", "SPECINFER_ROUTING_BALANCE_RATIO", float, dr.balance_ratio,
             "see --routing-balance-threshold", low=1),
        Flag("--routing-index-blocks", "SPECINFER_ROUTING_INDEX_BLOCKS", int, dr.index_blocks,
             "KV blocks of prompts remembered per verifier for routing (least recently sent forgotten first)",
             is_positive=True),
        redis_url_flag(), http_port_flag("gateway"),
        Flag("--model-dir", "SPECINFER_MODEL_DIR", Path, None,
             "the LLM's checkpoint directory or .gguf file (for its tokenizer and chat template)"),
        chat_template_flag(), max_prompt_tokens_flag("gateway"), max_tokens_flag("gateway"),
        Flag("--default-max-tokens", "SPECINFER_DEFAULT_MAX_TOKENS", int, dl.default_max_new_tokens,
             "when a request says 0", is_positive=True),
        Flag("--max-concurrent-requests", "SPECINFER_MAX_CONCURRENT_REQUESTS", int, dl.max_concurrent_requests,
             "most requests running at once (the measured limit stays at or under it)", is_positive=True),
        Flag("--min-running-requests", "SPECINFER_MIN_RUNNING_REQUESTS", int, da.min_running,
             "the measured limit never goes below this", is_positive=True),
        Flag("--admission-latency-factor", "SPECINFER_ADMISSION_LATENCY_FACTOR", float, da.latency_factor,
             "admit while the verifier's time per output token is at most this many times the unloaded one; "
             "0 = a fixed limit of --max-concurrent-requests", low=0),
        Flag("--max-queued-requests", "SPECINFER_MAX_QUEUED_REQUESTS", int, da.max_queued,
             "requests that may wait for a slot before RESOURCE_EXHAUSTED", low=0),
        Flag("--admission-queue-timeout-s", "SPECINFER_ADMISSION_QUEUE_TIMEOUT_S", float, da.queue_timeout_s,
             "longest wait for a slot", low=0),
        Flag("--admission-queue-factor", "SPECINFER_ADMISSION_QUEUE_FACTOR", float, da.queue_factor,
             "a request waits for a slot only while its predicted wait is at most this many times its own "
             "unloaded run time; a longer one is refused at once with a retry hint", low=0),
        Flag("--max-stop-sequences", "SPECINFER_MAX_STOP_SEQUENCES", int, dl.max_stop_sequences,
             "stop strings per request", low=0),
        Flag("--max-tree-depth", "SPECINFER_MAX_TREE_DEPTH", int, dl.max_tree_depth, "token-tree levels per request",
             is_positive=True),
        default_deadline_flag("gateway"),
        Flag("--request-ttl-s", "SPECINFER_REQUEST_TTL_S", int, d["request_ttl_s"], "request state TTL",
             is_positive=True),
        Flag("--session-ttl-s", "SPECINFER_SESSION_TTL_S", int, d["session_ttl_s"], "session TTL", is_positive=True),
        Flag("--lease-ttl-s", "SPECINFER_LEASE_TTL_S", float, d["lease_ttl_s"],
             "a gateway that has not renewed its lease for this long is gone; another takes over its requests",
             is_positive=True),
        Flag("--stale-after-s", "SPECINFER_STALE_AFTER_S", float, d["stale_after_s"],
             "a running request with no progress for this long is taken over, even from a live gateway",
             is_positive=True),
        *common_flags(d, has_threads=False),
        *security_flags(*GATEWAY_TOKEN_ENV, outbound_token_env=INTERNAL_TOKEN_ENV[0]),
    ]


def build_parser(flags: list[Flag] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specinfer-gateway", description="The SpecInfer public gateway (gRPC and HTTP).")
    for flag in flags or _flags():
        add_flag(p, flag)
    return p


def config_from_args(argv: list[str] | None, env: Mapping[str, str]) -> GatewayConfig:
    """Flags, else environment variables, else the defaults; raises UserError on a bad value."""
    flags = _flags()
    a = read_flags(build_parser(flags), flags, argv, env)
    if a["model_dir"] is None:
        raise UserError("the gateway needs the LLM (its directory or .gguf file) for its tokenizer: --model-dir or "
                        "SPECINFER_MODEL_DIR")
    if a["chat_template"] is not None:  # checked now: a bad file stops the gateway before it serves
        ChatTemplate.from_file(a["chat_template"], a["model_dir"], "--chat-template (SPECINFER_CHAT_TEMPLATE)")
    VerifierTargets.parse(a["verifier_addr"], "--verifier-addr (SPECINFER_VERIFIER_ADDR)")  # now, not per request
    routing = replace(RoutingConfig(), balance_abs=a["routing_balance_threshold"],
                      balance_ratio=a["routing_balance_ratio"], index_blocks=a["routing_index_blocks"])
    pool = replace(PoolConfig(), dns_refresh_s=a["verifier_dns_refresh_s"])
    limits = RequestLimits(
        max_prompt_tokens=a["max_prompt_tokens"], max_new_tokens=a["max_tokens"],
        default_max_new_tokens=a["default_max_tokens"], max_concurrent_requests=a["max_concurrent_requests"],
        max_stop_sequences=a["max_stop_sequences"], max_tree_depth=a["max_tree_depth"],
    )
    admission = AdmissionConfig(
        max_running=a["max_concurrent_requests"], min_running=min(a["min_running_requests"],
                                                                  a["max_concurrent_requests"]),
        latency_factor=a["admission_latency_factor"], max_queued=a["max_queued_requests"],
        queue_timeout_s=a["admission_queue_timeout_s"], queue_factor=a["admission_queue_factor"],
    )
    return GatewayConfig(
        host=a["host"], port=a["port"], verifier_addr=a["verifier_addr"], routing=routing, pool=pool,
        redis_url=a["redis_url"],
        http_port=a["http_port"], model_dir=a["model_dir"], chat_template=a["chat_template"], limits=limits,
        default_deadline_s=a["default_deadline_s"],
        request_ttl_s=a["request_ttl_s"], session_ttl_s=a["session_ttl_s"], otlp_endpoint=a["otlp_endpoint"],
        lease_ttl_s=a["lease_ttl_s"], stale_after_s=a["stale_after_s"], admission=admission,
        metrics_port=a["metrics_port"], log_level=a["log_level"], instance_id=a["instance_id"], parent_pid=a["parent_pid"], grace_s=a["grace_s"],
        max_message_bytes=a["max_message_bytes"], server_security=server_security(a, env, GATEWAY_TOKEN_ENV),
        verifier_security=channel_security(a, env, resolve_token(a["internal_token_file"], env, INTERNAL_TOKEN_ENV,
                                                                        "--internal-token-file")),
    )
