"""RMSNorm as the model families compute it, bit for bit (SpecInfer's exactness promise, arXiv
2305.09781 Section 4.3: verification must see the LLM's own logits).

Llama-style (Llama, Mistral, Qwen, Phi-3): normalise in float32, cast back, then scale by w.
Gemma-style: normalise in float32 and scale by (1 + w) in float32, then cast back; the engine
keeps (1 + w) precomputed in float32 (`offset_weight`), the value transformers computes per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
