"""Qwen3: the Qwen2 decoder with an explicit `head_dim`, optional attention biases, and an
RMSNorm over each head of the queries and keys before RoPE (`q_norm`, `k_norm`).
"""

from __future__ import annotations

from specinfer.engine.models import hf
from specinfer.engine.models.qwen2 import window_types


def config_fields(raw: dict, arch: str) -> dict:
    fields = hf.common_fields(raw, {"max_position_embeddings": 32768, "head_dim": 128})
    window, types = window_types(raw, fields["num_layers"])
    bias = bool(raw.get("attention_bias", False))
    fields.update(
        hidden_act=hf.activation(raw),
        rope=hf.parse_rope(hf.rope_params(raw), raw, ("default", "linear", "dynamic", "llama3", "yarn")),
        attention_bias=bias,
        sliding_window=window,
        layer_types=types,
        is_qk_norm=True,
    )
    return fields


FAMILY = hf.Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    covers="Qwen3",
    config_fields=config_fields,
    tensors=hf.LayerTensors(norms=hf.LayerTensors().norms + (("q_norm", "self_attn.q_norm"),
                                                             ("k_norm", "self_attn.k_norm"))),
    has_layer_types=True,
)
