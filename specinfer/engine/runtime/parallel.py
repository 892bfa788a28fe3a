"""Tensor parallelism for the LLM over torch.distributed: one model, sharded over N ranks.

SpecInfer's evaluation (Section 6) serves LLMs that outgrow one device by splitting every layer
across GPUs. This is Megatron-style tensor parallelism:

* qkv and gate_up are split by output columns (rank r holds heads [r H/N, (r+1) H/N) and the KV
  heads they read, and 1/N of the MLP's intermediate units); o and down are split by input rows,
  so each rank's product is a partial sum, and one all-reduce per projection (two per layer)
  makes every rank's residual stream whole again. Their biases live on rank 0 only, so the sum
  adds them once. Embedding, norms (per-head q/k norms too) and lm_head are replicated; only
  rank 0 computes logits. A checkpoint's fused projections (Phi-3's qkv_proj and gate_up_proj)
  are read as the rank's share of each of their parts.
* Each rank holds its KV heads' share of the paged KV cache: the same slots, fewer heads.
  Block tables, trees and every other piece of bookkeeping exist on rank 0 only.
* Rank 0 runs the one decode loop (scheduler, trees, sampling, verification). Its model call goes
  through `LeaderModel`, which first broadcasts the step as plain tensors (token ids, positions,
  write slots, each sequence's query rows, context slots and tree mask, and for sliding-window
  layers each row's first visible key), and its KV commit
  through `LeaderKV`, which broadcasts the moves. Ranks > 0 run `serve_worker`: receive a step,
  run the same forward on their shard, repeat.
* Step messages always travel over a gloo (CPU) group, so an idle worker can wait indefinitely
  without a GPU watchdog firing; the all-reduces use NCCL on CUDA and gloo on CPU.
* A rank that dies breaks the group: rank 0 notices (a failed collective, or a spawned worker
  exiting), fails every later step with `GroupBroken` and tells its listeners (the verifier flips
  health to NOT_SERVING and exits); workers exit when rank 0's connection goes away.

Ranks start either from `spawn_group` (one host: torch.multiprocessing spawn, rank 0 being the
caller) or from an outside launcher such as torchrun (env:// rendezvous; every rank runs the same
entry point and ranks > 0 call `serve_rank`).
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specinfer.engine.models.config import ModelConfig
from specinfer.engine.models.checkpoint import engine_weights, open_checkpoint, parse_dtype
from specinfer.engine.models.transformer import DecoderModel, ForwardBatch, KVCache, SeqAttention, windowed
from specinfer.errors import UnavailableError, UserError

log = logging.getLogger(__name__)

OP_STOP, OP_FORWARD, OP_MOVE = 0, 1, 2


class GroupBroken(UnavailableError):
    """A rank of the tensor-parallel group died or a collective failed: the group cannot run."""


@dataclass(frozen=True)
class ParallelConfig:
    """Where this process stands in a tensor-parallel group. Built in `main()`s: from the flag for
    a group this process spawns (`spawned`), or from a launcher's environment (`from_env`)."""

    num_ranks: int = 1
    rank: int = 0
    local_rank: int = 0  # picks cuda:local_rank
    init_method: str = "env://"  # tcp://host:port for a spawned group
    is_launched: bool = False  # ranks were started by a launcher (torchrun), not spawned by rank 0
    timeout_s: float = 7 * 24 * 3600.0  # an idle worker waits for the next step this long

    @classmethod
    def spawned(cls, num_ranks: int) -> "ParallelConfig":
        """Rank 0 of a one-host group whose other ranks it spawns (a free localhost port)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return cls(num_ranks, init_method=f"tcp://127.0.0.1:{port}")

    @classmethod
    def from_env(cls, num_ranks: int, env: Mapping[str, str]) -> "ParallelConfig":
        """torchrun's RANK, LOCAL_RANK, WORLD_SIZE (and MASTER_ADDR/PORT for env://) when it
        launched this process, else a group to spawn."""
        if "WORLD_SIZE" not in env:
            return cls.spawned(num_ranks) if num_ranks > 1 else cls()
        world = int(env["WORLD_SIZE"])
        if num_ranks not in (1, world):
            raise UserError(f"--tensor-parallel {num_ranks} but the launcher started {world} ranks (WORLD_SIZE)")
        return cls(world, int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", env.get("RANK", "0"))),
                   is_launched=True)

    @property
    def is_parallel(self) -> bool:
        return self.num_ranks > 1


def check_divisible(cfg: ModelConfig, num_ranks: int) -> None:
    """Every rank must get whole attention heads, whole KV heads and an equal MLP share."""
    if num_ranks < 1:
        raise UserError(f"--tensor-parallel must be >= 1, got {num_ranks}")
    for what, count in (("KV heads", cfg.num_kv_heads), ("attention heads", cfg.num_heads),
                        ("MLP intermediate size", cfg.intermediate_size)):
        if count % num_ranks:
            sizes = [n for n in range(1, count + 1) if count % n == 0 and cfg.num_heads % n == 0
                     and cfg.num_kv_heads % n == 0 and cfg.intermediate_size % n == 0]
            raise UserError(f"--tensor-parallel {num_ranks} does not divide the model's {count} {what}; "
                            f"use one of {', '.join(map(str, sizes))}")


def shard_config(cfg: ModelConfig, num_ranks: int) -> ModelConfig:
    """One rank's view of the model: its heads, KV heads and intermediate units."""
    check_divisible(cfg, num_ranks)
    return replace(cfg, num_heads=cfg.num_heads // num_ranks, num_kv_heads=cfg.num_kv_heads // num_ranks,
                   intermediate_size=cfg.intermediate_size // num_ranks)


def _slicer(name: str, cfg: ModelConfig, rank: int, num_ranks: int) -> tuple[int, list[tuple[int, int]]] | None | str:
    """How rank `rank` reads tensor `name`: (dim, [(lo, hi), ...] ranges concatenated), None for
    all of it, "skip" for none of it (row-parallel biases, added once by rank 0). Fused tensors
    (Phi-3's qkv_proj and gate_up_proj) take the rank's share of each part; per-head q/k norms
    and every other norm are replicated."""
    d = cfg.head_dim
    q_part = cfg.num_heads // num_ranks * d
    kv_part = cfg.num_kv_heads // num_ranks * d
    mlp_part = cfg.intermediate_size // num_ranks

    def share(size: int, offset: int = 0) -> tuple[int, int]:
        return offset + rank * size, offset + (rank + 1) * size

    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # fused names first: they end like the parts
        q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
        return 0, [share(q_part), share(kv_part, q_rows), share(kv_part, q_rows + kv_rows)]
    if name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
        return 0, [share(mlp_part), share(mlp_part, cfg.intermediate_size)]
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return 0, [share(q_part)]
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return 0, [share(kv_part)]
    if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
        return 0, [share(mlp_part)]
    if name.endswith("o_proj.weight"):
        return 1, [share(q_part)]
    if name.endswith("down_proj.weight"):
        return 1, [share(mlp_part)]
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        return None if rank == 0 else "skip"
    return None


def load_shard(model_dir: str | Path, cfg: ModelConfig, rank: int, num_ranks: int,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights in the runner's fused layout, reading only its slices of each tensor
    (a GGUF's tensors are dequantized whole, to `dtype`, and sliced)."""
    check_divisible(cfg, num_ranks)
    state: dict[str, torch.Tensor] = {}
    for f in open_checkpoint(model_dir, dtype):
        for name in f.keys():
            how = _slicer(name, cfg, rank, num_ranks)
            if how == "skip":
                continue
            if how is None:
                state[name] = f.get_tensor(name)
                continue
            dim, ranges = how
            part = f.get_slice(name)
            pieces = [part[lo:hi] if dim == 0 else part[:, lo:hi] for lo, hi in ranges]
            state[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
    return engine_weights(shard_config(cfg, num_ranks), state)


def rank_device(device: str, local_rank: int) -> str:
    """cuda -> this rank's GPU; cpu stays cpu."""
    if device.startswith("cuda"):
        return f"cuda:{local_rank}"
    return device


class ShardGroup:
    """This process's place in the group: all-reduce for the model, the gloo group for steps."""

    def __init__(self, pc: ParallelConfig, device: str):
        self.rank, self.num_ranks = pc.rank, pc.num_ranks
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        if dist.is_initialized():
            raise RuntimeError("this process is already in a tensor-parallel group; close that one first")
        timeout = timedelta(seconds=pc.timeout_s)
        dist.init_process_group(backend, init_method=pc.init_method, world_size=pc.num_ranks, rank=pc.rank,
                                timeout=timeout)
        self.group = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else self.group

    def all_reduce(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.group)

    def broadcast(self, x: torch.Tensor) -> None:
        dist.broadcast(x, 0, group=self.control)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- the step message: a ForwardBatch as plain tensors ------------------------------------------


def encode_batch(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 tensor, bool tensor) on the CPU. A tree mask travels as its rows past the leading
    columns every query sees (the committed prefix), so its size is about the tree's squared."""
    num_tokens = int(batch.token_ids.shape[0])
    w = batch.write
    is_windowed = batch.window_starts is not None
    head = [num_tokens, len(batch.seqs), *((0, w.start, w.stop) if isinstance(w, slice) else (1, 0, 0)),
            int(is_windowed)]
    parts = [torch.tensor(head, dtype=torch.long), batch.token_ids.cpu(), batch.positions.cpu()]
    if not isinstance(w, slice):
        parts.append(w.cpu())
    if is_windowed:  # the sliding-window layers' view travels as each row's first visible key
        parts.append(torch.tensor(batch.window_starts, dtype=torch.long))
    masks = []
    for s in batch.seqs:
        ctx = s.context
        meta = [s.q_start, s.q_end, *((0, ctx.start, ctx.stop) if isinstance(ctx, slice) else (1, ctx.numel(), 0))]
        if s.mask is None:
            meta += [1 if s.is_causal else 0, 0, 0]
        else:
            mask = s.mask.cpu()
            seen_by_all = mask.all(0)
            num_prefix = int(seen_by_all.numel() if bool(seen_by_all.all()) else (~seen_by_all).nonzero()[0, 0])
            masks.append(mask[:, num_prefix:].reshape(-1))
            meta += [2, num_prefix, mask.shape[1]]
        parts.append(torch.tensor(meta, dtype=torch.long))
        if not isinstance(ctx, slice):
            parts.append(ctx.cpu())
    return torch.cat(parts), (torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool))


def decode_batch(ints: torch.Tensor, mask_bits: torch.Tensor, device) -> ForwardBatch:
    """The inverse of `encode_batch`, on `device`; asks for no logits (ranks > 0 compute none)."""
    values = ints.tolist()
    num_tokens, num_seqs, write_kind, w0, w1, is_windowed = values[:6]
    at = 6
    token_ids, positions = ints[at: at + num_tokens], ints[at + num_tokens: at + 2 * num_tokens]
    at += 2 * num_tokens
    if write_kind == 0:
        write: slice | torch.Tensor = slice(w0, w1)
    else:
        write, at = ints[at: at + num_tokens].to(device), at + num_tokens
    starts = None
    if is_windowed:
        starts, at = values[at: at + num_tokens], at + num_tokens
    seqs, mask_at = [], 0
    for _ in range(num_seqs):
        q_start, q_end, ctx_kind, c0, c1, mask_kind, num_prefix, width = values[at: at + 8]
        at += 8
        if ctx_kind == 0:
            context: slice | torch.Tensor = slice(c0, c1)
        else:
            context, at = ints[at: at + c0].to(device), at + c0
        mask = None
        if mask_kind == 2:
            n = q_end - q_start
            rest = mask_bits[mask_at: mask_at + n * (width - num_prefix)].view(n, width - num_prefix)
            mask_at += rest.numel()
            mask = torch.cat([torch.ones(n, num_prefix, dtype=torch.bool), rest], dim=1).to(device)
        seqs.append(SeqAttention(q_start, q_end, context, mask, mask_kind == 1))
    window_seqs = None if starts is None else [windowed(s, starts[s.q_start: s.q_end], device) for s in seqs]
    return ForwardBatch(token_ids.to(device), positions.to(device), write, seqs,
                        logit_rows=torch.zeros(0, dtype=torch.long, device=device), window_seqs=window_seqs,
                        window_starts=starts)


# ---- rank 0 ----------------------------------------------------------------------------------------


class Leader:
    """Rank 0's end of the group: sends steps, and knows whether the group still stands."""

    def __init__(self, group: ShardGroup, workers: list | None = None):
        self.group = group
        self.workers = list(workers or [])  # spawned worker processes (none under a launcher)
        self.broken: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if self.workers:
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def on_broken(self, listener: Callable[[str], None]) -> None:
        """Calls `listener(reason)` once the group breaks (at once if it already has)."""
        with self._lock:
            if self.broken is None:
                self._listeners.append(listener)
                return
        listener(self.broken)

    def mark_broken(self, reason: str) -> None:
        with self._lock:
            if self.broken is not None:
                return
            self.broken = reason
            listeners, self._listeners = self._listeners, []
        log.error("tensor-parallel group broken: %s", reason)
        for listener in listeners:
            listener(reason)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.workers}
        while sentinels and not self._closed.is_set():
            for s in wait(list(sentinels), timeout=0.5):
                p = sentinels.pop(s)
                p.join(timeout=1)  # its exit code
                if not self._closed.is_set():
                    self.mark_broken(f"rank {p.name} exited with code {p.exitcode}")
                    return

    def send(self, op: int, ints: torch.Tensor, bits: torch.Tensor | None = None) -> None:
        if self.broken is not None:
            raise GroupBroken(f"the tensor-parallel group is down: {self.broken}")
        try:
            num_bits = 0 if bits is None else bits.numel()
            self.group.broadcast(torch.tensor([op, ints.numel(), num_bits], dtype=torch.long))
            if ints.numel():
                self.group.broadcast(ints)
            if num_bits:
                self.group.broadcast(bits)
        except Exception as exc:
            self.mark_broken(f"sending a step failed: {exc}")
            raise GroupBroken(f"the tensor-parallel group is down: {exc}") from exc

    def run(self, fn: Callable[[], torch.Tensor]):
        """Rank 0's share of a step already sent; a failure leaves the ranks out of step."""
        try:
            return fn()
        except Exception as exc:
            self.mark_broken(f"a step failed on rank 0: {type(exc).__name__}: {exc}")
            raise GroupBroken(f"the tensor-parallel group is down: {exc}") from exc

    def close(self) -> None:
        """Stops the workers (when the group still stands), then leaves the group."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.broken is None:
            try:
                self.send(OP_STOP, torch.zeros(0, dtype=torch.long))
            except GroupBroken:
                pass
        for p in self.workers:
            p.join(timeout=10 if self.broken else 60)
            if p.is_alive():
                p.kill()
        self.group.close()


class LeaderModel:
    """Rank 0's model: broadcasts each step to the other ranks, then runs its own shard."""

    def __init__(self, model: DecoderModel, leader: Leader):
        self.model = model
        self.leader = leader

    def __getattr__(self, name: str):  # cfg, dtype, device, w, attention_backend, ...
        return getattr(self.model, name)

    def forward(self, batch: ForwardBatch, kv: KVCache, return_hidden: bool = False):
        ints, bits = encode_batch(batch)
        self.leader.send(OP_FORWARD, ints, bits)
        return self.leader.run(lambda: self.model.forward(batch, kv, return_hidden))


@dataclass
class LeaderKV(KVCache):
    """Rank 0's share of the KV cache; a commit's moves go to every rank."""

    leader: Leader | None = None

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.leader.send(OP_MOVE, torch.cat([src.cpu(), dst.cpu()]))
        self.leader.run(lambda: super(LeaderKV, self).move(src, dst))


# ---- ranks > 0 ---------------------------------------------------------------------------------


def serve_worker(model: DecoderModel, kv: KVCache, group: ShardGroup) -> None:
    """Runs every step rank 0 sends until it says stop (or its connection goes away)."""
    device = model.device
    while True:
        header = torch.zeros(3, dtype=torch.long)
        group.broadcast(header)
        op, num_ints, num_bits = header.tolist()
        ints = torch.zeros(num_ints, dtype=torch.long)
        if num_ints:
            group.broadcast(ints)
        bits = torch.zeros(num_bits, dtype=torch.bool)
        if num_bits:
            group.broadcast(bits)
        if op == OP_STOP:
            return
        if op == OP_FORWARD:
            model.forward(decode_batch(ints, bits, device), kv)
        elif op == OP_MOVE:
            half = num_ints // 2
            kv.move(ints[:half].to(device), ints[half:].to(device))
        else:
            raise RuntimeError(f"unknown step op {op}")


@dataclass(frozen=True)
class ShardSpec:
    """What every rank loads: the same checkpoint, dtype, device kind and KV slots."""

    model_dir: str
    dtype: str
    device: str
    num_slots: int
    attention: str = "sdpa"  # a resolved ExecConfig.attention: every rank runs the same backend


def build_shard(spec: ShardSpec, pc: ParallelConfig) -> tuple[DecoderModel, ShardGroup]:
    """Joins the group, then loads this rank's shard of the weights."""
    cfg = ModelConfig.from_dir(spec.model_dir)
    check_divisible(cfg, pc.num_ranks)
    device = rank_device(spec.device, pc.local_rank)
    group = ShardGroup(pc, device)
    dtype = parse_dtype(spec.dtype)
    model = DecoderModel(shard_config(cfg, pc.num_ranks), load_shard(spec.model_dir, cfg, pc.rank, pc.num_ranks, dtype),
                         dtype, device)
    model.group = group
    if spec.attention == "triton":  # metadata from each step's masks, built on every rank
        from specinfer.engine.kernels.tree_attention import TritonAttention  # triton: only for the triton backend

        model.attention_backend = TritonAttention.for_config(model.cfg)
    return model, group


def serve_rank(spec: ShardSpec, pc: ParallelConfig) -> None:
    """A rank > 0 from start to finish: join, load, serve steps until rank 0 stops."""
    model, group = build_shard(spec, pc)
    try:
        serve_worker(model, KVCache.allocate(model.cfg, spec.num_slots, model.dtype, model.device), group)
    finally:
        group.close()


def _spawned_rank(rank: int, spec: ShardSpec, pc: ParallelConfig, num_threads: int) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    try:
        serve_rank(spec, replace(pc, rank=rank, local_rank=rank))
    except Exception as exc:  # rank 0 went away, or the step failed here: exit, which breaks the group
        log.error("tensor-parallel rank %d stops: %s: %s", rank, type(exc).__name__, exc)
        raise SystemExit(1) from None


def start_group(spec: ShardSpec, pc: ParallelConfig) -> tuple[DecoderModel, Leader]:
    """Rank 0: spawns ranks 1..N-1 on this host (unless a launcher started them), joins the
    group and loads its own shard."""
    workers = []
    if not pc.is_launched:
        ctx = mp.get_context("spawn")
        for rank in range(1, pc.num_ranks):
            p = ctx.Process(target=_spawned_rank, args=(rank, spec, pc, torch.get_num_threads()),
                            name=str(rank), daemon=True)
            p.start()
            workers.append(p)
    try:
        model, group = build_shard(spec, pc)
    except BaseException:
        for p in workers:
            p.kill()
        raise
    return model, Leader(group, workers)
