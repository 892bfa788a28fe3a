"""Verifier service configuration: flags with environment fallbacks, read in `main()` only."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class VerifierConfig:
    model_dir: Path
    speculators: tuple[str, ...] = ()  # gRPC targets, e.g. 127.0.0.1:50053 or dns:///speculator:50053
    host: str = "127.0.0.1"
    port: int = 50052
    dtype: str = "float32"
    device: str = "auto"
    max_kv_tokens: int = 65536  # the KV budget in tokens, unless kv_budget_bytes is set
    kv_budget_bytes: int = 0
    max_batch: int = 256
    tree_width: tuple[int, ...] = (1, 1, 3, 1, 1, 1, 1, 1)
    max_tree_nodes: int = 64
    default_deadline_s: float = 300.0
    speculator_step_timeout_s: float = 5.0
    max_sessions: int = 64
    token_budget: int = 512
    max_waiting: int = 64
    admission_timeout_s: float = 30.0
    is_load_aware: bool = True  # requests without an explicit tree shape get one per step from the policy
    otlp_endpoint: str | None = None
    metrics_port: int = 0
    log_level: str = "info"
    grace_s: float = 10.0
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default


def parse_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> VerifierConfig:
    from specinfer.engine.load import parse_kv_budget
    from specinfer.limits import parse_tree_width

    env = dict(os.environ if env is None else env)
    p = argparse.ArgumentParser(prog="specinfer-verifier", description="Hosts the LLM and verifies token trees.")
    p.add_argument("--model", type=Path, default=env.get("SPECINFER_MODEL_DIR"), help="LLM checkpoint directory")
    p.add_argument("--speculator", action="append", default=None,
                   help="speculator gRPC target (repeatable); env SPECINFER_SPECULATORS (comma-separated)")
    p.add_argument("--host", default=env.get("SPECINFER_VERIFIER_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env.get("SPECINFER_VERIFIER_PORT", "50052")))
    p.add_argument("--dtype", default=env.get("SPECINFER_DTYPE", "float32"))
    p.add_argument("--device", default=env.get("SPECINFER_LLM_DEVICE", "auto"))
    p.add_argument("--kv-budget", default=env.get("SPECINFER_KV_BUDGET") or env.get("SPECINFER_KV_TOKENS", "65536"),
                   help="KV-cache budget: tokens (65536) or bytes (2GiB, 512MB)")
    p.add_argument("--max-batch", type=int, default=int(env.get("SPECINFER_MAX_BATCH", "256")))
    p.add_argument("--tree-width", default=env.get("SPECINFER_TREE_WIDTH", "1,1,3,1,1,1,1,1"))
    p.add_argument("--max-tree-nodes", type=int, default=int(env.get("SPECINFER_MAX_TREE_NODES", "64")))
    p.add_argument("--default-deadline-s", type=float, default=float(env.get("SPECINFER_DEFAULT_DEADLINE_S", "300")))
    p.add_argument("--speculator-step-timeout-s", type=float,
                   default=float(env.get("SPECINFER_SPECULATOR_STEP_TIMEOUT_S", "5")))
    p.add_argument("--max-sessions", type=int, default=int(env.get("SPECINFER_MAX_SESSIONS", "64")))
    p.add_argument("--token-budget", type=int, default=int(env.get("SPECINFER_TOKEN_BUDGET", "512")),
                   help="tokens per forward pass (trees first, then prompt chunks)")
    p.add_argument("--max-waiting", type=int, default=int(env.get("SPECINFER_MAX_WAITING", "64")),
                   help="requests that may queue for KV memory before RESOURCE_EXHAUSTED")
    p.add_argument("--fixed-tree", action="store_true",
                   default=env.get("SPECINFER_LOAD_AWARE", "1").lower() in ("0", "false", "no"),
                   help="always use the default tree shape instead of load-aware shapes")
    p.add_argument("--admission-timeout-s", type=float, default=float(env.get("SPECINFER_ADMISSION_TIMEOUT_S", "30")))
    p.add_argument("--otlp-endpoint", default=env.get("SPECINFER_OTLP_ENDPOINT") or None)
    p.add_argument("--metrics-port", type=int, default=int(env.get("SPECINFER_METRICS_PORT", "0")))
    p.add_argument("--log-level", default=env.get("SPECINFER_LOG_LEVEL", "info"))
    p.add_argument("--grace-s", type=float, default=float(env.get("SPECINFER_GRACE_S", "10")))
    p.add_argument("--threads", type=int, default=int(env.get("SPECINFER_THREADS", "0")),
                   help="torch intra-op threads (0 = torch's default)")
    a = p.parse_args(argv)
    if a.model is None:
        p.error("--model (or SPECINFER_MODEL_DIR) is required")
    kv_tokens, kv_bytes = parse_kv_budget(a.kv_budget)
    specs = a.speculator if a.speculator is not None else [s for s in env.get("SPECINFER_SPECULATORS", "").split(",") if s]
    return VerifierConfig(
        model_dir=Path(a.model), speculators=tuple(specs), host=a.host, port=a.port, dtype=a.dtype,
        device=a.device, max_kv_tokens=kv_tokens or 65536, kv_budget_bytes=kv_bytes, max_batch=a.max_batch,
        tree_width=parse_tree_width(a.tree_width), max_tree_nodes=a.max_tree_nodes,
        default_deadline_s=a.default_deadline_s, speculator_step_timeout_s=a.speculator_step_timeout_s,
        max_sessions=a.max_sessions, token_budget=a.token_budget, max_waiting=a.max_waiting,
        admission_timeout_s=a.admission_timeout_s, is_load_aware=not a.fixed_tree, otlp_endpoint=a.otlp_endpoint, metrics_port=a.metrics_port,
        log_level=a.log_level, grace_s=a.grace_s, num_threads=a.threads,
    )
