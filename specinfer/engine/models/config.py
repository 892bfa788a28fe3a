"""Model configuration for the Llama family, read from a Hugging Face ``config.json``.

SpecInfer (arXiv 2305.09781) evaluates LLaMA-family LLMs and SSMs (Section 6); this module
normalises the config formats of Llama 1/2/3, Mistral, TinyLlama and SmolLM into one frozen
dataclass so that model code never touches raw JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from specinfer.errors import UserError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stored_dtype: str = "float32"

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes one token's K and V take across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if raw.get("auto_map"):  # its model is defined by code shipped with it, not by this module
            classes = raw["auto_map"]
            named = ", ".join(sorted(map(str, classes.values()))) if isinstance(classes, dict) else str(classes)
            raise UserError(f"config.json has auto_map ({named}): the checkpoint needs its own (remote) model code, "
                            "which is never run here; only standard Llama and Mistral checkpoints are supported")
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch is None and raw.get("model_type") in ("llama", "mistral"):
            arch = "MistralForCausalLM" if raw["model_type"] == "mistral" else "LlamaForCausalLM"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(
                f"unsupported architecture {arch!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)} "
                "(Llama 1/2/3, Mistral, TinyLlama, SmolLM)"
            )
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UserError(f"unsupported hidden_act {act!r}: only SwiGLU (silu) Llama-family models are supported")
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            stored_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir)
        if not path.is_dir():
            raise UserError(f"model directory not found: {path}")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise UserError(f"no config.json in model directory {path}")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"malformed config.json in {path}: {exc}") from exc
        return cls.from_dict(raw)


def _parse_rope(raw: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserError(
            f"unsupported rope_scaling type {rope_type!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factor = params.get("factor")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor) if factor is not None else 1.0,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        attention_factor=params.get("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim)
    return get_mscale(rope.factor)
