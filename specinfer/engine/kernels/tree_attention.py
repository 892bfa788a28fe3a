"""Triton tree attention over the paged KV cache (SpecInfer Section 4.2, tree-based parallel decoding).

SpecInfer verifies a whole token tree in one LLM pass: every tree node attends to the request's
committed prefix plus its own ancestors (and itself), the *topology-aware causal mask*. The
reference path (`DecoderModel.attention`) materialises that mask densely, (n, L) per request, and
runs one SDPA call per request. This module does the same computation in one kernel launch for a
whole batch of requests with different prefix lengths and tree sizes:

* Keys/values are read straight from the paged cache through a per-request slot list (the
  physical slot of every logical key, which is how `ModelRunner` lays a sequence's block table
  out), so requests never need contiguous storage.
* The mask is compact: a request's first C keys (the committed prefix) are visible to all its
  queries, and only the S = L - C scratch keys (the tree) need a mask, stored as one bit per
  (query, scratch key) in int64 words, ceil(S / 64) words per query. A 64-node tree costs 64
  words per request instead of a 64 x L bool matrix.
* Sliding-window layers (Gemma 3's local layers, Mistral, Qwen2/Qwen3, Phi-3) reuse the step's
  metadata: launched with `window`, each query row also skips keys before its own first visible
  one (`lows`, from the runner), and every tile's key loop starts at its rows' earliest such key.
* Metadata (slot lists, bit words, the tile schedule) is built once per forward step by
  `build_metadata` / `metadata_from_seqs` and reused by every layer (`TritonAttention` caches it).
* Online softmax (flash attention) with fp32 accumulation; grouped-query attention packs the G
  query heads that share a KV head into the rows of one tile, so each K/V tile is loaded once
  per G heads; an optional KV split (flash-decoding) gives a long prefix enough parallelism
  when the batch is small, followed by a small combine kernel.

Without CUDA the kernels can run under Triton's interpreter (``TRITON_INTERPRET=1``, set by
`specinfer.engine.kernels.use_interpreter()` before this module is imported): slow, but exact,
so tests on CPU check the same code. The interpreter mishandles bfloat16 arithmetic, so there
the tiles are upcast to fp32 after loading (`UPCAST`); on a GPU bf16/fp16 tiles feed the tensor
cores directly with fp32 accumulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the kernels are optional: the SDPA path needs none of this
    triton = None
    tl = None
    HAS_TRITON = False

WORD_BITS = 64
REQ_FIELDS = 8  # q_start, n, kv_len, prefix_len, slot_off, bits_off, num_words, unused
TILE_FIELDS = 4  # req, tok0, kv_end, kv_start (a sliding window's first key any of the tile's queries sees)


def is_interpreted() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter (tensors on CPU)."""
    if not HAS_TRITON:
        return False
    return type(_tree_attn_kernel).__name__ == "InterpretedFunction"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# Metadata: built once per forward step, shared by all layers
# ---------------------------------------------------------------------------------------------


@dataclass
class TreeRequest:
    """One request's part of a step, in the runner's terms.

    `slots` are the physical cache slots of the request's L keys (committed prefix, then the
    scratch region: tokens written earlier this step, then the n new tokens). `parents` covers
    the whole scratch region, like `Work.parents`: each entry is the parent's scratch index or -1
    for a node hanging directly off the committed prefix.
    """

    q_start: int
    num_committed: int
    parents: list[int]
    slots: torch.Tensor | list[int] | slice
    num_new: int | None = None  # the last `num_new` scratch tokens are the queries; None = all
    window_starts: list[int] | None = None  # per query, the first key a sliding-window layer sees

    @property
    def n(self) -> int:
        return len(self.parents) if self.num_new is None else self.num_new


