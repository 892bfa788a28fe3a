"""The KV cache's size: a budget given in tokens or bytes, or by default one sized like vLLM's.

vLLM gives the KV cache what its `--gpu-memory-utilization` share of the device leaves once the
weights are in. Here the default budget follows the model and the memory that is free:

    tokens = fraction * (free memory - weights) / bytes per token,

never more than `max_batch` requests of the longest allowed length can use (a bigger cache never
fills) and never less than one such request needs. Bytes per token are the K and V of every layer of
every model whose cache holds each token (the LLM's, and co-located SSMs'), in their dtypes; free
memory is the device's (CUDA) or the host's RAM (MemAvailable, within the process's cgroup limit);
weights are those about to be loaded there; `fraction` is `--kv-memory-fraction`. Its default is
0.9 on CUDA, where the device is there for the model, and `DEFAULT_KV_MEMORY_FRACTION_CPU` of the
RAM on a CPU, which the rest of the machine shares and where decoding speed, not memory, bounds how
many requests run at once.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from specinfer.engine.layers import cpu_gemm
from specinfer.engine.layers.linear import can_pack
from specinfer.engine.models.checkpoint import DTYPES
from specinfer.engine.models.config import ModelConfig
from specinfer.errors import UserError
from specinfer.gguf_metadata import read_tensor_index
from specinfer.limits import DEFAULT_KV_MEMORY_FRACTION_CPU, DEFAULT_KV_MEMORY_FRACTION_CUDA, Q8_DTYPE
from specinfer.model_source import resolve

ELEMENT_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
_UNLIMITED = 1 << 60  # a cgroup limit at least this large means none


@dataclass(frozen=True)
class Memory:
    """Bytes free and in all where a cache would go (host RAM or one device), and its name."""

    free_bytes: int
    total_bytes: int
    where: str  # "RAM", "cuda:0"


@dataclass(frozen=True)
class KvPlan:
    """How many tokens the KV cache holds, what one token takes, and why that many."""

    num_tokens: int
    bytes_per_token: int
    reason: str

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def describe(self) -> str:
        """'KV cache: 8,192 tokens in 360 MiB (45 KiB a token; 2% of the 17.2 GiB RAM free ...)'."""
        return (f"KV cache: {self.num_tokens:,} tokens in {format_size(self.num_bytes)} "
                f"({format_size(self.bytes_per_token)} a token; {self.reason})")


def format_size(num_bytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{int(num_bytes)} B"


# ---- what the models take -------------------------------------------------------------------
def num_parameters(cfg: ModelConfig) -> int:
    """The model's weights, counted from its config (embeddings, attention, MLP, norms, head)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * (attention + mlp + 2 * cfg.hidden_size) + embeddings + cfg.hidden_size


# Bytes a weight at most, block codes as the CPU kernel keeps them (`layers.cpu_gemm.pack_codes`,
# `layers.embedding.CodedTable`): a code (4 bits where the type's span 16 values, else a byte) and
# a float32 scale and offset per block.
CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 8, "Q8_0": 8}
CODE_BLOCKS = {"Q6_K": 16}  # else 32


def coded_bytes(*ggml_types: str, is_embedding: bool = False) -> float:
    """At most what one weight of a block-coded matrix takes loaded, for the types of the parts it
    fuses (q, k, v; gate, up), which share one layout: their widest codes and smallest block (an
    embedding's codes take a byte)."""
    bits = 8 if is_embedding else max(CODE_BITS[t] for t in ggml_types)
    return bits / 8 + 8 / min(CODE_BLOCKS.get(t, 32) for t in ggml_types)


def head_parameters(cfg: ModelConfig, is_packed: bool) -> int:
    """The LM head's weights beyond what `num_parameters` counts: a draft's head keeps only the
    rows of its reduced vocabulary (`ModelConfig.head_token_ids`), and a tied head is a copy of
    the embedding once it has rows of its own or is packed for the CPU's kernels (`is_packed`)."""
    rows = len(cfg.head_token_ids) or cfg.vocab_size
    if not cfg.tie_word_embeddings:
        return (rows - cfg.vocab_size) * cfg.hidden_size
    return rows * cfg.hidden_size if is_packed or cfg.head_token_ids else 0


def weight_bytes(model, dtype: str, device: str = "cpu") -> int:
    """What a model's weights take once loaded on `device` (one process, no tensor parallelism):
    its parameters at `dtype`'s element size, except where they stay block codes on a CPU with the
    kernel: a GGUF's coded matrices and token embedding in float32 (`coded_bytes`; its float16
    and bfloat16 matrices stay 16-bit, which holds them exactly), and a q8_0 SSM's matrices and
    embedding (8-bit codes). The LM head counts as `head_parameters` says: a tied head packed on
    a CPU counts twice, apart from the embedding the lookups read."""
    source = resolve(model)
    cfg = ModelConfig.from_dir(source)
    is_cpu_codes = str(device) == "cpu" and cpu_gemm.available()
    if dtype == Q8_DTYPE:
        if not is_cpu_codes:
            return (num_parameters(cfg) + head_parameters(cfg, False)) * element_size("float32")
        norms = cfg.hidden_size * (2 * cfg.num_layers + 1)
        matrices = num_parameters(cfg) + head_parameters(cfg, True) - norms
        return int(matrices * coded_bytes("Q8_0") + norms * 4)
    size = element_size(dtype)
    if not (source.is_gguf and is_cpu_codes and dtype == "float32"):
        is_packed = dtype in DTYPES and can_pack(torch.device(device), DTYPES[dtype])
        return (num_parameters(cfg) + head_parameters(cfg, is_packed)) * size
    groups: dict[str, list] = {}
    total = 0.0
    for entry in read_tensor_index(source.meta_dir)[1]:
        numel = math.prod(entry.shape)
        if len(entry.shape) != 2:
            total += numel * size
        elif entry.name == "model.embed_tokens.weight":
            is_coded = entry.ggml_type in CODE_BITS
            total += numel * (coded_bytes(entry.ggml_type, is_embedding=True) if is_coded else size)
            if cfg.tie_word_embeddings:  # the LM head's packed copy
                groups.setdefault("lm_head", []).append((entry.ggml_type, numel))
        else:
            fused = _QKV.sub(".qkv", _GATE_UP.sub(".gate_up", entry.name))
            groups.setdefault(fused, []).append((entry.ggml_type, numel))
    for parts in groups.values():
        numel = sum(n for _, n in parts)
        if all(t in CODE_BITS for t, _ in parts):
            total += numel * coded_bytes(*(t for t, _ in parts))
        elif all(t in ("F16", "BF16") for t, _ in parts):
            total += numel * 2  # packed as stored: 16 bits hold them exactly
        else:
            total += numel * size
    return int(total)


