"""Fused commit of the accepted path's keys and values (SpecInfer Section 4.2, tree-based parallel decoding).

After verification only the accepted root-to-leaf path of the token tree stays: its K/V rows,
scattered over the scratch region, move into consecutive slots after the committed prefix.
`KVCache.move` does this with two advanced-indexing copies; `fused_commit` does it in ONE launch
for K and V of all layers. The grid is (layer, K or V, column chunk); each program copies one
column chunk of every moved row of one layer. It loads all source rows, waits at a barrier, then
stores, so overlapping moves (a destination that is also another move's source, the usual case
when the accepted path is compacted in place) behave exactly like `KVCache.move`'s
gather-then-scatter.

Rows are copied as raw bits (the cache is viewed as an integer type of the same width), so the
result is bit-identical for any dtype, and it also runs in Triton's CPU interpreter.
"""

from __future__ import annotations

import torch

from specinfer.engine.kernels.tree_attention import HAS_TRITON, _next_pow2
from specinfer.engine.models.transformer import KVCache

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_rows(Base, src, dst, mv_ok, cols, c_ok, stride_s):
        m = mv_ok[:, None] & c_ok[None, :]
        rows = tl.load(Base + src[:, None] * stride_s + cols[None, :], mask=m)  # (MOVES, BLOCK_C): all reads first
        # Another thread of this program may store to a row this one still has to read (a
        # destination that is also a source): wait until every read of the tile is done.
        tl.debug_barrier()
        tl.store(Base + dst[:, None] * stride_s + cols[None, :], rows, mask=m)

    @triton.jit
    def _commit_kernel(
        K, V, Src, Dst, num_moves, row_elems, stride_l, stride_s,
        MOVES: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        layer = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        chunk = tl.program_id(2)
        offs = tl.arange(0, MOVES)
        mv_ok = offs < num_moves
        src = tl.load(Src + offs, mask=mv_ok, other=0)  # (MOVES,) int64 slots
        dst = tl.load(Dst + offs, mask=mv_ok, other=0)
        cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = cols < row_elems
        if which == 0:
            _copy_rows(K + layer * stride_l, src, dst, mv_ok, cols, c_ok, stride_s)
        else:
            _copy_rows(V + layer * stride_l, src, dst, mv_ok, cols, c_ok, stride_s)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fused_commit(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, max_tile: int = 8192) -> None:
    """k, v: (num_layers, num_slots, Hkv, D) caches; copies slots src -> dst in every layer (one launch)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    num_moves = int(src.shape[0])
    if num_moves == 0:
        return
    if dst.shape[0] != num_moves:
        raise ValueError("src and dst must have the same length")
    if k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype:
        raise ValueError("k and v caches must have one shape, layout and dtype")
    num_layers, num_slots = k.shape[:2]
    row_elems = k[0, 0].numel()  # Hkv * D, contiguous per slot
    if k.stride(1) != row_elems or k.stride(-1) != 1 or not k[0, 0].is_contiguous():
        raise ValueError("each cache slot's (Hkv, D) row must be contiguous")
    ik = k.view(_INT_OF_SIZE[k.element_size()])  # raw bits: exact for any dtype
    iv = v.view(_INT_OF_SIZE[v.element_size()])
    src = src.to(device=k.device, dtype=torch.int64).contiguous()
    dst = dst.to(device=k.device, dtype=torch.int64).contiguous()
    moves = max(2, _next_pow2(num_moves))
    block_c = max(16, min(_next_pow2(row_elems), max_tile // moves))
    grid = (num_layers, 2, triton.cdiv(row_elems, block_c))
    _commit_kernel[grid](ik, iv, src, dst, num_moves, row_elems, k.stride(0), k.stride(1), MOVES=moves, BLOCK_C=block_c)


class FusedCommitKVCache(KVCache):
    """A `KVCache` whose `move` (the runner's commit) is the fused one-launch kernel."""

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        fused_commit(self.k, self.v, src, dst)
