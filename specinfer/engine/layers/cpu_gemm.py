"""The small-batch float32 products of `cpu_gemm.c`, and the RMSNorm, RoPE and attention of
`cpu_norm.c`, `cpu_rope.c` and `cpu_attention.c`, loaded through ctypes.

A float32 weight whose elements are all exactly bfloat16 (or float16) values, as a checkpoint
stored in that type gives, is packed in it: the kernel widens each element back to the same
float32 in registers, so the products are bitwise the float32 panels' from half the memory.
A weight dequantized from integer block codes (`BlockCodes`: a GGUF's quantized tensors) is packed
as its codes, one byte an element (four bits where they span 16 values, as 4-bit formats' do),
with its scales and offsets; the kernel rebuilds every element with the fused multiply-add that
defines it, so again the products are the float32 panels'.

The library is built with the package (setup.py) where a C compiler is found; without it, or on
a CPU with neither AVX-512 nor AVX2 and FMA, `available()` is False and the decoder keeps torch's
kernels (`layers/linear.py`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

PANEL = 16  # output features a panel holds
REVISION = 7  # of the kernels: 2 asks the memory for the weights ahead, 3 shares panels evenly between threads,
# 4 keeps exactly-16-bit weights in 16 bits and block codes as codes, 5 keeps 4-bit codes in 4 bits and
# float16 scales in float16, 6 adds the RMSNorm, RoPE and attention (cpu_norm.c, cpu_rope.c, cpu_attention.c),
# 7 reads a key-value head's cache once for its query heads together, spreads them over the threads,
# scores eight keys at a time and takes two heads at once on AVX-512
# Work over block codes goes through this many elements (whole rows) at a time: a GGUF tensor's
# dequantization (`models/gguf.py`), `BlockCodes.values` and `.q8_0`, and the check that codes give
# a weight (`linear.pack`). A few MB of temporaries, whatever the tensor's size.
CHUNK_ELEMENTS = 1 << 22
_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # a panel's dtype -> cpu_gemm.c's FMT_*


def load(path: str | Path) -> tuple[ctypes.CDLL, int] | None:
    """The kernel library at `path` and the path it runs on this CPU (`specinfer_gemm_isa`: 2
    AVX-512, 1 AVX2), or None where it cannot load or this CPU runs neither."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    lib.specinfer_gemm_isa.restype = ctypes.c_int
    isa = lib.specinfer_gemm_isa()
    if isa <= 0:
        return None
    lib.specinfer_gemm.restype = None
    lib.specinfer_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.specinfer_gemm_codes.restype = None
    lib.specinfer_gemm_codes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.specinfer_gemm_nibbles.restype = None
    lib.specinfer_gemm_nibbles.argtypes = lib.specinfer_gemm_codes.argtypes
    if hasattr(lib, "specinfer_rms_norm"):  # a library built from cpu_gemm.c alone multiplies, no more
        lib.specinfer_rms_norm.restype = None
        lib.specinfer_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_int64, ctypes.c_float, ctypes.c_int]
        lib.specinfer_rope.restype = None
        lib.specinfer_rope.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        lib.specinfer_attention.restype = ctypes.c_int
        lib.specinfer_attention.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                            ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
    if hasattr(lib, "specinfer_attention_isa"):  # 1 holds attention to AVX2 where AVX-512 is found; -1 reads it
        lib.specinfer_attention_isa.restype = ctypes.c_int
        lib.specinfer_attention_isa.argtypes = [ctypes.c_int]
    return lib, isa


def _significant_bits(x: torch.Tensor) -> torch.Tensor:
    """For each float32 element, how many significant bits its value needs (0 for zero)."""
    mantissa, _ = torch.frexp(x.float())
    whole = (mantissa.abs().double() * 2.0 ** 24).long()  # the 24-bit significand, an integer
    lowest = whole & -whole  # its lowest set bit
    bits = 24 - torch.log2(lowest.clamp(min=1).double()).round().long()
    return torch.where(whole == 0, torch.zeros_like(bits), bits)


