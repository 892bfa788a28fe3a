"""Phi-3 (and Phi-3.5/Phi-4-mini, which share its architecture): q, k and v in one fused
`qkv_proj`, gate and up in one `gate_up_proj`, RoPE on the first `partial_rotary_factor` of
each head, and a window on every layer when `sliding_window` is set, as transformers applies it.

LongRoPE (`rope_scaling` type longrope, or the older su/yarn names): transformers rotates with
the short factors while the sequence fits `original_max_position_embeddings` and switches every
position to the long factors past it, which a table precomputed per position cannot follow.
So such a model serves contexts up to `original_max_position_embeddings`, exactly.
"""

from __future__ import annotations

from specinfer.engine.models import hf
from specinfer.errors import UserError


def config_fields(raw: dict, arch: str) -> dict:
    fields = hf.common_fields(raw, {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "eos_token_id": 32000,
                                    "bos_token_id": 1})
    params = hf.rope_params(raw)
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params = {**params, "rope_type": "longrope"}
    params.pop("type", None)
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0)
    rotary_dim = int(fields["head_dim"] * partial)
    if not 0 < rotary_dim <= fields["head_dim"] or rotary_dim % 2:
        raise UserError(f"partial_rotary_factor {partial} leaves {rotary_dim} of {fields['head_dim']} dimensions "
                        "to rotate; it must be an even number")
    rope = hf.parse_rope(params, raw, ("default", "longrope"))
    if rope.rope_type == "longrope" and len(rope.short_factor) != rotary_dim // 2:
        raise UserError(f"longrope short_factor has {len(rope.short_factor)} entries; {rotary_dim // 2} expected")
    window = hf.positive_window(raw.get("sliding_window"))
    fields.update(
        hidden_act=hf.activation(raw),
        rope=rope,
        rotary_dim=rotary_dim,
        sliding_window=window,
        layer_types=hf.window_layer_types(fields["num_layers"], window, None),
    )
    return fields


FAMILY = hf.Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    covers="Phi-3",
    config_fields=config_fields,
    tensors=hf.LayerTensors(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)),
)
