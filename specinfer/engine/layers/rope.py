"""Rotary position embeddings with the Llama-family `rope_scaling` variants.

Positions are passed in explicitly: a token-tree node sits at (prefix length + depth), which is
how SpecInfer's tree-based parallel decoding (Section 4.2) gives every path the positions it
would have had in plain decoding.
"""

from __future__ import annotations

import math

import torch

from specinfer.engine.models.config import ModelConfig, yarn_attention_factor


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq of shape (head_dim/2,), attention scaling applied to cos/sin)."""
    rope = cfg.rope
    dim = cfg.head_dim
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
        return _llama3(inv_freq, cfg), 1.0
    if rope.rope_type == "yarn":
        return _yarn(cfg)
    raise AssertionError(rope.rope_type)  # ModelConfig validated the type


def _llama3(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    rope = cfg.rope
    old_len = rope.original_max_position_embeddings or cfg.max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    rope = cfg.rope
    dim = cfg.head_dim
    base = rope.theta
    original = rope.original_max_position_embeddings or cfg.max_position_embeddings
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


def rope_tables(cfg: ModelConfig, num_positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (num_positions, head_dim), computed in fp32 then cast."""
    inv_freq, scale = inverse_frequencies(cfg)
    pos = torch.arange(num_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
    cos = (emb.cos() * scale).to(dtype=dtype, device=device)
    sin = (emb.sin() * scale).to(dtype=dtype, device=device)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos/sin: (T, 1, D). Rotates the two halves of the head dimension."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