@dataclass(frozen=True)
class BlockCodes:
    """A weight (n, k) given by integer codes: element [i, j] is the float32 fused multiply-add
    fma(scales[i, j // block], codes[i, j], offsets[i, j // block]), rounded once; codes int8,
    scales and offsets float32 of shape (n, k // block)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    block: int

    def values(self) -> torch.Tensor | None:
        """The float32 weight the codes define, or None where float32 arithmetic cannot compute it
        with one rounding; then nothing may rely on the codes. Where every product scale * code
        holds in float32's 24 significant bits (a float16 scale times a 4-8-bit code does; a
        K-quant's scale, a float16 times 6 bits, times 4-6 bits too), the product is exact and
        adding the offset rounds once: the fma's result. Where a block has no offset, the
        product's own rounding is the only one, as in the fma."""
        n, k = self.codes.shape
        if k % self.block:
            return None
        out = torch.empty(n, k, dtype=torch.float32)
        step = max(1, CHUNK_ELEMENTS // max(1, k))  # a few MB of temporaries at a time, whatever the size
        for start in range(0, n, step):
            rows = slice(start, start + step)
            codes = self.codes[rows].view(-1, k // self.block, self.block)
            scales, offsets = self.scales[rows], self.offsets[rows]
            largest = codes.to(torch.int16).abs().amax(dim=-1).float()  # no code of a block is longer in bits
            code_bits = torch.frexp(largest)[1]  # its bit length (0 for 0)
            is_inexact = code_bits + _significant_bits(scales) > 24
            if bool((is_inexact & (offsets != 0)).any()):  # with no offset, the product's rounding is the fma's
                return None
            products = codes.float() * scales.float().unsqueeze(-1)  # exact
            out[rows] = (products + offsets.float().unsqueeze(-1)).view(-1, k)  # one rounding
        return out

    @classmethod
    def q8_0(cls, weight: torch.Tensor, block: int = 32) -> "BlockCodes | None":
        """`weight` (n, k) rounded to 8-bit codes with one float32 scale a row and block of `block`
        inputs (the largest magnitude over 127) and no offset: what an SSM keeps where it computes
        over codes (limits.Q8_DTYPE). None where k is not a multiple of `block`."""
        n, k = weight.shape
        if k % block:
            return None
        codes, scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // block, dtype=torch.float32)
        step = max(1, CHUNK_ELEMENTS // k)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            blocks = weight[rows].float().reshape(-1, k // block, block)
            part = blocks.abs().amax(dim=-1) / 127.0
            safe = torch.where(part > 0, part, torch.ones_like(part))
            codes[rows] = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).view(-1, k)
            scales[rows] = part
        return cls(codes, scales, torch.zeros_like(scales), block)

    def rows(self, index) -> "BlockCodes":
        """The codes of rows `index` (a permutation or selection of rows)."""
        return BlockCodes(self.codes[index], self.scales[index], self.offsets[index], self.block)

    def reblocked(self, block: int) -> "BlockCodes":
        """The same codes with a scale and an offset every `block` inputs (`block` divides this one's)."""
        repeat = self.block // block
        return BlockCodes(self.codes, self.scales.repeat_interleave(repeat, dim=1),
                          self.offsets.repeat_interleave(repeat, dim=1), block)

    @staticmethod
    def cat(parts: list["BlockCodes | None"]) -> "BlockCodes | None":
        """Codes stacked by rows (as q, k and v fuse), in the smallest of their blocks where it
        divides the others (Q4_K's 32 and Q6_K's 16); None where a part has none."""
        if not parts or any(p is None for p in parts):
            return None
        block = min(p.block for p in parts)
        if any(p.block % block for p in parts):
            return None
        parts = [p.reblocked(block) for p in parts]
        return BlockCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.offsets for p in parts]), block)