@dataclass
class TreeAttentionMetadata:
    """Everything the kernel needs about a batch, as device tensors (see module docstring).

    req:   (B, 8) int64 rows: q_start, n, kv_len L, prefix_len C, slot_off, bits_off, num_words W, 0
    tiles: (num_tiles, 4) int64 rows: request, first query token, key-loop end, key-loop start under
           the window (the least of the tile's `lows`)
    slots: (sum L,) int64 physical slot of each key, requests back to back
    bits:  (sum n*W,) int64 ancestor bit words; query r of request b, scratch key s is bit s % 64
           of word bits[bits_off + r * W + s // 64]
    lows:  (T,) int64 per query row, the first key (index into its request's keys) that a
           sliding-window layer lets it see; the kernel applies it when launched with `window`
    """

    req: torch.Tensor
    tiles: torch.Tensor
    slots: torch.Tensor
    bits: torch.Tensor
    num_tokens: int
    group: int
    block_m: int
    tokens_per_tile: int
    num_splits: int = 1
    scratch: dict = field(default_factory=dict)  # split-KV partial buffers, reused across layers
    lows: torch.Tensor | None = None  # None: no window this step (sliding layers see what full ones do)

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[0]


def choose_block_m(max_new: int, group: int, cap: int = 64) -> int:
    """Packed query rows per tile (tokens x grouped heads): a power of two in [16, max(cap, G)]."""
    want = _next_pow2(max(1, max_new) * group)
    return max(16, _next_pow2(group), min(cap, want))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """(n, S) bool -> (n, ceil(S/64)) int64 words, bit j of word w = mask[:, 64 w + j]."""
    n, s = mask.shape
    words = max(1, -(-s // WORD_BITS))
    padded = torch.zeros(n, words * WORD_BITS, dtype=torch.int64, device=mask.device)
    padded[:, :s] = mask.to(torch.int64)
    shifts = torch.arange(WORD_BITS, dtype=torch.int64, device=mask.device)
    # (n, W, 64) << (64,) summed over bits; bit 63 is the sign bit and wraps exactly in two's complement.
    return (padded.view(n, words, WORD_BITS) << shifts).sum(-1)


def _chain_words(num_scratch: int, num_new: int) -> torch.Tensor:
    """(num_new, W) ancestor words of the last `num_new` nodes of a chain: node i sees nodes 0..i."""
    words = max(1, -(-num_scratch // WORD_BITS))
    node = torch.arange(num_scratch - num_new, num_scratch, dtype=torch.int64).unsqueeze(1)  # (n, 1)
    count = (node + 1 - WORD_BITS * torch.arange(words, dtype=torch.int64)).clamp(0, WORD_BITS)  # (n, W) bits set
    ones = torch.ones_like(count)
    return torch.where(count >= WORD_BITS, -ones, (ones << count.clamp(max=WORD_BITS - 1)) - 1)


def _is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def _ancestor_words(parents: list[int], num_new: int) -> tuple[list[list[int]], list[int], int]:
    """Bit words of the last `num_new` scratch nodes' ancestor-or-self sets, and their last visible index."""
    num_scratch = len(parents)
    words = max(1, -(-num_scratch // WORD_BITS))
    sets: list[int] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"parents must be topologically ordered: node {i} has parent {p}")
        sets.append((sets[p] if p >= 0 else 0) | (1 << i))
    rows = []
    for i in range(num_scratch - num_new, num_scratch):
        a = sets[i]
        row = []
        for w in range(words):
            u = (a >> (w * WORD_BITS)) & ((1 << WORD_BITS) - 1)
            row.append(u - (1 << WORD_BITS) if u >= 1 << (WORD_BITS - 1) else u)  # to signed int64
        rows.append(row)
    return rows, list(range(num_scratch - num_new, num_scratch)), words


def _assemble(
    parts: list[dict], num_tokens: int, group: int, device, block_m: int | None, num_splits: int
) -> TreeAttentionMetadata:
    """parts: per request q_start, n, L, C, slots (device tensor), bits ((n, W) tensor or None),
    last_vis (per query row, the last key it may see; None = the last key), starts (per query
    row, the first key a sliding window lets it see; None = none hidden)."""
    max_new = max((p["n"] for p in parts), default=1)
    block_m = block_m or choose_block_m(max_new, group)
    if block_m < group or block_m & (block_m - 1):
        raise ValueError(f"block_m {block_m} must be a power of two >= the query group size {group}")
    tokens_per_tile = block_m // group
    req_rows: list[int] = []
    tile_rows: list[int] = []
    slot_parts: list[torch.Tensor] = []
    bit_parts: list[torch.Tensor] = []
    slot_off = bits_off = 0
    lows = [0] * num_tokens if any(p.get("starts") for p in parts) else None
    for b, p in enumerate(parts):
        n, kv_len, prefix = p["n"], p["L"], p["C"]
        bits = p["bits"]
        words = 0 if bits is None else bits.shape[1]
        req_rows += [p["q_start"], n, kv_len, prefix, slot_off, bits_off, words, 0]
        last_vis, starts = p["last_vis"], p.get("starts")
        if starts:
            lows[p["q_start"] : p["q_start"] + n] = starts
        for tok0 in range(0, n, tokens_per_tile):
            if last_vis is None:
                kv_end = kv_len
            else:
                kv_end = min(kv_len, max(last_vis[tok0 : tok0 + tokens_per_tile]) + 1)
            tile_rows += [b, tok0, kv_end, min(starts[tok0 : tok0 + tokens_per_tile]) if starts else 0]
        slot_parts.append(p["slots"])
        slot_off += kv_len
        if bits is not None:
            bit_parts.append(bits.reshape(-1))  # (n * W,)
            bits_off += bits.numel()
    req = torch.tensor(req_rows, dtype=torch.int64).view(-1, REQ_FIELDS)  # (B, 8)
    tiles = torch.tensor(tile_rows, dtype=torch.int64).view(-1, TILE_FIELDS)  # (num_tiles, 4)
    slots = torch.cat(slot_parts) if slot_parts else torch.zeros(1, dtype=torch.int64)
    bits = torch.cat([t.to(device) for t in bit_parts]) if bit_parts else torch.zeros(1, dtype=torch.int64)
    non_blocking = torch.device(device).type == "cuda"
    return TreeAttentionMetadata(
        req=req.to(device, non_blocking=non_blocking),
        tiles=tiles.to(device, non_blocking=non_blocking),
        slots=slots.to(device=device, dtype=torch.int64),
        bits=bits.to(device=device, dtype=torch.int64),
        num_tokens=num_tokens,
        group=group,
        block_m=block_m,
        tokens_per_tile=tokens_per_tile,
        num_splits=max(1, int(num_splits)),
        lows=None if lows is None else torch.tensor(lows, dtype=torch.int64).to(device, non_blocking=non_blocking),
    )


def _slots_tensor(slots, device) -> torch.Tensor:
    if isinstance(slots, slice):
        return torch.arange(slots.start, slots.stop, dtype=torch.int64, device=device)
    if isinstance(slots, torch.Tensor):
        return slots.to(device=device, dtype=torch.int64)
    return torch.tensor(slots, dtype=torch.int64, device=device)


def build_metadata(
    requests: list[TreeRequest], group: int, device, block_m: int | None = None, num_splits: int = 1
) -> TreeAttentionMetadata:
    """Compact metadata from the runner's own bookkeeping (committed lengths, parents, slots).

    No dense mask is ever built: ancestor sets are Python ints, packed into int64 words.
    """
    parts = []
    q_next = 0
    for r in requests:
        n = r.n
        slots = _slots_tensor(r.slots, device)
        kv_len = r.num_committed + len(r.parents)
        if slots.shape[0] != kv_len:
            raise ValueError(f"request has {slots.shape[0]} slots for {kv_len} keys")
        if _is_chain(r.parents):  # prefill chunks and decode: vectorised, no per-node Python ints
            bits, scratch_idx = _chain_words(len(r.parents), n), range(len(r.parents) - n, len(r.parents))
        else:
            rows, scratch_idx, _ = _ancestor_words(r.parents, n)
            bits = torch.tensor(rows, dtype=torch.int64).view(n, -1)  # (n, W)
        last_vis = [r.num_committed + i for i in scratch_idx]  # topological order: self is the last ancestor
        parts.append(dict(q_start=r.q_start, n=n, L=kv_len, C=r.num_committed, slots=slots, bits=bits,
                          last_vis=last_vis, starts=r.window_starts))
        q_next = max(q_next, r.q_start + n)
    return _assemble(parts, q_next, group, device, block_m, num_splits)


def metadata_from_seqs(
    seqs, group: int, device, block_m: int | None = None, num_splits: int = 1
) -> TreeAttentionMetadata:
    """Compact metadata from the `SeqAttention` list the model's forward gets (dense masks).

    The committed prefix is recovered as the leading run of columns every query may see; the
    remaining columns are packed into bit words. Device work is batched so that a GPU step
    synchronises once, not once per request.
    """
    probes = []  # per dense mask: (prefix length, per-row last visible column), reduced on device
    for s in seqs:
        if s.mask is not None:
            m = s.mask.to(torch.bool)
            num_rows, kv_len = m.shape
            cols = torch.arange(kv_len, device=m.device)
            prefix = m.all(0).to(torch.int64).cumprod(0).sum().view(1)  # (1,) leading all-visible columns
            last = torch.where(m, cols, -1).amax(1)  # (n,)
            probes.append(torch.cat([prefix.to(device), last.to(device)]))
    probed = iter(torch.cat(probes).tolist() if probes else [])  # the one host sync
    parts = []
    num_tokens = 0
    for s in seqs:
        n = s.q_end - s.q_start
        slots = _slots_tensor(s.context, device)
        kv_len = slots.shape[0]
        if s.mask is not None:
            prefix = next(probed)
            last_vis = [next(probed) for _ in range(n)]
            bits = pack_bits(s.mask[:, prefix:].to(torch.bool)) if prefix < kv_len else None
        elif s.is_causal:
            if kv_len != n:
                raise ValueError("is_causal needs as many keys as queries")
            prefix = 0
            bits = pack_bits(torch.ones(n, n, dtype=torch.bool, device=device).tril())
            last_vis = list(range(n))
        else:
            prefix, bits, last_vis = kv_len, None, None
        parts.append(dict(q_start=s.q_start, n=n, L=kv_len, C=prefix, slots=slots, bits=bits, last_vis=last_vis))
        num_tokens = max(num_tokens, s.q_end)
    return _assemble(parts, num_tokens, group, device, block_m, num_splits)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    # Only Triton builtins and this module's own @jit functions are called below, none of
    # triton.language's @jit library functions (tl.max, tl.sum, tl.cdiv, tl.zeros): those are
    # decorated when triton is first imported, and if that happened before TRITON_INTERPRET was
    # set (torch imports triton when it is installed), they cannot run inside interpreted kernels.
    # Reductions go through the builtin tl.reduce with the library's own combine functions, which
    # the interpreter recognises by identity and runs as one numpy reduction (any other combine
    # function is applied element by element there, ~5x slower overall).

    @triton.jit
    def _own_max(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _own_add(a, b):
        return a + b

    _max_fn = getattr(tl.standard, "_elementwise_max", _own_max)
    _add_fn = getattr(tl.standard, "_sum_combine", _own_add)

    @triton.jit
    def _attend_block(
        q, m_i, l_i, acc, start, end,
        K, V, Slots, slot_off, Bits, bits_off, num_words, prefix_len,
        tok, row_ok, low, kvh, offs_d, d_ok,
        stride_ks, stride_kh, stride_vs, stride_vh, qk_scale,
        BLOCK_N: tl.constexpr, IS_TREE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
        WINDOW: tl.constexpr,
    ):
        """One (BLOCK_M, BLOCK_N) step of the online softmax over keys [start, min(start+BLOCK_N, end))."""
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        slot = tl.load(Slots + slot_off + offs_n, mask=n_ok, other=0)  # (BLOCK_N,) physical slots
        k = tl.load(  # (BLOCK_D, BLOCK_N): loaded transposed for q @ k
            K + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None], other=0.0,
        )
        v = tl.load(  # (BLOCK_N, BLOCK_D)
            V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :], other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:  # fp32 inputs: exact products, not tf32
            s = tl.dot(q, k, input_precision="ieee") * qk_scale  # (BLOCK_M, BLOCK_N), log2 domain
        else:
            s = tl.dot(q, k) * qk_scale
        vis = row_ok[:, None] & n_ok[None, :]
        if WINDOW:  # a sliding-window layer: each query row sees keys from its own `low` on
            vis = vis & (offs_n[None, :] >= low[:, None])
        if IS_TREE:
            rel = offs_n - prefix_len  # scratch index of each key
            word = tl.load(
                Bits + bits_off + tok[:, None] * num_words + (rel // 64)[None, :], mask=vis, other=0
            )  # (BLOCK_M, BLOCK_N) int64
            vis = vis & (((word >> (rel % 64).to(tl.int64)[None, :]) & 1) != 0)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_fn))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _add_fn)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _tree_attn_kernel(
        Q, K, V, Out, PartO, PartML,
        Req, Tiles, Slots, Bits, Lows,
        qk_scale,
        stride_qt, stride_qh,
        stride_ks, stride_kh, stride_vs, stride_vh,
        stride_ot, stride_oh,
        stride_ps, stride_pt, stride_ph,
        stride_ms, stride_mt, stride_mh,
        GROUP: tl.constexpr, TOK_PER_TILE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        req = tl.load(Tiles + tile * 4)
        tok0 = tl.load(Tiles + tile * 4 + 1)
        kv_end = tl.load(Tiles + tile * 4 + 2)
        rb = Req + req * 8
        q_start = tl.load(rb)
        n = tl.load(rb + 1)
        prefix_len = tl.load(rb + 3)
        slot_off = tl.load(rb + 4)
        bits_off = tl.load(rb + 5)
        num_words = tl.load(rb + 6)

        # Packed rows: row m is query token tok0 + m // GROUP under query head kvh * GROUP + m % GROUP.
        offs_m = tl.arange(0, BLOCK_M)
        tok = tok0 + offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < TOK_PER_TILE * GROUP) & (tok < n)
        row = q_start + tok
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(
            Q + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )  # (BLOCK_M, BLOCK_D)
        if UPCAST:
            q = q.to(tl.float32)
        if WINDOW:  # keys before the tile's first visible one are skipped, not just masked
            kv_start = tl.load(Tiles + tile * 4 + 3)
            low = tl.load(Lows + row, mask=row_ok, other=0)
        else:
            kv_start = 0
            low = row  # unused

        # This program's share of the keys (flash-decoding split), BLOCK_N aligned.
        per_split = (kv_end - kv_start + NUM_SPLITS - 1) // NUM_SPLITS
        chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = kv_start + split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        # Committed prefix: visible to every query, no mask work.
        prefix_hi = tl.minimum(hi, prefix_len)
        for start in range(lo, prefix_hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q, m_i, l_i, acc, start, prefix_hi, K, V, Slots, slot_off, Bits, bits_off, num_words,
                prefix_len, tok, row_ok, low, kvh, offs_d, d_ok, stride_ks, stride_kh, stride_vs, stride_vh,
                qk_scale, BLOCK_N, False, UPCAST, IEEE, WINDOW,
            )
        # Scratch region (the tree): ancestor bits decide.
        for start in range(tl.maximum(lo, prefix_len), hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q, m_i, l_i, acc, start, hi, K, V, Slots, slot_off, Bits, bits_off, num_words,
                prefix_len, tok, row_ok, low, kvh, offs_d, d_ok, stride_ks, stride_kh, stride_vs, stride_vh,
                qk_scale, BLOCK_N, True, UPCAST, IEEE, WINDOW,
            )
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_mask = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            tl.store(
                Out + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                o.to(Out.dtype.element_ty), mask=out_mask,
            )
        else:
            tl.store(
                PartO + split * stride_ps + row[:, None] * stride_pt + head[:, None] * stride_ph + offs_d[None, :],
                o, mask=out_mask,
            )
            ml = PartML + split * stride_ms + row * stride_mt + head * stride_mh
            tl.store(ml, m_i, mask=row_ok)
            tl.store(ml + 1, l_i, mask=row_ok)

    @triton.jit
    def _combine_kernel(
        Out, PartO, PartML,
        stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh,
        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Merges the per-split partial softmax results of one (token, head)."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < NUM_SPLITS
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        ml = PartML + offs_s * stride_ms + t * stride_mt + h * stride_mh
        m = tl.load(ml, mask=s_ok, other=float("-inf"))
        l = tl.load(ml + 1, mask=s_ok, other=0.0)
        m_max = tl.reduce(m, 0, _max_fn)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.math.exp2(m - m_safe) * l  # (BLOCK_S,)
        denom = tl.reduce(w, 0, _add_fn)
        o = tl.load(
            PartO + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :], other=0.0,
        )  # (BLOCK_S, BLOCK_D)
        out = tl.reduce(o * w[:, None], 0, _add_fn) / tl.where(denom == 0.0, 1.0, denom)
        tl.store(Out + t * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    sm_scale: float | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: bool = False,
) -> torch.Tensor:
    """q: (T, H, D); k_cache/v_cache: (num_slots, Hkv, D) of one layer. Returns (T, H * D) in q's dtype.
    `window`: a sliding-window layer, which sees only keys from each query's `meta.lows` on."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads != num_kv_heads * meta.group:
        raise ValueError(f"{num_heads} query heads, {num_kv_heads} KV heads, metadata built for group {meta.group}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("K/V cache rows must be contiguous in head_dim")
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    block_d = max(16, _next_pow2(head_dim))
    interpret = is_interpreted()
    if block_n is None:
        block_n = 64
    if num_warps is None:
        num_warps = 4 if meta.block_m * block_d <= 64 * 64 else 8
    launch = {} if interpret else {"num_warps": num_warps, "num_stages": num_stages or 2}
    if out is None:
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    out3 = out.view(num_tokens, num_heads, head_dim)  # (T, H, D) view of (T, H * D)
    splits = meta.num_splits
    if splits > 1:
        key = (num_tokens, num_heads, head_dim, splits)
        part = meta.scratch.get(key)
        if part is None:
            part = (
                torch.empty(splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device),
                torch.empty(splits, num_tokens, num_heads, 2, dtype=torch.float32, device=q.device),
            )
            meta.scratch[key] = part
        part_o, part_ml = part
    else:
        part_o = part_ml = out3  # unused
    if window and meta.lows is None:
        raise ValueError("a windowed launch needs metadata with per-query window starts (lows)")
    grid = (meta.num_tiles, num_kv_heads, splits)
    _tree_attn_kernel[grid](
        q, k_cache, v_cache, out3, part_o, part_ml,
        meta.req, meta.tiles, meta.slots, meta.bits, meta.lows if window else meta.tiles,
        sm_scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out3.stride(0), out3.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
        GROUP=meta.group, TOK_PER_TILE=meta.tokens_per_tile,
        BLOCK_M=meta.block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d,
        NUM_SPLITS=splits, UPCAST=interpret, IEEE=interpret or q.dtype == torch.float32, WINDOW=window, **launch,
    )
    if splits > 1:
        _combine_kernel[(num_tokens, num_heads)](
            out3, part_o, part_ml,
            out3.stride(0), out3.stride(1),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
            NUM_SPLITS=splits, BLOCK_S=_next_pow2(splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
        )
    return out


def auto_num_splits(num_tiles: int, num_kv_heads: int, max_kv_len: int, device, min_keys_per_split: int = 256) -> int:
    """Enough KV splits to fill the GPU about twice when the batch alone cannot (flash-decoding)."""
    if torch.device(device).type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, num_tiles * num_kv_heads)
    want = max(1, min(-(-2 * sms // programs), max_kv_len // min_keys_per_split, 32))
    return 1 << (want.bit_length() - 1)  # a power of two: NUM_SPLITS is a compile-time constant


class TritonAttention:
    """Drop-in attention backend: `backend(q, k_cache, v_cache, seqs)` like `DecoderModel.attention`.

    Metadata is built on the first layer of a forward pass and reused by the others: the model
    passes the same `seqs` list object to every layer, which is the cache key. A model with
    sliding-window layers passes those layers the step's `window_seqs` list: registered by
    `prepare` (or `set_metadata`) as the windowed view of the same metadata, it launches the
    kernel with the per-query window starts; any other list gets metadata from its own dense
    masks. `set_metadata` lets a caller (e.g. the CUDA-graph runner) install prebuilt metadata
    for a given key.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, block_m: int | None = None, block_n: int | None = None,
        num_splits: int | None = None, num_warps: int | None = None, sm_scale: float | None = None,
    ):
        if not HAS_TRITON:
            raise RuntimeError("TritonAttention needs triton (pip install triton)")
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.block_m = block_m
        self.block_n = block_n
        self.num_warps = num_warps
        self.num_splits = num_splits  # None = auto (1 on CPU)
        self.sm_scale = sm_scale  # None: head_dim ** -0.5
        self._entries: list[tuple[object, TreeAttentionMetadata, bool]] = []  # (key, meta, is_window), newest last
        self.num_builds = 0  # metadata builds, for tests: one per forward step

    @classmethod
    def for_config(cls, cfg, **kwargs) -> "TritonAttention":
        return cls(cfg.num_heads, cfg.num_kv_heads, sm_scale=cfg.attention_scale, **kwargs)

    def set_metadata(self, key, meta: TreeAttentionMetadata, window_key=None) -> None:
        """Installs `meta` for the `key` list, and its windowed view for `window_key` (if given)."""
        self._entries = [(key, meta, False)] + ([(window_key, meta, True)] if window_key is not None else [])

    def _lookup(self, seqs) -> tuple[TreeAttentionMetadata, bool] | None:
        for key, meta, is_window in self._entries:
            if key is seqs:
                return meta, is_window
        return None

    def metadata(self, seqs, device) -> tuple[TreeAttentionMetadata, bool]:
        """(metadata, whether to apply its window starts) for a layer's `seqs` list."""
        found = self._lookup(seqs)
        if found is not None:
            return found
        meta = self._finish(seqs, metadata_from_seqs(seqs, self.group, device, block_m=self.block_m), device)
        self._entries = self._entries[-1:] + [(seqs, meta, False)]  # a step's full and windowed lists
        return meta, False

    def prepare(self, seqs, requests: list[TreeRequest], device, window_seqs=None) -> TreeAttentionMetadata:
        """Builds a step's metadata from the runner's bookkeeping (committed lengths, parents,
        slots: no dense mask) and installs it for the step's `seqs` list, and for its
        `window_seqs` list (when the window hides keys this step) as the windowed view."""
        meta = self._finish(seqs, build_metadata(requests, self.group, device, block_m=self.block_m), device)
        self.set_metadata(seqs, meta, window_seqs if window_seqs is not None and window_seqs is not seqs else None)
        return meta

    def _finish(self, seqs, meta: TreeAttentionMetadata, device) -> TreeAttentionMetadata:
        if self.num_splits is not None:
            meta.num_splits = self.num_splits
        else:  # key counts are known on the host: no device sync
            max_kv = max(
                (s.context.stop - s.context.start if isinstance(s.context, slice) else s.context.shape[0]) for s in seqs
            )
            meta.num_splits = auto_num_splits(meta.num_tiles, self.num_kv_heads, max_kv, device)
        self.num_builds += 1
        return meta

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs) -> torch.Tensor:
        meta, is_window = self.metadata(seqs, q.device)
        return tree_attention(q, k_cache, v_cache, meta, sm_scale=self.sm_scale, block_n=self.block_n,
                              num_warps=self.num_warps, window=is_window)
