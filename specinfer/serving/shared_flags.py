"""Settings that both the services and the command line have, each declared once.

A `Flag` (`settings.py`) names the setting's flag, its environment variable, how to parse it and
its default; the verifier and speculator services add these to their parsers, and so do
`specinfer generate`, `bench` and `up` (`add_declared`), which resolve them after parsing
(`resolve_declared`) the same way: the flag, else the variable, else the default. On/off settings
take `--name`, `--no-name` or `--name on|off`.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping

from specinfer.engine.runtime.exec_config import ATTENTION_BACKENDS, parse_cuda_graphs
from specinfer.limits import DEFAULT_DTYPE, DEFAULT_IS_PREFIX_CACHING, DEFAULT_SSM_DTYPE, MODEL_DTYPES, SSM_DTYPES
from specinfer.limits import DEFAULT_KV_MEMORY_FRACTION_CPU, DEFAULT_KV_MEMORY_FRACTION_CUDA, parse_kv_budget
from specinfer.serving.settings import Flag, add_flag, one_of, parse_bool, resolve_flags


def attention_flag() -> Flag:
    return Flag("--attention", "SPECINFER_ATTENTION", one_of(ATTENTION_BACKENDS), "auto",
                "attention backend: triton (one fused tree-attention launch per layer over the paged KV cache), "
                "sdpa (torch per request with a dense mask), or auto: triton on CUDA when importable, else sdpa")


def cuda_graphs_flag() -> Flag:
    return Flag("--cuda-graphs", "SPECINFER_CUDA_GRAPHS", parse_cuda_graphs, None,
                "replay captured decode/verify steps: auto (on with CUDA and the Triton backend), on or off",
                shown_default="auto", is_switch=True)


def offload_flag() -> Flag:
    return Flag("--offload", "SPECINFER_OFFLOAD", parse_bool, False,
                "keep the LLM's layer weights in pinned host memory, streamed to the GPU per layer", is_switch=True)


def model_free_flag(where: str = "the pool") -> Flag:
    return Flag("--model-free", "SPECINFER_MODEL_FREE", parse_bool, True,
                f"lookup and suffix join {where} (a pool naming either is taken as given)", is_switch=True)


def prefix_caching_flag() -> Flag:
    return Flag("--prefix-caching", "SPECINFER_PREFIX_CACHING", parse_bool, DEFAULT_IS_PREFIX_CACHING,
                "share the KV of full prompt blocks across requests with the same prefix (off: only within a "
                "session or one request's samples)", is_switch=True)


def llm_dtype_flag() -> Flag:
    return Flag("--dtype", "SPECINFER_DTYPE", one_of(MODEL_DTYPES), DEFAULT_DTYPE, "the LLM's weights dtype")


def ssm_dtype_flag(name: str = "--ssm-dtype") -> Flag:
    return Flag(name, "SPECINFER_SSM_DTYPE", one_of(SSM_DTYPES), DEFAULT_SSM_DTYPE,
                "the SSMs' dtype: auto (the fastest on this machine, measured when they load) or a dtype")


def kv_budget_flag() -> Flag:
    return Flag("--kv-budget", ("SPECINFER_KV_BUDGET", "SPECINFER_KV_TOKENS"), parse_kv_budget, (0, 0),
                "the LLM's KV cache: tokens (65536), bytes (2GiB, 512MB), or auto: --kv-memory-fraction of the "
                "memory free once the weights are loaded, at most what --max-batch requests of the longest allowed "
                "length use", shown_default="auto")


def kv_memory_fraction_flag() -> Flag:
    return Flag("--kv-memory-fraction", "SPECINFER_KV_MEMORY_FRACTION", float, None,
                "with --kv-budget auto: the share of the memory free once the weights are loaded (host RAM, or the "
                "GPU's) that the KV cache takes, as vLLM's --gpu-memory-utilization",
                shown_default=f"{DEFAULT_KV_MEMORY_FRACTION_CUDA:g} on CUDA, {DEFAULT_KV_MEMORY_FRACTION_CPU:g} on CPU",
                is_positive=True, high=1.0)


def kv_flags() -> list[Flag]:
    """The LLM's KV-cache size (`engine.runtime.memory.plan_kv`)."""
    return [kv_budget_flag(), kv_memory_fraction_flag()]


def exec_flags(llm: bool) -> list[Flag]:
    """How the models execute (engine.config.ExecConfig); `llm` adds offloading, which only the LLM has."""
    return [attention_flag(), cuda_graphs_flag()] + ([offload_flag()] if llm else [])


_DECLARED = "_declared_flags"


def add_declared(p: argparse.ArgumentParser, *flags: Flag) -> None:
    """Adds `flags` to a command's parser; `resolve_declared` fills them in after parsing."""
    for flag in flags:
        add_flag(p, flag)
    p.set_defaults(**{_DECLARED: tuple(p.get_default(_DECLARED) or ()) + flags})


def resolve_declared(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Each declared flag of the parsed command: the flag, else its variable, else its default."""
    flags = getattr(args, _DECLARED, ())
    values = resolve_flags(vars(args), flags, os.environ if env is None else env)
    for flag in flags:
        setattr(args, flag.dest, values[flag.dest])
    return args