@dataclass(frozen=True)
class CodePanels:
    """`BlockCodes` laid out for `gemm_codes`: codes (ceil(n / 16), k, 16) int8, scales and offsets
    (ceil(n / 16), k // block, 16), zero past n: float16 where every one is a float16 value (a
    GGUF's Q4_0, Q4_1 and Q8_0 store them so), else float32; no offsets (None) where all are +0.
    With `is_nibbles`, 4-bit codes eight to a 32-bit lane: codes (ceil(n / 16), k // 8, 16) int32,
    lane i of line l holding the codes of output feature i at inputs 8l .. 8l + 7 less their
    lowest, input 8l + t in bits 4t .. 4t + 3; the offsets then hold scale * lowest + offset (which
    `pack_codes` makes sure is exact)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    block: int
    is_nibbles: bool = False

    def _parts(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.offsets) if t is not None]

    def numel(self) -> int:
        return sum(t.numel() for t in self._parts())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._parts())


def _scale_panels(scales: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales and offsets (float32) as `CodePanels` keeps them: in float16 where both hold only
    float16 values (widened back exactly in registers), and the offsets left out where all are +0
    (the kernel adds +0 in their place, the same fma)."""
    kept = None if bool((offsets == 0).all()) and not bool(torch.signbit(offsets).any()) else offsets
    is_half = all(torch.equal(t.half().float(), t) for t in (scales, kept) if t is not None)
    dtype = torch.float16 if is_half else torch.float32
    return _panels(scales).to(dtype).contiguous(), None if kept is None else _panels(kept).to(dtype).contiguous()


def _exact_fold(scales: torch.Tensor, offsets: torch.Tensor, low: int) -> torch.Tensor | None:
    """scales * low + offsets in float32 where every sum is exact (then fma(s, c - low, that) rounds
    the very value fma(s, c, o) does), else None. The product is exact in float64 (24 + 8 bits);
    the sum's float64 rounding error, found by the classic two-sum, must be zero, and the sum a
    float32 value."""
    a, b = scales.double() * low, offsets.double()
    total = a + b
    b_part = total - a
    error = (a - (total - b_part)) + (b - b_part)
    folded = total.float()
    return folded if bool((error == 0).all()) and torch.equal(folded.double(), total) else None


