"""Rotary position embeddings with the `rope_scaling` variants of the supported families.

Positions are passed in explicitly: a token-tree node sits at (prefix length + depth), which is
how SpecInfer's tree-based parallel decoding (Section 4.2) gives every path the positions it
would have had in plain decoding. A model may rotate only the leading `rotary_dim` dimensions
of each head (Phi-3's partial rotary), and its layers may use different RoPEs (Gemma 3's local
and global layers): `rope_tables` is per RoPE config, `apply_rope` rotates what its table covers.
A float32 model on a CPU rotates whole heads in one call of the CPU kernel (`cpu_gemm.rope`), the
same arithmetic bit for bit (`rope_for`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from specinfer.engine.layers import cpu_gemm
from specinfer.engine.models.hf import RopeConfig, longrope_attention_factor, yarn_attention_factor


def inverse_frequencies(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq of shape (dim/2,), attention scaling applied to cos/sin)."""
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "dynamic":
        # NTK-aware scaling only changes once the sequence exceeds max_position_embeddings,
        # which the engine never allows; within the context it is the default RoPE.
        return inv_freq, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope, max_position_embeddings), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    if rope.rope_type == "longrope":
        # Within the original context (the engine's limit for it, ModelConfig.max_context) the
        # short factors apply.
        short = torch.tensor(rope.short_factor, dtype=torch.float32)
        return 1.0 / (short * base**exponents), longrope_attention_factor(rope, max_position_embeddings)
    raise AssertionError(rope.rope_type)  # the family's config parser validated the type


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, max_position_embeddings: int) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, yarn_attention_factor(rope)


def rope_tables(rope: RopeConfig, dim: int, max_position_embeddings: int, num_positions: int, dtype: torch.dtype,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos table and the signed sin table, each of shape (num_positions, dim), computed in fp32
    then cast. The signed table is sin with its first half negated: (-sin1, sin2)."""
    inv_freq, scale = inverse_frequencies(rope, dim, max_position_embeddings)
    pos = torch.arange(num_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # (P, dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, dim)
    cos = (emb.cos() * scale).to(dtype=dtype, device=device)
    sin = (emb.sin() * scale).to(dtype=dtype, device=device)
    half = dim // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos and signed_sin: (T, 1, R), R <= D, rows of `rope_tables`. Rotates the two
    halves of the leading R dimensions; the rest pass through (partial rotary).

    The rotation is the families' x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1),
    bit for bit: (-x2) * sin1 is x2 * (-sin1) exactly, so (x2, x1) * signed_sin gives the same
    products, in fewer operators (a step runs this in every layer)."""
    rotary = cos.shape[-1]
    if rotary != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, signed_sin), x[..., rotary:]), dim=-1)
    half = rotary // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(signed_sin).add_(x * cos)


def rope_for(is_cpu_float32: bool, is_partial: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The rotation a model runs: for a float32 model that stays on the CPU (`is_cpu_float32`) and
    rotates whole heads, the CPU kernel's where it is built; else `apply_rope`."""
    if is_cpu_float32 and not is_partial and cpu_gemm.has_layer_ops():
        return _kernel_rope
    return apply_rope


def _kernel_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and cos.is_contiguous() and signed_sin.is_contiguous():
        return cpu_gemm.rope(x, cos, signed_sin)
    return apply_rope(x, cos, signed_sin)
