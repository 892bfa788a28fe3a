"""RMSNorm as the model families compute it, bit for bit (SpecInfer's exactness promise, arXiv
2305.09781 Section 4.3: verification must see the LLM's own logits).

Llama-style (Llama, Mistral, Qwen, Phi-3): normalise in float32, cast back, then scale by w.
Gemma-style: normalise in float32 and scale by (1 + w) in float32, then cast back; the engine
keeps (1 + w) precomputed in float32 (`offset_weight`), the value transformers computes per call.

A float32 model on a CPU normalises its rows in one call of the CPU kernel (`cpu_gemm.rms_norm`)
instead of torch's ten or so operators, for every row size where the kernel gives torch's very
bits (`is_kernel_exact`, checked once per size and epsilon on this machine); elsewhere, and for
rows that are not contiguous, torch's operators as before (`norm_for`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from specinfer.engine.layers import cpu_gemm

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # F.rms_norm computes x * rsqrt(mean(x^2) + eps) * w, as transformers does
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def offset_rms_norm(x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's norm; `weight_f32` is (offset + w) in float32 (`offset_weight`)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight_f32, eps).to(x.dtype)


def offset_weight(weight: torch.Tensor, offset: float, dtype: torch.dtype) -> torch.Tensor:
    """(offset + w) in float32 from w as the model stores it in `dtype`."""
    return offset + weight.to(dtype).float()


@functools.cache
def is_kernel_exact(size: int, eps: float) -> bool:
    """Whether the CPU kernel's RMSNorm of rows of `size` equals F.rms_norm's bit for bit on this
    machine (its torch, its instruction set): rows of several counts and magnitudes, zeros and
    a lone large element among them."""
    if not cpu_gemm.has_layer_ops() or size <= 0:
        return False
    gen = torch.Generator().manual_seed(size)
    weight = torch.randn(size, generator=gen)
    for num_rows in (1, 3, 8, 37):
        x = torch.randn(num_rows, size, generator=gen) * torch.logspace(-4, 4, num_rows).unsqueeze(1)
        x[0, : size // 2] = 0.0
        x[-1, size // 3] = 1e6
        if not torch.equal(cpu_gemm.rms_norm(x, weight, eps), F.rms_norm(x, (size,), weight, eps)):
            return False
    return True


def norm_for(is_offset: bool, is_cpu_float32: bool, sizes: Iterable[int], eps: float) -> Norm:
    """The norm a model runs: for a float32 model that stays on the CPU (`is_cpu_float32`), the CPU
    kernel's for rows of `sizes` where it is exact; else `rms_norm` (`offset_rms_norm` for
    Gemma-style weights, which in float32 is the same arithmetic)."""
    fallback = offset_rms_norm if is_offset else rms_norm
    exact = frozenset(s for s in sizes if is_cpu_float32 and is_kernel_exact(s, eps))
    if not exact:
        return fallback

    def kernel_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.shape[-1] in exact and x.is_contiguous() and x.dtype == torch.float32:
            return cpu_gemm.rms_norm(x, weight, eps)
        return fallback(x, weight, eps)

    return kernel_norm