def pack_codes(codes: BlockCodes, is_nibbles: bool = True) -> CodePanels:
    """`codes` laid out in panels of 16 output features, as `pack` lays out a float32 weight; as
    4-bit codes where they span 16 values at most (`is_nibbles`; a 4-bit format's always do), the
    inputs and blocks come in eights and the lowest code folds exactly into the offsets."""
    scales, offsets, values = codes.scales.float(), codes.offsets.float(), codes.codes.to(torch.int8)
    low, high = (int(v) for v in values.aminmax()) if values.numel() else (0, 0)
    is_4_bit = is_nibbles and high - low <= 15 and values.shape[1] % 8 == 0 and codes.block % 8 == 0
    folded = _exact_fold(scales, offsets, low) if is_4_bit else None
    if folded is None:
        return CodePanels(_panels(values).contiguous(), *_scale_panels(scales, offsets), codes.block)
    nibbles = _panels((values.to(torch.int16) - low).to(torch.uint8))  # (P, k, 16), each below 16
    num_panels, k = nibbles.shape[:2]
    eights = nibbles.reshape(num_panels, k // 8, 8, PANEL)
    lanes = eights[:, :, 0].to(torch.int64)
    for t in range(1, 8):  # one input at a time: a few copies of the codes at most, whatever the model's size
        lanes |= eights[:, :, t].to(torch.int64) << (4 * t)  # (P, k // 8, 16), below 2 ** 32
    lanes = torch.where(lanes >= 2 ** 31, lanes - 2 ** 32, lanes).to(torch.int32)  # the same 32 bits
    return CodePanels(lanes.contiguous(), *_scale_panels(scales, folded), codes.block, is_nibbles=True)


def gemm_codes(x: torch.Tensor, panels: CodePanels, n: int) -> torch.Tensor:
    """x (..., k) @ W.T for W (n, k) packed by `pack_codes`; x float32 on the CPU."""
    lib, isa = _library()
    rows = _rows(x)
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    gemm_fn = lib.specinfer_gemm_nibbles if panels.is_nibbles else lib.specinfer_gemm_codes
    gemm_fn(panels.codes.data_ptr(), panels.scales.data_ptr(),
            None if panels.offsets is None else panels.offsets.data_ptr(), panels.block,
            int(panels.scales.dtype == torch.float16), rows.data_ptr(), out.data_ptr(), rows.shape[0], n,
            rows.shape[1], isa, torch.get_num_threads())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous rows (n, k): itself where it already is (a pass's activations mostly are)."""
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()


@functools.cache
def _library() -> tuple[ctypes.CDLL, int] | None:
    candidates = sorted(Path(__file__).parent.glob("_cpu_gemm*.so"))
    return load(candidates[0]) if candidates else None


def available() -> bool:
    """Whether the kernel is built and this CPU runs it."""
    return _library() is not None


def has_layer_ops() -> bool:
    """Whether the built library also holds the RMSNorm, RoPE and attention (`rms_norm`, `rope`,
    `attention`)."""
    return available() and hasattr(_library()[0], "specinfer_rms_norm")


def kernel_name() -> str:
    """Which of the kernel's paths this CPU runs, and its revision (for caches of what a pass
    costs: a revision that prices passes differently measures them anew)."""
    return {2: "panels-avx512", 1: "panels-avx2"}[_library()[1]] + f"-r{REVISION}"


def exact_storage(weight: torch.Tensor) -> torch.dtype:
    """The narrowest type that holds every element of the float32 `weight` exactly: bfloat16,
    float16 or float32 itself."""
    for dtype in (torch.bfloat16, torch.float16):
        if torch.equal(weight.to(dtype).float(), weight):
            return dtype
    return torch.float32


def _panels(t: torch.Tensor) -> torch.Tensor:
    """t (n, k) as panels of 16 rows: (ceil(n / 16), k, 16), zero past n (a view; not contiguous)."""
    n, k = t.shape
    return F.pad(t, (0, 0, 0, -n % PANEL)).view(-1, PANEL, k).transpose(1, 2)


def pack(weight: torch.Tensor, storage: torch.dtype = torch.float32) -> torch.Tensor:
    """weight (n, k), float32 on the CPU, as the kernel's panels: (ceil(n / 16), k, 16), zero past n,
    stored as `storage` (which must hold every element exactly: `exact_storage`)."""
    return _panels(weight).to(storage).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's rows (`cpu_norm.c`): contiguous float32 x (..., h) and weight (h,). Bitwise
    F.rms_norm's only where `norms.is_kernel_exact` says so for this h."""
    lib, _ = _library()
    out = torch.empty_like(x)
    h = x.shape[-1]
    lib.specinfer_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h if h else 0, h, eps,
                           torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rope.apply_rope`'s rotation (`cpu_rope.c`), bit for bit: float32 x (T, H, D) whose heads
    and dims are contiguous within a token (a view of a fused qkv row is), cos and signed_sin
    contiguous (T, 1, D). Returns a new contiguous (T, H, D)."""
    lib, _ = _library()
    num_tokens, num_heads, dim = x.shape
    out = torch.empty(num_tokens, num_heads, dim, dtype=torch.float32)
    lib.specinfer_rope(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(), num_tokens,
                       num_heads, dim)
    return out


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: slice | torch.Tensor,
              mask: torch.Tensor | None, is_causal: bool, scale: float) -> torch.Tensor:
    """`cpu_attention.c`: float32 query rows q (n, H, D), each row's heads contiguous, over the keys
    `context` (a slice of cache slots, or int64 slot indices) of the caches (S, Hkv, D), row i
    seeing key j where mask[i, j] (bool (n, L)), else causally where `is_causal`, else all.
    Returns (n, H * D). D a multiple of 8."""
    lib, _ = _library()
    num_rows, num_heads, dim = q.shape
    if isinstance(context, slice):
        slots, first, num_keys = None, context.start, context.stop - context.start
    else:
        slots, first, num_keys = context.to(torch.int64).contiguous(), 0, context.shape[0]
    mask = None if mask is None else mask.contiguous()
    out = torch.empty(num_rows, num_heads * dim, dtype=torch.float32)
    failed = lib.specinfer_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                     None if slots is None else slots.data_ptr(), first, num_keys,
                                     None if mask is None else mask.data_ptr(), int(is_causal), out.data_ptr(),
                                     num_rows, num_heads, k_cache.shape[1], dim, scale, torch.get_num_threads())
    if failed:
        raise MemoryError(f"attention over {num_keys} keys: no memory for its scores")
    return out


def gemm(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """x (..., k) @ W.T for W (n, k) laid out by `pack`; x float32 on the CPU."""
    lib, isa = _library()
    rows = _rows(x)
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    lib.specinfer_gemm(panels.data_ptr(), _FORMATS[panels.dtype], rows.data_ptr(), out.data_ptr(), rows.shape[0],
                       n, rows.shape[1], isa, torch.get_num_threads())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
