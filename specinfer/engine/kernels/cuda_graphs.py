"""CUDA graphs for verification and decode steps (SpecInfer Section 4.2, tree-based parallel decoding).

An LLM step of SpecInfer is one forward pass over a batch of token trees; for a small model or
a small batch its time is dominated by kernel launches and Python, not by arithmetic. This
module captures `DecoderModel.forward` once per *bucket* (padded number of requests B, padded
tree size N: decode is N = 1; mask words W, two for a drafting level after 64 scratch nodes) and
replays it, after copying the step's inputs into the bucket's
static buffers:

* rows: request b owns rows [b N, b N + N); its n real tree nodes come first, the N - n padding
  rows repeat its last node (same token, position, cache slot and mask row, so they write the
  same K/V to the same slot and change nothing). Padding requests repeat request 0.
* attention: a `TritonAttention` backend with static `TreeAttentionMetadata` (slot lists sized
  for `max_context` keys per request, ancestor bit words, a fixed tile schedule, and for a model
  with sliding-window layers each row's first visible key); every per-step quantity, including
  the key-loop bounds, is read from device memory, so one graph serves every prefix length.

Without CUDA nothing is captured: `GraphRunner(capture=False)` runs the same static-buffer path
eagerly (on CPU through Triton's interpreter), which is how the padding logic is tested.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer.engine.kernels.tree_attention import (
    TILE_FIELDS,
    WORD_BITS,
    TreeAttentionMetadata,
    TritonAttention,
    _ancestor_words,
    auto_num_splits,
    choose_block_m,
)
from specinfer.engine.drafting.tree import window_starts
from specinfer.engine.models.transformer import ForwardBatch

DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
DEFAULT_TREE_SIZES = (1, 16, 32, 64)


def graphs_available(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


@dataclass
class _Bucket:
    batch: int  # padded number of requests B
    tokens: int  # padded tokens per request N
    key: list  # the sentinel `seqs` object the backend maps to `meta`
    window_key: list | None  # the sentinel `window_seqs` object (sliding-window layers), if any
    token_ids: torch.Tensor  # (B N,)
    positions: torch.Tensor  # (B N,)
    write: torch.Tensor  # (B N,)
    meta: TreeAttentionMetadata
    batch_obj: ForwardBatch
    graph: object | None = None
    logits: torch.Tensor | None = None  # (B N, V), the graph's output buffer


class GraphRunner:
    """Runs `ModelRunner` work items through captured (or, without CUDA, eager) static steps.

    `run(works)` returns what `ModelRunner.run(works)` returns, for work items that fit a bucket
    and `max_context`; anything else falls back to `ModelRunner.run`. An item may follow scratch
    nodes from earlier in the step (an SSM's later levels of a token tree): its rows see them
    through the ancestor bits, so a draft's every level replays a graph too.
    """

    def __init__(
        self,
        runner,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        tree_sizes: tuple[int, ...] = DEFAULT_TREE_SIZES,
        max_context: int | None = None,
        capture: bool | None = None,
        num_splits: int | None = None,
    ):
        model = runner.model
        if not isinstance(model.attention_backend, TritonAttention):
            raise ValueError("GraphRunner needs model.attention_backend to be a TritonAttention")
        self.runner = runner
        self.model = model
        self.backend: TritonAttention = model.attention_backend
        self.device = model.device
        self.capture = graphs_available(self.device) if capture is None else bool(capture)
        if self.capture and not graphs_available(self.device):
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.tree_sizes = tuple(sorted(tree_sizes))
        self.max_context = min(max_context or runner.max_context, runner.max_context)
        self.num_splits = num_splits
        self.window = model.cfg.attention_window  # None when no layer is windowed
        # One cache slot that padding and capture-time dummy steps may scribble on.
        self._trash_block = runner.allocator.allocate(1)
        self.trash_slot = self._trash_block[0] * runner.allocator.block_size
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.num_replays = 0
        self.num_fallbacks = 0
        self._eager_run = runner.run  # bound before `install` may shadow it

    def install(self) -> "GraphRunner":
        """Routes `runner.run` (and so prefill, verification, decode) through this object."""
        self.runner.run = self.run
        return self

    def uninstall(self) -> None:
        if self.runner.__dict__.get("run") == self.run:
            del self.runner.run

    def close(self) -> None:
        """Uninstalls, drops the graphs and returns the trash block to the allocator."""
        self.uninstall()
        self._buckets.clear()
        if self._trash_block:
            self.runner.allocator.free(self._trash_block)
            self._trash_block = []

    # ---- buckets -------------------------------------------------------------------------------

    def bucket_shape(self, works) -> tuple[int, int, int] | None:
        """(padded requests B, padded new tokens N, mask words W) of the bucket `works` fit, or
        None. W covers each item's scratch region: the new tokens plus, for an SSM's later levels
        of a token tree, the nodes it drafted earlier in the step."""
        if not works:
            return None
        max_new = max(len(w.token_ids) for w in works)
        b = next((x for x in self.batch_sizes if x >= len(works)), None)
        n = next((x for x in self.tree_sizes if x >= max_new), None)
        if b is None or n is None:
            return None
        if any(w.seq.num_committed + len(w.parents) > self.max_context for w in works):
            return None
        scratch = max(n, max(len(w.parents) for w in works))
        return b, n, max(1, -(-scratch // WORD_BITS))

    def _bucket(self, batch: int, tokens: int, words: int) -> _Bucket:
        found = self._buckets.get((batch, tokens, words))
        if found is not None:
            return found
        dev = self.device
        group = self.backend.group
        num_rows = batch * tokens
        block_m = choose_block_m(tokens, group)
        tokens_per_tile = block_m // group
        tiles_per_req = -(-tokens // tokens_per_tile)
        splits = self.num_splits or self.backend.num_splits
        if splits is None:
            splits = auto_num_splits(batch * tiles_per_req, self.backend.num_kv_heads, self.max_context, dev)
        meta = TreeAttentionMetadata(
            req=torch.zeros(batch, 8, dtype=torch.int64, device=dev),
            tiles=torch.zeros(batch * tiles_per_req, TILE_FIELDS, dtype=torch.int64, device=dev),
            slots=torch.full((batch * self.max_context,), self.trash_slot, dtype=torch.int64, device=dev),
            bits=torch.zeros(num_rows * words, dtype=torch.int64, device=dev),
            num_tokens=num_rows,
            group=group,
            block_m=block_m,
            tokens_per_tile=tokens_per_tile,
            num_splits=splits,
            lows=None if self.window is None else torch.zeros(num_rows, dtype=torch.int64, device=dev),
        )
        key: list = []  # identity only: the backend maps this object to `meta`
        window_key: list | None = None if self.window is None else []
        token_ids = torch.zeros(num_rows, dtype=torch.int64, device=dev)
        positions = torch.zeros(num_rows, dtype=torch.int64, device=dev)
        write = torch.full((num_rows,), self.trash_slot, dtype=torch.int64, device=dev)
        bucket = _Bucket(
            batch, tokens, key, window_key, token_ids, positions, write, meta,
            ForwardBatch(token_ids=token_ids, positions=positions, write=write, seqs=key, logit_rows=None,
                         window_seqs=window_key),
        )
        self._fill_dummy(bucket)
        if self.capture:
            self._capture(bucket)
        self._buckets[(batch, tokens, words)] = bucket
        return bucket

    def _fill_dummy(self, bucket: _Bucket) -> None:
        """A harmless step: every row writes and reads only the trash slot."""
        b_, n_ = bucket.batch, bucket.tokens
        words = bucket.meta.bits.numel() // (b_ * n_)
        req = [[b * n_, n_, 1, 1, b * self.max_context, b * n_ * words, words, 0] for b in range(b_)]
        bucket.meta.req.copy_(torch.tensor(req, dtype=torch.int64))
        tiles = [[b, t0, 1, 0] for b in range(b_) for t0 in range(0, n_, bucket.meta.tokens_per_tile)]
        bucket.meta.tiles.copy_(torch.tensor(tiles, dtype=torch.int64))
        bucket.meta.slots.fill_(self.trash_slot)
        bucket.write.fill_(self.trash_slot)
        if bucket.meta.lows is not None:
            bucket.meta.lows.zero_()

    def _capture(self, bucket: _Bucket) -> None:
        self.backend.set_metadata(bucket.key, bucket.meta, bucket.window_key)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: compiles kernels, allocates split buffers
            for _ in range(2):
                self.model.forward(bucket.batch_obj, self.runner.kv)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.logits = self.model.forward(bucket.batch_obj, self.runner.kv)
        bucket.graph = graph

    # ---- steps ---------------------------------------------------------------------------------

    def _fill(self, bucket: _Bucket, works) -> None:
        b_pad, n_pad = bucket.batch, bucket.tokens
        meta = bucket.meta
        words = meta.bits.numel() // (b_pad * n_pad)
        tpt = meta.tokens_per_tile
        token_ids: list[int] = []
        positions: list[int] = []
        write: list[int] = []
        req: list[list[int]] = []
        tiles: list[list[int]] = []
        bits: list[list[int]] = []
        slot_rows: list[list[int]] = []
        lows: list[int] = []
        for b in range(b_pad):
            w = works[b] if b < len(works) else works[0]
            seq = w.seq
            n = len(w.token_ids)
            committed = seq.num_committed
            first = committed + w.num_scratch_before  # the new tokens follow the step's earlier scratch nodes
            kv_len = first + n
            seq.ensure_capacity(kv_len)
            slots = seq.slots(0, kv_len)
            pad = n_pad - n
            token_ids += w.token_ids + [w.token_ids[-1]] * pad
            positions += w.positions + [w.positions[-1]] * pad
            write += slots[first:] + [slots[-1]] * pad
            rows, _, num_words = _ancestor_words(w.parents, n)
            rows = [r + [0] * (words - num_words) for r in rows]
            bits += rows + [rows[-1]] * pad
            last_vis = [first + i for i in range(n)] + [kv_len - 1] * pad
            starts = self._window_starts(w)
            starts += [starts[-1]] * pad
            lows += starts
            req.append([b * n_pad, n_pad, kv_len, committed, b * self.max_context, b * n_pad * words, words, 0])
            for t0 in range(0, n_pad, tpt):
                tiles.append([b, t0, max(last_vis[t0 : t0 + tpt]) + 1, min(starts[t0 : t0 + tpt])])
            slot_rows.append(slots)
        nb = bucket.token_ids.device.type == "cuda"
        bucket.token_ids.copy_(torch.tensor(token_ids, dtype=torch.int64), non_blocking=nb)
        bucket.positions.copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=nb)
        bucket.write.copy_(torch.tensor(write, dtype=torch.int64), non_blocking=nb)
        meta.req.copy_(torch.tensor(req, dtype=torch.int64), non_blocking=nb)
        meta.tiles.copy_(torch.tensor(tiles, dtype=torch.int64), non_blocking=nb)
        meta.bits.copy_(torch.tensor(bits, dtype=torch.int64).view(-1), non_blocking=nb)  # (B N W,)
        if meta.lows is not None:
            meta.lows.copy_(torch.tensor(lows, dtype=torch.int64), non_blocking=nb)
        for b, slots in enumerate(slot_rows):
            start = b * self.max_context
            meta.slots[start : start + len(slots)].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=nb)

    def _window_starts(self, work) -> list[int]:
        """Each new token's first key under the sliding window (0s when none hides keys)."""
        if self.window is None or max(work.positions) < self.window:
            return [0] * len(work.token_ids)
        return window_starts(work.parents, len(work.token_ids), work.seq.num_committed, work.positions, self.window)

    def run(self, works) -> list[torch.Tensor]:
        shape = self.bucket_shape(works)
        if shape is None:
            self.num_fallbacks += 1
            return self._eager_run(works)
        bucket = self._bucket(*shape)
        self._fill(bucket, works)
        if bucket.graph is not None:
            bucket.graph.replay()
            logits = bucket.logits
        else:
            self.backend.set_metadata(bucket.key, bucket.meta, bucket.window_key)
            logits = self.model.forward(bucket.batch_obj, self.runner.kv)
        self.num_replays += 1
        if self.runner.on_forward is not None:  # as `ModelRunner.run` reports it: the real tokens, not padding
            self.runner.on_forward(sum(len(w.token_ids) for w in works))
        out = []
        for b, w in enumerate(works):
            first = b * bucket.tokens
            n = len(w.token_ids)
            num_rows = {"all": n, "last": 1, "none": 0}.get(w.logits, w.logits)  # int: the last n rows
            out.append(logits[first + n - num_rows : first + n].clone())
        return out
