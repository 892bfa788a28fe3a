"""A lean Llama-family transformer for inference: RMSNorm, RoPE, GQA attention, SwiGLU.

One `forward` serves prefill, one-token decode and token-tree verification (SpecInfer Section
4.2): the caller passes token ids, their positions, the cache slots to write, and per sequence the
cache slots to read plus a topology-aware mask. The KV cache is explicit and preallocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specinfer.engine.models.config import ModelConfig
from specinfer.engine.layers.rope import apply_rope, rope_tables


@dataclass
class KVCache:
    """Preallocated keys and values for every layer: (num_layers, num_slots, num_kv_heads, head_dim)."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device) -> "KVCache":
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies slots `src` to slots `dst` in every layer at once (the accepted-path commit)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


@dataclass
class SeqAttention:
    """Attention inputs of one sequence in a packed batch.

    Queries are rows [q_start, q_end) of the batch. Keys are the cache slots `context` (a slice
    when contiguous, else an index tensor) of length L. `mask` is (n, L) bool, True = may
    attend; None means every query sees every key, `is_causal` means a plain causal chain.
    """

    q_start: int
    q_end: int
    context: slice | torch.Tensor
    mask: torch.Tensor | None = None
    is_causal: bool = False


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    write: slice | torch.Tensor  # where the T new keys/values go in the cache
    seqs: list[SeqAttention]
    logit_rows: torch.Tensor | None = None  # rows of T that need logits; None = all


class LlamaModel:
    """Inference-only weights and forward pass. Weights are fused: qkv and gate_up."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.w = {name: t.to(device=self.device, dtype=dtype).contiguous() for name, t in weights.items()}
        if weights["lm_head"] is weights["embed"]:
            self.w["lm_head"] = self.w["embed"]
        self.cos, self.sin = rope_tables(cfg, cfg.max_position_embeddings, dtype, self.device)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.attention_backend = None  # callable like self.attention, e.g. kernels.TritonAttention
        self.group = None  # a parallel.ShardGroup when these are one rank's shard of the weights

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)
        # Matches HF: normalise in fp32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * xf.to(x.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Returns fp32 logits of shape (R, vocab) for the requested rows."""
        cfg, w = self.cfg, self.w
        num_tokens = batch.token_ids.shape[0]
        h = F.embedding(batch.token_ids, w["embed"])  # (T, hidden)
        cos = self.cos[batch.positions].unsqueeze(1)  # (T, 1, D)
        sin = self.sin[batch.positions].unsqueeze(1)
        for i in range(cfg.num_layers):
            x = self.rms_norm(h, w[f"{i}.in_norm"])
            qkv = F.linear(x, w[f"{i}.qkv"], w.get(f"{i}.qkv_bias"))  # (T, (H + 2 Hkv) D)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.view(num_tokens, cfg.num_heads, cfg.head_dim), cos, sin)  # (T, H, D)
            k = apply_rope(k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim), cos, sin)  # (T, Hkv, D)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = kv.k[i], kv.v[i]  # (S, Hkv, D)
            if isinstance(batch.write, slice):
                k_cache[batch.write] = k
                v_cache[batch.write] = v
            else:
                k_cache.index_copy_(0, batch.write, k)
                v_cache.index_copy_(0, batch.write, v)
            attn = (self.attention_backend or self.attention)(q, k_cache, v_cache, batch.seqs)  # (T, H * D)
            out = F.linear(attn, w[f"{i}.o"], w.get(f"{i}.o_bias"))
            if self.group is not None:  # row-parallel o: each rank's product is a partial sum
                self.group.all_reduce(out)
            h = h + out
            x = self.rms_norm(h, w[f"{i}.post_norm"])
            gate, up = F.linear(x, w[f"{i}.gate_up"], w.get(f"{i}.gate_up_bias")).chunk(2, dim=-1)
            out = F.linear(F.silu(gate) * up, w[f"{i}.down"], w.get(f"{i}.down_bias"))
            if self.group is not None:  # row-parallel down
                self.group.all_reduce(out)
            h = h + out
        if batch.logit_rows is not None:
            h = h[batch.logit_rows]
        h = self.rms_norm(h, w["norm"])
        return F.linear(h, w["lm_head"]).float()  # (R, V)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: list[SeqAttention]):
        """q: (T, H, D). Each sequence attends over its own cached context."""
        outs = []
        for s in seqs:
            keys = k_cache[s.context] if isinstance(s.context, slice) else k_cache.index_select(0, s.context)
            values = v_cache[s.context] if isinstance(s.context, slice) else v_cache.index_select(0, s.context)
            o = F.scaled_dot_product_attention(
                q[s.q_start : s.q_end].transpose(0, 1).unsqueeze(0),  # (1, H, n, D)
                keys.transpose(0, 1).unsqueeze(0),  # (1, Hkv, L, D)
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=s.mask,
                is_causal=s.is_causal,
                enable_gqa=self.cfg.num_kv_heads != self.cfg.num_heads,
            )  # (1, H, n, D)
            outs.append(o[0].transpose(0, 1).reshape(s.q_end - s.q_start, self.q_size))  # (n, H * D)
        return outs[0] if len(outs) == 1 else torch.cat(outs)