_QKV = re.compile(r"\.(?:q_proj|k_proj|v_proj)\.weight$")
_GATE_UP = re.compile(r"\.(?:gate_proj|up_proj)\.weight$")


def element_size(dtype: str) -> int:
    if dtype not in ELEMENT_SIZES:
        raise UserError(f"unsupported dtype {dtype!r}: choose one of {', '.join(ELEMENT_SIZES)}")
    return ELEMENT_SIZES[dtype]


# ---- what is free ---------------------------------------------------------------------------
def host_memory(meminfo: str | None = None, cgroup_root: Path = Path("/sys/fs/cgroup")) -> Memory:
    """The host's RAM: MemAvailable and MemTotal, within the process's cgroup (v2 or v1) limit."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            meminfo = ""
    fields = {}
    for line in meminfo.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    total = fields.get("MemTotal") or _sysconf_total()
    free = fields.get("MemAvailable", fields.get("MemFree", total))
    limit, used = _cgroup_limit(cgroup_root)
    if limit is not None:
        total, free = min(total, limit), min(free, max(0, limit - used))
    return Memory(free, total, "RAM")


def _sysconf_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _cgroup_limit(root: Path) -> tuple[int | None, int]:
    """(the memory limit, the memory in use) of this process's cgroup; (None, 0) without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw = (root / limit_file).read_text().strip()
            used = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if raw.isdigit() and int(raw) < _UNLIMITED:
            return int(raw), used
        return None, 0
    return None, 0


def device_memory(device) -> Memory:
    """What is free on `device`: a CUDA device's memory, else the host's RAM."""
    import torch  # torch: the light configuration path plans memory too

    dev = torch.device(device)
    if dev.type != "cuda":
        return host_memory()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    return Memory(free, total, f"cuda:{index}")


# ---- the plan -------------------------------------------------------------------------------
def plan_kv(models: Sequence[tuple[ModelConfig, str]], device: str = "cpu", budget: tuple[int, int] = (0, 0),
            fraction: float | None = None, request_tokens: int = 0, max_batch: int = 1,
            memory: Memory | None = None, weights: int | None = None) -> KvPlan:
    """The KV cache of `models` ((config, dtype) pairs: the LLM's, then every co-located SSM's;
    each holds a cache of the same number of slots) on `device`. `budget` is (tokens, bytes) as
    given (`limits.parse_kv_budget`; (0, 0): the default, sized from the memory free on `device`
    now, before the weights load, or `memory`). `request_tokens` is what the longest allowed
    request reserves, `max_batch` how many run at once; `weights` what the models' weights take once
    loaded (`weight_bytes`; default: their parameters at their dtypes' element sizes)."""
    is_cuda = str(device).startswith("cuda")
    per_token = sum(cfg.kv_bytes_per_token(element_size(dtype)) for cfg, dtype in models)
    tokens, num_bytes = budget
    if tokens:
        return KvPlan(tokens, per_token, "--kv-budget")
    if num_bytes:
        return KvPlan(max(1, num_bytes // per_token), per_token, f"--kv-budget {format_size(num_bytes)}")
    if fraction is None:
        fraction = DEFAULT_KV_MEMORY_FRACTION_CUDA if is_cuda else DEFAULT_KV_MEMORY_FRACTION_CPU
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"--kv-memory-fraction must be in (0, 1], got {fraction}")
    if weights is None:
        weights = sum(num_parameters(cfg) * element_size(dtype) for cfg, dtype in models)
    memory = memory or device_memory(device)
    room = max(0, memory.free_bytes - weights)
    tokens = int(fraction * room) // per_token
    reason = f"{fraction:g} of the {format_size(room)} of {memory.where} free once {format_size(weights)} of weights load"
    request_tokens = max(1, request_tokens)
    need = request_tokens * max(1, max_batch)
    if tokens > need:
        return KvPlan(need, per_token, f"what {max_batch} requests of {request_tokens:,} tokens use (--max-batch); "
                                       f"{reason} would hold {tokens:,}")
    if tokens < request_tokens:
        if request_tokens * per_token > room:
            raise UserError(f"the KV cache for one request of {request_tokens:,} tokens needs "
                            f"{format_size(request_tokens * per_token)}, but {memory.where} has "
                            f"{format_size(room)} free once the weights are loaded; lower --max-prompt-tokens or "
                            "--max-tokens, or give --kv-budget")
        return KvPlan(request_tokens, per_token, f"one request of the longest allowed length; {reason} "
                                                 f"would hold {tokens:,}")
    return KvPlan(tokens, per_token, reason)
