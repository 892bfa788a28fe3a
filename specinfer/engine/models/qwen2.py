"""Qwen2 and Qwen2.5: the Llama decoder with biases on the q, k and v projections, and
optionally sliding-window attention on the layers from `max_window_layers` on (when
`use_sliding_window` is set), as transformers' Qwen2 model runs them.
"""

from __future__ import annotations

from specinfer.engine.models import hf


def window_types(raw: dict, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers' Qwen2/Qwen3 configs derive them."""
    window = hf.positive_window(raw.get("sliding_window", 4096)) if raw.get("use_sliding_window") else None
    raw_types = raw.get("layer_types")
    if raw_types is None and window:
        first = int(raw.get("max_window_layers", 28))
        raw_types = [hf.SLIDING_ATTENTION if i >= first else hf.FULL_ATTENTION for i in range(num_layers)]
    return window, hf.window_layer_types(num_layers, window, raw_types)


def config_fields(raw: dict, arch: str) -> dict:
    fields = hf.common_fields(raw, {"max_position_embeddings": 32768})
    window, types = window_types(raw, fields["num_layers"])
    fields.update(
        hidden_act=hf.activation(raw),
        rope=hf.parse_rope(hf.rope_params(raw), raw, ("default", "linear", "dynamic", "llama3", "yarn")),
        attention_bias=True,  # q, k and v always have biases; o never does
        sliding_window=window,
        layer_types=types,
    )
    return fields


FAMILY = hf.Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    covers="Qwen2, Qwen2.5",
    config_fields=config_fields,
    has_layer_types=True,
)
