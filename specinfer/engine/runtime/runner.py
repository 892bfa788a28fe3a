"""Model runner: turns plain-Python work items into tensors, runs the model, commits KV.

This is the one place where bookkeeping becomes tensors (`prepare`). A work item appends new
tokens to a sequence after its committed prefix and any scratch tokens already written this step.
Each new token may attend to the whole committed prefix plus its ancestors among the scratch
tokens: SpecInfer's topology-aware causal mask (Section 4.2). A plain chain (prefill, decode) is
the degenerate tree whose every node has the previous one as parent. A model with sliding-window
layers also gets, once per step, the view those layers attend through (`ForwardBatch.window_seqs`
and `window_starts`): each token sees only the keys at most window - 1 positions before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specinfer.engine.scheduling.blocks import BlockAllocator, BlockHash, SequenceKV
from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime.exec_config import ExecConfig
from specinfer.errors import UserError
from specinfer.limits import DEFAULT_DTYPE, DEFAULT_KV_BLOCK_SIZE, DEFAULT_RUNNER_KV_TOKENS
from specinfer.engine.models.checkpoint import compute_dtype, stream_weights
from specinfer.engine.models.transformer import DecoderModel, ForwardBatch, KVCache, SeqAttention, windowed
from specinfer.engine.drafting.tree import is_chain, visibility, window_starts
from specinfer.engine.runtime.backend import apply_exec, resolve_exec
from specinfer.engine.runtime.offload import offload_model

DEFAULT_BLOCK_SIZE = DEFAULT_KV_BLOCK_SIZE


@dataclass
class Work:
    """New tokens for one sequence.

    `parents` covers the whole scratch region (tokens written past `seq.num_committed` earlier
    this step, then the new ones): each entry is the parent's scratch index, or -1 for a token
    that hangs directly off the committed prefix.
    """

    seq: SequenceKV
    token_ids: list[int]
    positions: list[int]
    parents: list[int]
    logits: str | int = "all"  # "all" | "last" | "none" | n: the last n rows

    @property
    def num_scratch_before(self) -> int:
        return len(self.parents) - len(self.token_ids)


def chain_work(seq: SequenceKV, token_ids: list[int], logits: str = "last") -> Work:
    """Appends a plain chain of tokens right after the committed prefix."""
    start = seq.num_committed
    n = len(token_ids)
    return Work(seq, list(token_ids), list(range(start, start + n)), list(range(-1, n - 1)), logits)


class ModelRunner:
    """One model, its preallocated KV cache, and the allocator that shares the cache out."""

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv: KVCache | None = None):
        """`kv`: a cache of `num_blocks * block_size` slots made elsewhere (a tensor-parallel
        leader's); by default one is allocated for `model`."""
        self.model = model
        self.cfg = model.cfg
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.kv = kv if kv is not None else KVCache.allocate(model.cfg, num_blocks * block_size, model.dtype,
                                                             model.device)
        self.max_context = model.cfg.max_context  # a sliding window does not cap it: its layers really window
        self.window = model.cfg.attention_window  # None when no layer is windowed
        self.on_forward: Callable[[int], None] | None = None  # told the token count of every forward
        # A kernels.TritonAttention given each step's metadata from the work items (no dense masks).
        self.tree_backend = None
        self.graphs = None  # a kernels.cuda_graphs.GraphRunner routing `run` through captured steps
        self.dtype_choice = None  # a dtype_choice.DtypeChoice when the dtype was measured at load time

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, dtype: str = DEFAULT_DTYPE, device: str = "cpu",
        max_kv_tokens: int = DEFAULT_RUNNER_KV_TOKENS,
        block_size: int = DEFAULT_BLOCK_SIZE, exec_cfg: ExecConfig | None = None,
    ) -> "ModelRunner":
        """Loads a checkpoint directory or a GGUF file into one process (`assemble.load_runner`
        shards it over a tensor-parallel group). `exec_cfg` picks the attention backend, CUDA
        graphs and offloading (resolved for `device` here)."""
        cfg = ModelConfig.from_dir(model_dir)
        torch_dtype, _ = compute_dtype(dtype, device)  # an unknown dtype or flag fails before any weights are read
        ex = resolve_exec(exec_cfg or ExecConfig(), device)
        # read a weight at a time, each laid out before the next is read, a GGUF's dequantized
        # straight to the compute dtype: a whole float32 copy of a quantized model would take
        # several times the memory the model holds
        with stream_weights(model_dir, cfg, torch_dtype) as weights:
            return cls.from_weights(cfg, weights, dtype, device, max_kv_tokens, block_size, ex)

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: str = DEFAULT_DTYPE, device: str = "cpu",
        max_kv_tokens: int = DEFAULT_RUNNER_KV_TOKENS, block_size: int = DEFAULT_BLOCK_SIZE,
        exec_cfg: ExecConfig | None = None,
    ) -> "ModelRunner":
        """A one-process runner over weights in the runner's layout (`checkpoint.engine_weights`,
        or `checkpoint.stream_weights`, which reads each as it is taken), cast to
        `dtype` on `device`; `weights` themselves are left as they are, so one checkpoint read can
        build runners in several dtypes."""
        torch_dtype, is_q8_0 = compute_dtype(dtype, device)
        ex = resolve_exec(exec_cfg or ExecConfig(), device)
        if ex.offload:  # built in host memory; only the resident tensors and one layer at a time reach the GPU
            model = offload_model(DecoderModel(cfg, weights, torch_dtype, "cpu", is_packed=False), device)
        else:
            model = DecoderModel(cfg, weights, torch_dtype, device, is_q8_0=is_q8_0)
        runner = cls(model, num_blocks=-(-max_kv_tokens // block_size), block_size=block_size)
        apply_exec(runner, ex)
        return runner

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel group; nothing for a one-process model."""
        leader = getattr(self.model, "leader", None)
        if leader is not None:
            leader.close()

    def new_sequence(self, root: BlockHash | None = None) -> SequenceKV:
        """An empty sequence; with a cache `root` its full committed blocks become shareable."""
        return SequenceKV(self.allocator, root)

    # ---- tensors are built here and nowhere else -------------------------------------------

    def prepare(self, works: list[Work]) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """Packs work items into one ForwardBatch; returns it and each item's logit-row span."""
        device = self.model.device
        token_ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        seqs: list[SeqAttention] = []
        logit_rows: list[int] = []
        spans: list[tuple[int, int]] = []
        is_all_rows = True
        single_write: slice | None = None  # set only when one item is in the batch
        tree = self.tree_backend if self.model.attention_backend is self.tree_backend else None
        requests = []  # with `tree`: each item's kernels.TreeRequest
        windows = _Windows(self.window, tree is not None, device)
        for work in works:
            seq = work.seq
            n = len(work.token_ids)
            start = seq.num_committed + work.num_scratch_before
            end = start + n
            if end > self.max_context:
                raise UserError(f"sequence of {end} tokens exceeds the model's context of {self.max_context}")
            seq.ensure_capacity(end)
            q_start = len(token_ids)
            token_ids.extend(work.token_ids)
            positions.extend(work.positions)
            context, single_write = self._place(seq, start, end, write_slots, len(works) == 1)
            starts = windows.starts_of(work)
            if tree is not None:
                from specinfer.engine.kernels.tree_attention import TreeRequest  # triton: only with a tree backend

                requests.append(TreeRequest(q_start, seq.num_committed, work.parents, context, num_new=n,
                                            window_starts=starts))
                mask, is_causal = None, False  # the backend reads `requests`' ancestor bits instead
            else:
                mask, is_causal = self._mask(work, seq.num_committed, end, device)
            seqs.append(SeqAttention(q_start, q_start + n, context, mask, is_causal))
            windows.add(seqs[-1], starts)
            first_row = len(logit_rows)
            num_rows = {"all": n, "last": 1, "none": 0}.get(work.logits, work.logits)
            logit_rows.extend(range(q_start + n - num_rows, q_start + n))
            is_all_rows = is_all_rows and num_rows == n
            spans.append((first_row, len(logit_rows)))
        write = single_write or torch.tensor(write_slots, dtype=torch.long, device=device)
        batch = ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write=write,
            seqs=seqs,
            logit_rows=None if is_all_rows else torch.tensor(logit_rows, dtype=torch.long, device=device),
        )
        batch.window_seqs, batch.window_starts = windows.finish(seqs)
        if tree is not None:
            tree.prepare(batch.seqs, requests, device, window_seqs=batch.window_seqs)
        return batch, spans

    def _place(self, seq: SequenceKV, start: int, end: int, write_slots: list[int], is_alone: bool
               ) -> tuple[slice | torch.Tensor, slice | None]:
        """Where an item's tokens [start, end) attend (its context's KV slots) and are written
        (appended to `write_slots`); the write as one slice too where the item is alone in the
        batch and its slots are contiguous."""
        base = seq.contiguous_start(end)
        if base is not None:
            write_slots.extend(range(base + start, base + end))
            return slice(base, base + end), (slice(base + start, base + end) if is_alone else None)
        all_slots = seq.slots(0, end)
        write_slots.extend(all_slots[start:])
        return torch.tensor(all_slots, dtype=torch.long, device=self.model.device), None

    @staticmethod
    def _mask(work: Work, num_committed: int, end: int, device) -> tuple[torch.Tensor | None, bool]:
        """The (n, end) attention mask of the new tokens: committed prefix plus scratch ancestors."""
        n = len(work.token_ids)
        if is_chain(work.parents):
            if n == 1:
                return None, False
            if end == n:
                return None, True
            # (n, end): a causal chain after a fully visible prefix.
            return torch.ones(n, end, dtype=torch.bool, device=device).tril(diagonal=end - n), False
        num_scratch = len(work.parents)
        limits, extras = visibility(work.parents)
        limits, extras = limits[num_scratch - n :], extras[num_scratch - n :]
        cols = torch.arange(num_scratch, device=device)
        scratch = cols.unsqueeze(0) < torch.tensor(limits, device=device).unsqueeze(1)  # (n, S)
        extra_rows = [r for r, cs in enumerate(extras) for _ in cs]
        if extra_rows:
            extra_cols = [c for cs in extras for c in cs]
            scratch[extra_rows, extra_cols] = True
        if num_committed == 0:
            return scratch, False
        prefix = torch.ones(n, num_committed, dtype=torch.bool, device=device)
        return torch.cat([prefix, scratch], dim=1), False

    # ---- stages ------------------------------------------------------------------------------

    def run(self, works: list[Work]) -> list[torch.Tensor]:
        """One forward pass over all work items; returns each item's fp32 logits (rows, vocab)."""
        batch, spans = self.prepare(works)
        logits = self.model.forward(batch, self.kv)
        if self.on_forward is not None:
            self.on_forward(int(batch.token_ids.shape[0]))
        return [logits[a:b] for a, b in spans]

    def prefill(self, seq: SequenceKV, token_ids: list[int], chunk_size: int = 512) -> torch.Tensor | None:
        """Appends and commits a chain of tokens; returns the logits after the last one."""
        return self.prefill_batch([(seq, token_ids)], chunk_size)[0]

    def prefill_batch(
        self, items: list[tuple[SequenceKV, list[int]]], chunk_size: int = 512
    ) -> list[torch.Tensor | None]:
        """Prefills several sequences together, `chunk_size` tokens of each per forward pass."""
        last: list[torch.Tensor | None] = [None] * len(items)
        offset = 0
        while True:
            idx = [i for i, (_, ids) in enumerate(items) if offset < len(ids)]
            if not idx:
                return last
            chunks = [items[i][1][offset : offset + chunk_size] for i in idx]
            logits = self.run([chain_work(items[i][0], c, "last") for i, c in zip(idx, chunks)])
            for i, c, rows in zip(idx, chunks, logits):
                items[i][0].advance(c)
                last[i] = rows
            offset += chunk_size

    def commit(self, seq: SequenceKV, scratch_indices: list[int], token_ids: list[int] | None = None) -> None:
        """Makes the given scratch tokens (in order) the next committed slots; drops the rest.
        `token_ids`: the tokens they hold, which a cached sequence needs to address its blocks."""
        base = seq.num_committed
        moves = [(base + s, base + j) for j, s in enumerate(scratch_indices) if s != j]
        if moves:
            src = torch.tensor([seq.slot(a) for a, _ in moves], dtype=torch.long, device=self.model.device)
            dst = torch.tensor([seq.slot(b) for _, b in moves], dtype=torch.long, device=self.model.device)
            self.kv.move(src, dst)
        if token_ids is None:
            if seq.root is not None:
                raise ValueError("a cached sequence commits its tokens with their ids")
            seq.num_committed = base + len(scratch_indices)
        else:
            if len(token_ids) != len(scratch_indices):
                raise ValueError("one token id per committed scratch token")
            seq.advance(token_ids)


class _Windows:
    """A step's sliding-window view (`ForwardBatch.window_seqs` and `window_starts`), gathered
    while `ModelRunner.prepare` packs the work items: per query, the first key the window lets
    it see; per sequence, its windowed mask (SDPA; the Triton backend reads the starts instead)."""

    def __init__(self, window: int | None, is_tree: bool, device):
        self.window, self.is_tree, self.device = window, is_tree, device
        self.seqs: list[SeqAttention] = []
        self.all_starts: list[int] = []
        self.is_hiding = False

    def starts_of(self, work: Work) -> list[int] | None:
        """The work's per-query first visible keys, None when the window hides nothing from it."""
        if self.window is None or max(work.positions, default=0) < self.window:
            return None
        return window_starts(work.parents, len(work.token_ids), work.seq.num_committed, work.positions, self.window)

    def add(self, seq: SeqAttention, starts: list[int] | None) -> None:
        if self.window is None:
            return
        n = seq.q_end - seq.q_start
        self.all_starts.extend(starts or [0] * n)
        if starts is None:
            self.seqs.append(seq)
        else:
            self.is_hiding = True
            self.seqs.append(seq if self.is_tree else windowed(seq, starts, self.device))

    def finish(self, seqs: list[SeqAttention]) -> tuple[list[SeqAttention], list[int] | None]:
        if not self.is_hiding:
            return seqs, None
        return self.seqs, self.all_starts

