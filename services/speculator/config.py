"""Speculator service configuration: flags with environment fallbacks, read in `main()` only."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SpeculatorConfig:
    ssm_dirs: tuple[Path, ...]
    host: str = "127.0.0.1"
    port: int = 50053
    dtype: str = "float32"
    device: str = "auto"
    max_kv_tokens: int = 65536
    max_batch: int = 256
    otlp_endpoint: str | None = None
    metrics_port: int = 0
    log_level: str = "info"
    grace_s: float = 10.0
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default


def parse_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> SpeculatorConfig:
    env = dict(os.environ if env is None else env)
    p = argparse.ArgumentParser(prog="specinfer-speculator", description="Hosts SSMs and streams token trees.")
    p.add_argument("--ssm", type=Path, action="append", default=None,
                   help="SSM checkpoint directory (repeatable); env SPECINFER_SSM_DIRS (comma-separated)")
    p.add_argument("--host", default=env.get("SPECINFER_SPECULATOR_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env.get("SPECINFER_SPECULATOR_PORT", "50053")))
    p.add_argument("--dtype", default=env.get("SPECINFER_DTYPE", "float32"))
    p.add_argument("--device", default=env.get("SPECINFER_SSM_DEVICE", "auto"))
    p.add_argument("--max-kv-tokens", type=int, default=int(env.get("SPECINFER_SSM_KV_TOKENS", "65536")))
    p.add_argument("--max-batch", type=int, default=int(env.get("SPECINFER_MAX_BATCH", "256")))
    p.add_argument("--otlp-endpoint", default=env.get("SPECINFER_OTLP_ENDPOINT") or None)
    p.add_argument("--metrics-port", type=int, default=int(env.get("SPECINFER_METRICS_PORT", "0")))
    p.add_argument("--log-level", default=env.get("SPECINFER_LOG_LEVEL", "info"))
    p.add_argument("--grace-s", type=float, default=float(env.get("SPECINFER_GRACE_S", "10")))
    p.add_argument("--threads", type=int, default=int(env.get("SPECINFER_THREADS", "0")),
                   help="torch intra-op threads (0 = torch's default)")
    a = p.parse_args(argv)
    ssms = a.ssm or [Path(d) for d in env.get("SPECINFER_SSM_DIRS", "").split(",") if d]
    if not ssms:
        p.error("at least one --ssm (or SPECINFER_SSM_DIRS) is required")
    return SpeculatorConfig(tuple(ssms), a.host, a.port, a.dtype, a.device, a.max_kv_tokens, a.max_batch,
                            a.otlp_endpoint, a.metrics_port, a.log_level, a.grace_s, a.threads)
