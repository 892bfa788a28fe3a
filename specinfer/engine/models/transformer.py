"""A lean decoder-only transformer for inference, one forward for every supported family.

One `forward` serves prefill, one-token decode and token-tree verification (SpecInfer Section
4.2): the caller passes token ids, their positions, the cache slots to write, and per sequence the
cache slots to read plus a topology-aware mask. The KV cache is explicit and preallocated.

The forward is parameterised by the `ModelConfig` (built by the family modules, `config.py`):
Llama-style or Gemma-style RMSNorm (`layers/norms.py`), optional per-head q/k norms, norms on the
attention and MLP outputs, the MLP's activation (`layers/activations.py`), each layer's RoPE
(`layers/rope.py`, partial rotary included), the attention scale, an embedding scale and final
logit soft-capping. Sliding-window layers attend through `ForwardBatch.window_seqs`, the same
sequences with the window's mask (built once per step by the runner, shared by those layers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specinfer.engine.layers import cpu_gemm
from specinfer.engine.layers.activations import ACTIVATIONS
from specinfer.engine.layers.embedding import coded_table, embedding
from specinfer.engine.layers.linear import can_pack, linear, pack
from specinfer.engine.layers.norms import norm_for, offset_weight
from specinfer.engine.layers.rope import rope_for, rope_tables
from specinfer.engine.models.config import ModelConfig


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

    @property
    def num_keys(self) -> int:
        c = self.context
        return c.stop - c.start if isinstance(c, slice) else int(c.shape[0])


def windowed(seq: SeqAttention, starts: list[int], device) -> SeqAttention:
    """`seq` as a sliding-window layer sees it: query row r only keys from index `starts[r]` of
    its context on (on top of `seq`'s own mask). Keys no row sees leave the context."""
    lo, num_keys, n = min(starts), seq.num_keys, seq.q_end - seq.q_start
    if max(starts) == 0:
        return seq
    ctx = seq.context
    context = slice(ctx.start + lo, ctx.stop) if isinstance(ctx, slice) else ctx[lo:]
    if seq.mask is not None:
        base = seq.mask[:, lo:]
    elif seq.is_causal:
        base = torch.ones(n, num_keys, dtype=torch.bool, device=device).tril()[:, lo:]
    else:
        base = None
    if max(starts) == lo:  # one cut for every row
        return SeqAttention(seq.q_start, seq.q_end, context, base)
    cols = torch.arange(lo, num_keys, device=device)
    keep = cols.unsqueeze(0) >= torch.tensor(starts, device=device).unsqueeze(1)  # (n, L - lo)
    return SeqAttention(seq.q_start, seq.q_end, context, keep if base is None else keep & base)


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    write: slice | torch.Tensor  # where the T new keys/values go in the cache
    seqs: list[SeqAttention]
    logit_rows: torch.Tensor | None = None  # rows of T that need logits; None = all
    # Sliding-window layers: the same sequences under the window (the very `seqs` list when the
    # window hides nothing this step), and per row of T the first key index (into its sequence's
    # full context) the window lets it see; None when the window hides nothing.
    window_seqs: list[SeqAttention] | None = None
    window_starts: list[int] | None = None


# The logit of a token outside a draft's reduced vocabulary: far below any real logit, so its
# probability is exactly 0 at any temperature, yet finite, so no sum or product over the
# vocabulary turns into NaN.
UNSCORED_LOGIT = -1e9

MATRICES = (".qkv", ".o", ".gate_up", ".down", "lm_head")  # the weights every pass multiplies by


def _q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A float32 matrix rounded to 8-bit block codes: the values they define, carrying them as
    `block_codes` for `pack` (the weight itself where its inputs do not split into blocks)."""
    codes = cpu_gemm.BlockCodes.q8_0(weight) if weight.dtype == torch.float32 else None
    if codes is None:
        return weight
    values = codes.values()
    values.block_codes = codes
    return values


class DecoderModel:
    """Inference-only weights and forward pass. Weights are fused: qkv and gate_up (`hf.py`).
    On a CPU the weight matrices are laid out once for the GEMM kernels (`layers/linear.py`) unless
    `is_packed` is False (a model built on the CPU to be moved elsewhere). With `is_q8_0` (an SSM's
    choice, limits.Q8_DTYPE) the packed matrices are first rounded to 8-bit block codes
    (`cpu_gemm.BlockCodes.q8_0`), which the kernel reads as they are. A packed model's token
    embedding, where block codes give it (a GGUF's, or a q8_0 SSM's), is looked up from them
    (`layers.embedding.CodedTable`), a byte a weight instead of four."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device,
                 is_packed: bool = True, is_q8_0: bool = False):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.is_offset = cfg.norm_offset != 0.0
        is_packing = is_packed and can_pack(self.device, dtype)
        self.is_q8_0 = is_q8_0 and is_packing and cpu_gemm.available()
        # A draft's reduced vocabulary: its head scores only these tokens (`forward` scatters them).
        self.head_ids = None
        if cfg.head_token_ids:
            self.head_ids = torch.tensor(cfg.head_token_ids, dtype=torch.long, device=self.device)
        # The weights are taken one at a time, each laid out before the next is asked for, so a
        # mapping that reads them as asked (`checkpoint.stream_weights`) never holds them all in
        # their read form: the embedding and the head first, then the rest in order.
        embed, head = weights["embed"], weights["lm_head"]
        self.w = {"embed": self._held("embed", embed)}
        self.w["lm_head"] = self.w["embed"] if head is embed else self._held("lm_head", head)
        del embed, head
        if self.head_ids is not None:
            self.w["lm_head"] = self.w["lm_head"].index_select(0, self.head_ids).contiguous()
        if is_packing:  # a tied LM head gets a packed copy; lookups read `embed`
            self.w["lm_head"] = pack(_q8_0(self.w["lm_head"]) if self.is_q8_0 else self.w["lm_head"])
            # a token embedding given by block codes (a GGUF's; a q8_0 SSM's): looked up from them
            table = coded_table(_q8_0(self.w["embed"]) if self.is_q8_0 else self.w["embed"])
            if table is not None:
                self.w["embed"] = table
        for name in weights:
            if name not in self.w:
                t = self._held(name, weights[name])
                self.w[name] = pack(_q8_0(t) if self.is_q8_0 else t) if is_packing and name.endswith(MATRICES) else t
        for t in self.w.values():  # a GGUF's codes (`models/gguf.py`) serve `pack` and `coded_table` alone
            if isinstance(t, torch.Tensor) and hasattr(t, "block_codes"):
                del t.block_codes
        # A float32 model that stays on the CPU (one built unpacked is to move elsewhere) runs its
        # norms, rotation and attention through the CPU kernels where they are built.
        is_cpu_float32 = is_packing and dtype == torch.float32
        self.norm = norm_for(self.is_offset, is_cpu_float32, {cfg.hidden_size, cfg.head_dim}, cfg.rms_norm_eps)
        self.act = ACTIVATIONS[cfg.hidden_act]
        ropes = list(dict.fromkeys(cfg.layer_rope(i) for i in range(cfg.num_layers))) or [cfg.rope]
        rotary = cfg.rotary_dim or cfg.head_dim
        self.apply_rope = rope_for(is_cpu_float32, rotary != cfg.head_dim)
        # One (cos, sin) table per distinct RoPE; each layer indexes its own.
        self.rope = [rope_tables(r, rotary, cfg.max_position_embeddings, cfg.max_position_embeddings, dtype,
                                 self.device) for r in ropes]
        # Per layer: (is a sliding-window layer, index of its RoPE table).
        self.layer_kinds = [(cfg.is_sliding(i), ropes.index(cfg.layer_rope(i))) for i in range(cfg.num_layers)]
        self.embed_scale = None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale, dtype=dtype,
                                                                             device=self.device)
        self.sm_scale = cfg.attention_scale
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.attention_backend = None  # callable like self.attention, e.g. kernels.TritonAttention
        # Without one, a float32 model on a CPU attends through the CPU kernel (`cpu_gemm.attention`).
        self.is_kernel_attention = is_cpu_float32 and cfg.head_dim % 8 == 0 and cpu_gemm.has_layer_ops()
        self.group = None  # a parallel.ShardGroup when these are one rank's shard of the weights

    def _held(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A weight as the model holds it: on its device in its dtype, norms with their offset."""
        if self.is_offset and "norm" in name:
            return offset_weight(t, self.cfg.norm_offset, self.dtype).to(self.device).contiguous()
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, return_hidden: bool = False):
        """fp32 logits of shape (R, vocab) for the requested rows; with `return_hidden`, also
        the final hidden states of those rows (after the final norm, before the LM head)."""
        cfg, w = self.cfg, self.w
        h = embedding(batch.token_ids, w["embed"])  # (T, hidden)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        rope = [(cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1)) for cos, sin in self.rope]
        window_seqs = batch.window_seqs if batch.window_seqs is not None else batch.seqs
        for i, (is_sliding, rope_index) in enumerate(self.layer_kinds):
            h = h + self.attention_block(i, h, rope[rope_index], batch, window_seqs if is_sliding else batch.seqs, kv)
            h = h + self.mlp_block(i, h)
        if batch.logit_rows is not None:
            h = h[batch.logit_rows]
        h = self.norm(h, w["norm"], cfg.rms_norm_eps)
        logits = linear(h, w["lm_head"])
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        if self.head_ids is not None:  # tokens outside a draft's vocabulary: never proposed
            full = torch.full((logits.shape[0], cfg.vocab_size), UNSCORED_LOGIT, device=self.device)
            logits = full.index_copy_(1, self.head_ids, logits.float())
        return (logits.float(), h) if return_hidden else logits.float()  # (R, V)

    def attention_block(self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                        seqs: list[SeqAttention], kv: KVCache) -> torch.Tensor:
        """Layer i's attention output (to add to the residual stream)."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        num_tokens = h.shape[0]
        x = self.norm(h, w[f"{i}.in_norm"], eps)
        qkv = linear(x, w[f"{i}.qkv"], w.get(f"{i}.qkv_bias"))  # (T, (H + 2 Hkv) D)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # (T, Hkv, D)
        if cfg.is_qk_norm:
            q = self.norm(qkv[:, :self.q_size].view(num_tokens, cfg.num_heads, cfg.head_dim), w[f"{i}.q_norm"], eps)
            k = self.norm(qkv[:, self.q_size:qk_size].view(num_tokens, cfg.num_kv_heads, cfg.head_dim),
                          w[f"{i}.k_norm"], eps)
            q, k = self.apply_rope(q, *rope), self.apply_rope(k, *rope)  # (T, H, D), (T, Hkv, D)
        else:  # queries and keys rotated together: one set of operators a layer
            qk = self.apply_rope(qkv[:, :qk_size].view(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim),
                                 *rope)
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
        k_cache, v_cache = kv.k[i], kv.v[i]  # (S, Hkv, D)
        if isinstance(batch.write, slice):
            k_cache[batch.write] = k
            v_cache[batch.write] = v
        else:
            k_cache.index_copy_(0, batch.write, k)
            v_cache.index_copy_(0, batch.write, v)
        attn = (self.attention_backend or self.attention)(q, k_cache, v_cache, seqs)  # (T, H * D)
        out = linear(attn, w[f"{i}.o"], w.get(f"{i}.o_bias"))
        if self.group is not None:  # row-parallel o: each rank's product is a partial sum
            self.group.all_reduce(out)
        if cfg.is_sandwich_norm:
            out = self.norm(out, w[f"{i}.attn_out_norm"], eps)
        return out

    def mlp_block(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer i's gated MLP output (to add to the residual stream)."""
        w, eps = self.w, self.cfg.rms_norm_eps
        x = self.norm(h, w[f"{i}.mlp_norm"], eps)
        gate, up = linear(x, w[f"{i}.gate_up"], w.get(f"{i}.gate_up_bias")).chunk(2, dim=-1)
        out = linear(self.act(gate) * up, w[f"{i}.down"], w.get(f"{i}.down_bias"))
        if self.group is not None:  # row-parallel down
            self.group.all_reduce(out)
        if self.cfg.is_sandwich_norm:
            out = self.norm(out, w[f"{i}.mlp_out_norm"], eps)
        return out

    @property
    def attention_name(self) -> str:
        """What computes attention: "sdpa", "cpu-kernel", or the backend's class name."""
        if self.attention_backend is not None:
            return type(self.attention_backend).__name__
        return "cpu-kernel" if self.is_kernel_attention else "sdpa"

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: list[SeqAttention]):
        """q: (T, H, D). Each sequence attends over its own cached context."""
        if (self.is_kernel_attention and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and k_cache.is_contiguous()
                and v_cache.is_contiguous()):
            outs = [cpu_gemm.attention(q[s.q_start : s.q_end], k_cache, v_cache, s.context, s.mask, s.is_causal,
                                       self.sm_scale) for s in seqs]
            return outs[0] if len(outs) == 1 else torch.cat(outs)
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
                scale=self.sm_scale,
                enable_gqa=self.cfg.num_kv_heads != self.cfg.num_heads,
            )  # (1, H, n, D)
            outs.append(o[0].transpose(0, 1).reshape(s.q_end - s.q_start, self.q_size))  # (n, H * D)
        return outs[0] if len(outs) == 1 else torch.cat(outs)
