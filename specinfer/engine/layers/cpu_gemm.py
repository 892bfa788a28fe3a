"""The small-batch float32 products of `cpu_gemm.c`, loaded through ctypes.

A float32 weight whose elements are all exactly bfloat16 (or float16) values, as a checkpoint
stored in that type gives, is packed in it: the kernel widens each element back to the same
float32 in registers, so the products are bitwise the float32 panels' from half the memory.

The library is built with the package (setup.py) where a C compiler is found; without it, or on
a CPU with neither AVX-512 nor AVX2 and FMA, `available()` is False and the decoder keeps torch's
kernels (`layers/linear.py`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

PANEL = 16  # output features a panel holds
REVISION = 4  # of cpu_gemm.c: 2 asks the memory for the weights ahead, 3 shares panels evenly between threads,
# 4 keeps exactly-16-bit weights in 16 bits
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
    return lib, isa


@functools.cache
def _library() -> tuple[ctypes.CDLL, int] | None:
    candidates = sorted(Path(__file__).parent.glob("_cpu_gemm*.so"))
    return load(candidates[0]) if candidates else None


def available() -> bool:
    """Whether the kernel is built and this CPU runs it."""
    return _library() is not None


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


def pack(weight: torch.Tensor, storage: torch.dtype = torch.float32) -> torch.Tensor:
    """weight (n, k), float32 on the CPU, as the kernel's panels: (ceil(n / 16), k, 16), zero past n,
    stored as `storage` (which must hold every element exactly: `exact_storage`)."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % PANEL))  # (16 * num_panels, k)
    return padded.view(-1, PANEL, k).transpose(1, 2).to(storage).contiguous()


def gemm(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """x (..., k) @ W.T for W (n, k) laid out by `pack`; x float32 on the CPU."""
    lib, isa = _library()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    lib.specinfer_gemm(panels.data_ptr(), _FORMATS[panels.dtype], rows.data_ptr(), out.data_ptr(), rows.shape[0],
                       n, rows.shape[1], isa, torch.get_num_threads())
    return out.view(*x.shape[:-1], n)
