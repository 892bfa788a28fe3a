"""Gemma 3, text only (`Gemma3ForCausalLM`, model_type gemma3_text), as transformers runs it.

* Local and global layers (`layer_types`, else every `sliding_window_pattern`-th layer global):
  local layers attend within `sliding_window` tokens and rotate with their own RoPE base
  (`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`); global layers attend to
  everything, with the global RoPE and its scaling (e.g. linear) where set.
* RMSNorm scales by (1 + w), in float32, before casting back; four norms per layer (before and
  after attention, before and after the MLP) and an RMSNorm over each head of q and k.
* The embedding is scaled by sqrt(hidden_size) (a tensor in the model's dtype, as transformers
  keeps it), queries by `query_pre_attn_scalar` ** -0.5, the MLP is GeGLU (tanh GELU) and the
  final logits are soft-capped where `final_logit_softcapping` is set.

Attention-logit soft-capping and bidirectional attention are refused: transformers' SDPA path,
the one its generation runs, does not apply the former, and the latter is not a causal LM.
"""

from __future__ import annotations

from specinfer.engine.models import hf
from specinfer.errors import UserError

DEFAULTS = {"max_position_embeddings": 131072, "head_dim": 256, "tie_word_embeddings": True, "eos_token_id": 1,
            "bos_token_id": 2}


def rope_by_type(raw: dict) -> tuple[hf.RopeConfig, hf.RopeConfig]:
    """(global RoPE, local RoPE) from `rope_parameters` per layer type, or the older spelling
    (`rope_theta`, `rope_scaling` for the global layers, `rope_local_base_freq`)."""
    params = raw.get("rope_parameters") or {}
    nested = any(k in params for k in hf.LAYER_TYPES)
    full = dict(params.get(hf.FULL_ATTENTION) or {}) if nested else dict(params)
    local = dict(params.get(hf.SLIDING_ATTENTION) or {}) if nested else {}
    if not nested:
        full.update(raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    allowed = ("default", "linear", "dynamic", "llama3", "yarn")
    return hf.parse_rope(full, raw, allowed), hf.parse_rope(local, raw, allowed)


def config_fields(raw: dict, arch: str) -> dict:
    if raw.get("attn_logit_softcapping") is not None:
        raise UserError("Gemma 3 attention-logit soft-capping (attn_logit_softcapping) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UserError("Gemma 3 with use_bidirectional_attention is not a causal language model")
    fields = hf.common_fields(raw, DEFAULTS)
    window = hf.positive_window(raw.get("sliding_window", 4096))
    raw_types = raw.get("layer_types")
    if raw_types is None:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        raw_types = [hf.SLIDING_ATTENTION if (i + 1) % pattern else hf.FULL_ATTENTION
                     for i in range(fields["num_layers"])]
    full_rope, local_rope = rope_by_type(raw)
    softcap = raw.get("final_logit_softcapping")
    fields.update(
        hidden_act=hf.activation(raw, "hidden_activation", "gelu_pytorch_tanh"),
        rope=full_rope,
        local_rope=local_rope,
        attention_bias=bool(raw.get("attention_bias", False)),
        sliding_window=window,
        layer_types=hf.window_layer_types(fields["num_layers"], window, raw_types),
        norm_offset=1.0,
        is_qk_norm=True,
        is_sandwich_norm=True,
        embed_scale=fields["hidden_size"] ** 0.5,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=float(softcap) if softcap is not None else None,
    )
    return fields


FAMILY = hf.Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    covers="Gemma 3 (text)",
    config_fields=config_fields,
    tensors=hf.LayerTensors(norms=(
        ("in_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
        ("mlp_norm", "pre_feedforward_layernorm"), ("mlp_out_norm", "post_feedforward_layernorm"),
        ("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm"),
    )),
    has_layer_types=True,
)
