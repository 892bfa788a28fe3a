"""The Llama family: Llama 1/2/3.x (with the linear, dynamic, llama3 and yarn RoPE scalings),
SmolLM, TinyLlama, and Mistral (every layer windowed when `sliding_window` is set).

SpecInfer (arXiv 2305.09781) evaluates LLaMA-family LLMs and SSMs (Section 6). The decoder is
the plain pre-norm one: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.
"""

from __future__ import annotations

from specinfer.engine.models import hf
from specinfer.errors import UserError


def config_fields(raw: dict, arch: str) -> dict:
    is_mistral = arch == "MistralForCausalLM"
    fields = hf.common_fields(raw, {"max_position_embeddings": 131072 if is_mistral else 2048})
    act = hf.activation(raw)
    if act not in ("silu", "swish"):
        raise UserError(f"unsupported hidden_act {act!r}: Llama-family models use SwiGLU (silu)")
    window = None
    if is_mistral:  # transformers' MistralConfig defaults to a 4096-token window
        window = hf.positive_window(raw.get("sliding_window", 4096))
    fields.update(
        rope=hf.parse_rope(hf.rope_params(raw), raw, ("default", "linear", "dynamic", "llama3", "yarn")),
        attention_bias=bool(raw.get("attention_bias", False)) and not is_mistral,
        mlp_bias=bool(raw.get("mlp_bias", False)) and not is_mistral,
        sliding_window=window,
        layer_types=hf.window_layer_types(fields["num_layers"], window, None),
    )
    return fields


FAMILY = hf.Family(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    model_types=("llama", "mistral"),
    covers="Llama 1/2/3, SmolLM, TinyLlama, Mistral",
    config_fields=config_fields,
)
