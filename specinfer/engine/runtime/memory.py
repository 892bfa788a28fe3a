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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specinfer.engine.models.config import ModelConfig
from specinfer.errors import UserError
from specinfer.limits import DEFAULT_KV_MEMORY_FRACTION_CPU, DEFAULT_KV_MEMORY_FRACTION_CUDA

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
            memory: Memory | None = None) -> KvPlan:
    """The KV cache of `models` ((config, dtype) pairs: the LLM's, then every co-located SSM's;
    each holds a cache of the same number of slots) on `device`. `budget` is (tokens, bytes) as
    given (`limits.parse_kv_budget`; (0, 0): the default, sized from the memory free on `device`
    now, before the weights load, or `memory`). `request_tokens` is what the longest allowed
    request reserves, `max_batch` how many run at once."""
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
