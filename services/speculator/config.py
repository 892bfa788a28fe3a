"""Speculator service configuration: flags with environment fallbacks, read in `main()` only.

A speculator hosts SSMs and streams their token trees to the verifier (SpecInfer, arXiv
2305.09781, Section 3); every default comes from one constant.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Mapping

from specinfer.engine.runtime.exec_config import ExecConfig, parse_auto_switch
from specinfer.errors import UserError
from specinfer.limits import (
    DEFAULT_KV_TOKENS, DEFAULT_MAX_BATCH, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_PIPELINE, DEFAULT_SSM_DTYPE,
    SPECULATOR_PORT, SUFFIX_CACHE_TOKENS,
)
from specinfer.serving.settings import DEFAULT_GRACE_S, LOCAL_HOST, Flag, add_flag, read_flags
from specinfer.serving.shared_flags import (
    cache_dir_flag, common_flags, device_flag, dtype_flag, exec_flags, host_flag, max_batch_flag, model_free_flag,
    port_flag, security_flags, ssm_flag, suffix_cache_tokens_flag,
)
from specinfer.serving.security import ServerSecurity, server_security
from specinfer.util import default_cache_dir
from specinfer.engine.runtime.load import split_pool


@dataclass(frozen=True)
class SpeculatorConfig:
    ssm_dirs: tuple[Path, ...]
    model_free: tuple[str, ...] = ()  # model-free pool members hosted next to the SSMs (lookup, suffix)
    suffix_cache_tokens: int = SUFFIX_CACHE_TOKENS  # recent outputs the suffix member shares across requests
    host: str = LOCAL_HOST
    port: int = SPECULATOR_PORT
    dtype: str = DEFAULT_SSM_DTYPE  # the SSMs' dtype (auto: the fastest here); never changes the output
    cache_dir: Path | None = None  # where load-time measurements (the SSMs' dtype) are cached; None: not cached
    device: str = "auto"
    max_kv_tokens: int = DEFAULT_KV_TOKENS
    max_batch: int = DEFAULT_MAX_BATCH
    is_pipelined: bool | None = DEFAULT_PIPELINE  # draft ahead (None: where the SSMs run on an accelerator)
    otlp_endpoint: str | None = None
    metrics_port: int = 0
    log_level: str = "info"
    instance_id: str = ""  # health answers for it too (`specinfer up` tells its own processes apart)
    parent_pid: int = 0  # drains and exits once this process (its launcher) is gone; 0 = none
    grace_s: float = DEFAULT_GRACE_S
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # this server's bound
    server_security: ServerSecurity = field(default_factory=ServerSecurity)  # the internal token, TLS
    execution: ExecConfig = field(default_factory=ExecConfig)  # the SSMs' attention backend and CUDA graphs


def _flags() -> list[Flag]:
    d = {f.name: f.default for f in fields(SpeculatorConfig)}
    return [
        ssm_flag("speculator"),
        model_free_flag("the pool this speculator hosts"),
        suffix_cache_tokens_flag(),
        host_flag("speculator"), port_flag("speculator"),
        dtype_flag("ssm"),
        cache_dir_flag(),
        device_flag("speculator"),
        Flag("--max-kv-tokens", "SPECINFER_SSM_KV_TOKENS", int, d["max_kv_tokens"], "SSM KV-cache budget in tokens",
             is_positive=True),
        max_batch_flag("speculator"),
        Flag("--pipeline", "SPECINFER_PIPELINE", lambda text: parse_auto_switch(text, "pipeline"),
             d["is_pipelined"], "draft a greedy request's next tree while the verifier verifies this one: auto "
             "(on where the SSMs run on an accelerator), on or off", shown_default="auto"),
        *exec_flags(llm=False),
        *common_flags(d),
        *security_flags(has_channels=False),
    ]


def parse_config(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> SpeculatorConfig:
    """Flags, else environment variables, else the defaults; raises UserError on a bad value."""
    env = os.environ if env is None else env
    flags = _flags()
    p = argparse.ArgumentParser(prog="specinfer-speculator", description="Hosts SSMs and streams token trees.")
    for flag in flags:
        add_flag(p, flag)
    a = read_flags(p, flags, argv, env)
    ssm_dirs, model_free = split_pool(a["ssm"], a["model_free"])
    if not ssm_dirs:
        raise UserError("the speculator needs at least one SSM (a directory or .gguf file): --ssm or "
                        "SPECINFER_SSM_DIRS")
    return SpeculatorConfig(
        ssm_dirs=ssm_dirs, model_free=model_free, suffix_cache_tokens=a["suffix_cache_tokens"], host=a["host"], port=a["port"], dtype=a["dtype"], device=a["device"],
        cache_dir=default_cache_dir(a["cache_dir"], env),
        max_kv_tokens=a["max_kv_tokens"], max_batch=a["max_batch"], is_pipelined=a["pipeline"], otlp_endpoint=a["otlp_endpoint"],
        metrics_port=a["metrics_port"], log_level=a["log_level"], instance_id=a["instance_id"], parent_pid=a["parent_pid"], grace_s=a["grace_s"], num_threads=a["threads"],
        max_message_bytes=a["max_message_bytes"], server_security=server_security(a, env),
        execution=ExecConfig(attention=a["attention"], cuda_graphs=a["cuda_graphs"]),
    )
