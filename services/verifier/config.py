"""Verifier service configuration: flags with environment fallbacks, read in `main()` only.

The verifier hosts the LLM and verifies token trees (SpecInfer, arXiv 2305.09781, Section 4);
the default tree is the paper's expansion config and every default comes from one constant.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from specinfer.engine.runtime.exec_config import ExecConfig
from specinfer.errors import UserError
from specinfer.limits import (
    DEFAULT_ADMISSION_TIMEOUT_S, DEFAULT_DEADLINE_S, DEFAULT_IS_PREFIX_CACHING, DEFAULT_MAX_BATCH,
    DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_SESSIONS, DEFAULT_MAX_TREE_NODES, DEFAULT_MAX_WAITING, DEFAULT_TOKEN_BUDGET, PAPER_TREE_WIDTH,
    SUFFIX_CACHE_TOKENS, RequestLimits,
)
from specinfer.serving.settings import DEFAULT_GRACE_S, LOCAL_HOST, Flag, add_flag, parse_bool, pick, read_flags
from specinfer.serving.security import ChannelSecurity, ServerSecurity, channel_security, server_security
from specinfer.limits import DEFAULT_DTYPE, DEFAULT_SSM_DTYPE, VERIFIER_PORT
from specinfer.serving.shared_flags import (
    NONE, cache_dir_flag, common_flags, default_deadline_flag, device_flag, dtype_flag, exec_flags, host_flag,
    kv_flags, max_batch_flag, max_prompt_tokens_flag, max_tokens_flag, max_tree_nodes_flag, model_free_flag,
    port_flag, prefix_caching_flag, security_flags, ssm_dtype_flag, ssm_flag, suffix_cache_tokens_flag,
    tensor_parallel_flag, tree_width_flag,
)
from specinfer.util import default_cache_dir
from specinfer.engine.runtime.load import split_pool


@dataclass(frozen=True)
class VerifierConfig:
    model_dir: Path
    speculators: tuple[str, ...] = ()  # gRPC targets, e.g. 127.0.0.1:50053 or dns:///speculator:50053
    # The pool hosted in this process (co-located: SSM directories, lookup, suffix) when no speculator
    # is configured. The command line's default is lookup and suffix: a verifier alone still speculates.
    co_located: tuple[str, ...] = ()
    ssm_dtype: str = DEFAULT_SSM_DTYPE  # co-located SSMs' dtype (auto: the fastest here); never changes the output
    suffix_cache_tokens: int = SUFFIX_CACHE_TOKENS  # recent outputs a co-located suffix member shares
    cache_dir: Path | None = None  # where load-time measurements (the SSMs' dtype) are cached; None: not cached
    host: str = LOCAL_HOST
    port: int = VERIFIER_PORT
    dtype: str = DEFAULT_DTYPE
    device: str = "auto"
    kv_budget: tuple[int, int] = (0, 0)  # (tokens, bytes) as given; (0, 0): sized from the free memory
    kv_memory_fraction: float | None = None  # the free memory's share the sized cache takes (None: the device's default)
    max_batch: int = DEFAULT_MAX_BATCH
    tree_width: tuple[int, ...] = PAPER_TREE_WIDTH
    max_tree_nodes: int = DEFAULT_MAX_TREE_NODES
    default_deadline_s: float = DEFAULT_DEADLINE_S
    speculator_step_timeout_s: float = 5.0
    max_sessions: int = DEFAULT_MAX_SESSIONS
    is_prefix_caching: bool = DEFAULT_IS_PREFIX_CACHING  # full KV blocks shared by every request with their prefix
    token_budget: int = DEFAULT_TOKEN_BUDGET
    max_waiting: int = DEFAULT_MAX_WAITING
    admission_timeout_s: float = DEFAULT_ADMISSION_TIMEOUT_S
    is_load_aware: bool = True  # requests without an explicit tree shape get one per step from the policy
    otlp_endpoint: str | None = None
    metrics_port: int = 0
    log_level: str = "info"
    instance_id: str = ""  # health answers for it too (`specinfer up` tells its own processes apart)
    parent_pid: int = 0  # drains and exits once this process (its launcher) is gone; 0 = none
    grace_s: float = DEFAULT_GRACE_S
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default
    limits: RequestLimits = field(default_factory=RequestLimits)  # checked on every request, whoever sends it
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # this server's and the speculator channels' bound
    server_security: ServerSecurity = field(default_factory=ServerSecurity)  # the internal token, TLS
    speculator_security: ChannelSecurity = field(default_factory=ChannelSecurity)  # sends the same token
    tensor_parallel: int = 1  # ranks the LLM is sharded over (spawned here, or started by torchrun)
    parallel: Any = None  # the parallel.ParallelConfig of this process (None: spawn a group if needed)
    execution: ExecConfig = field(default_factory=ExecConfig)  # attention backend, CUDA graphs, offloading


def _flags() -> list[Flag]:
    d = {f.name: f.default for f in fields(VerifierConfig)}
    return [
        Flag("--model", "SPECINFER_MODEL_DIR", Path, None, "LLM checkpoint directory or .gguf file (required)"),
        Flag("--speculator", "SPECINFER_SPECULATORS", str, d["speculators"],
             "speculator gRPC target, repeatable; the variable is comma-separated", is_list=True),
        ssm_flag("verifier"),
        model_free_flag("the pool this process hosts"),
        suffix_cache_tokens_flag(),
        ssm_dtype_flag(),
        cache_dir_flag(),
        host_flag("verifier"), port_flag("verifier"),
        dtype_flag(),
        device_flag("verifier"),
        *kv_flags(),
        max_batch_flag("verifier"),
        tree_width_flag("verifier"),
        max_tree_nodes_flag("verifier"),
        default_deadline_flag("verifier"),
        Flag("--speculator-step-timeout-s", "SPECINFER_SPECULATOR_STEP_TIMEOUT_S", float,
             d["speculator_step_timeout_s"],
             "the longest wait for a speculator's tree (a stream's first; later ones are waited for by the "
             "speculator's own pace); a speculator that owes a tree this long is dropped for the request",
             is_positive=True),
        Flag("--max-sessions", "SPECINFER_MAX_SESSIONS", int, d["max_sessions"],
             "sessions whose cached KV a ReleaseSession call can evict by name", low=0),
        prefix_caching_flag(),
        Flag("--token-budget", "SPECINFER_TOKEN_BUDGET", int, d["token_budget"],
             "tokens per forward pass (trees first, then prompt chunks)", is_positive=True),
        Flag("--max-waiting", "SPECINFER_MAX_WAITING", int, d["max_waiting"],
             "requests that may queue for KV memory before RESOURCE_EXHAUSTED", low=0),
        Flag("--admission-timeout-s", "SPECINFER_ADMISSION_TIMEOUT_S", float, d["admission_timeout_s"],
             "longest wait for KV memory", is_positive=True),
        tensor_parallel_flag("verifier"),
        *exec_flags(llm=True),
        max_prompt_tokens_flag("verifier"), max_tokens_flag("verifier"),
        Flag("--fixed-tree", NONE, parse_bool, False,
             "always use the default tree shape instead of load-aware shapes (env SPECINFER_LOAD_AWARE=0)",
             is_toggle=True),
        *common_flags(d),
        *security_flags(),
    ]


def parse_config(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> VerifierConfig:
    """Flags, else environment variables, else the defaults; raises UserError on a bad value."""
    env = os.environ if env is None else env
    flags = _flags()
    p = argparse.ArgumentParser(prog="specinfer-verifier", description="Hosts the LLM and verifies token trees.")
    for flag in flags:
        add_flag(p, flag)
    a = read_flags(p, flags, argv, env)
    if a["model"] is None:
        raise UserError("the verifier needs the LLM (a directory or .gguf file): --model or SPECINFER_MODEL_DIR")
    security = server_security(a, env)
    is_load_aware = not a["fixed_tree"] and pick(None, env, "SPECINFER_LOAD_AWARE", parse_bool, True)
    from specinfer.engine.runtime.parallel import ParallelConfig  # torch: configurations parse without it

    parallel = ParallelConfig.from_env(a["tensor_parallel"], env)
    execution = ExecConfig(attention=a["attention"], cuda_graphs=a["cuda_graphs"], offload=a["offload"])
    if a["ssm"] and a["speculator"]:
        raise UserError("--ssm (a pool in this process) and --speculator (speculator services): choose one")
    co_located: tuple[str, ...] = ()
    if not a["speculator"]:  # the pool as a list of entries, model-free members resolved
        dirs, names = split_pool(a["ssm"], a["model_free"])
        co_located = tuple(map(str, dirs)) + names
    return VerifierConfig(
        model_dir=a["model"], speculators=a["speculator"], co_located=co_located, ssm_dtype=a["ssm_dtype"],
        suffix_cache_tokens=a["suffix_cache_tokens"],
        cache_dir=default_cache_dir(a["cache_dir"], env),
        host=a["host"], port=a["port"], dtype=a["dtype"],
        device=a["device"], kv_budget=a["kv_budget"], kv_memory_fraction=a["kv_memory_fraction"],
        limits=RequestLimits(max_prompt_tokens=a["max_prompt_tokens"], max_new_tokens=a["max_tokens"]),
        max_batch=a["max_batch"], tree_width=a["tree_width"], max_tree_nodes=a["max_tree_nodes"],
        default_deadline_s=a["default_deadline_s"], speculator_step_timeout_s=a["speculator_step_timeout_s"],
        max_sessions=a["max_sessions"], is_prefix_caching=a["prefix_caching"], token_budget=a["token_budget"], max_waiting=a["max_waiting"],
        admission_timeout_s=a["admission_timeout_s"], is_load_aware=is_load_aware, otlp_endpoint=a["otlp_endpoint"],
        metrics_port=a["metrics_port"], log_level=a["log_level"], instance_id=a["instance_id"], parent_pid=a["parent_pid"], grace_s=a["grace_s"], num_threads=a["threads"],
        max_message_bytes=a["max_message_bytes"], server_security=security,
        speculator_security=channel_security(a, env, security.token),
        tensor_parallel=parallel.num_ranks, execution=execution,
        parallel=None if parallel == ParallelConfig() else parallel,  # one process: the field's default
    )
