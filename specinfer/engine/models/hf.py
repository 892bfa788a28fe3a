"""Hugging Face checkpoint conventions shared by the model families (`llama.py`, `qwen2.py`, ...).

A family module turns a checkpoint's raw ``config.json`` into the fields of one
`config.ModelConfig`, and its tensor names into the runner's fused layout. What the families
share lives here: the common config fields with transformers' defaults, the RoPE parameters in
their old (``rope_theta`` + ``rope_scaling``) and new (``rope_parameters``) spellings, the
sliding-window layer types, and the decoder-layer tensor mapping (q/k/v fused into ``qkv``,
gate/up fused into ``gate_up``). The engine's layout, per layer ``i``:

    {i}.qkv, {i}.qkv_bias      attention input projection (q rows, then k, then v)
    {i}.o, {i}.o_bias          attention output projection
    {i}.gate_up, {i}.gate_up_bias, {i}.down, {i}.down_bias    the gated MLP (gate rows, then up)
    {i}.in_norm                the norm before attention
    {i}.mlp_norm               the norm before the MLP
    {i}.attn_out_norm, {i}.mlp_out_norm   norms of the attention and MLP outputs (Gemma 3)
    {i}.q_norm, {i}.k_norm     per-head norms of queries and keys before RoPE (Qwen3, Gemma 3)

plus ``embed``, ``norm`` (the final norm) and ``lm_head``. SpecInfer (arXiv 2305.09781) verifies
token trees with the LLM's own forward pass, so every family's forward must be exactly the
reference implementation's: these conventions follow transformers' model code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from specinfer.errors import UserError

if TYPE_CHECKING:
    import torch

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu")


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
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors within the original context
    is_factor_set: bool = False  # longrope: `factor` was given (else max/original positions)


@dataclass(frozen=True)
class LayerTensors:
    """A family's decoder-layer tensor names (after ``model.layers.{i}.``), by engine name.

    `qkv` and `gate_up` list the projections concatenated by rows, in order (one name when the
    checkpoint stores them fused); `norms` maps engine norm names to checkpoint names.
    """

    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    norms: tuple[tuple[str, str], ...] = (("in_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))


@dataclass(frozen=True)
class Family:
    """One entry of the model registry (`config.FAMILIES`)."""

    name: str
    architectures: tuple[str, ...]  # config.json `architectures[0]` values
    model_types: tuple[str, ...]  # config.json `model_type` values, for configs without `architectures`
    covers: str  # the model lines it serves, for error messages
    config_fields: Callable[[dict, str], dict]  # (raw config.json, architecture) -> ModelConfig fields
    tensors: LayerTensors = field(default_factory=LayerTensors)
    has_layer_types: bool = False  # transformers' config keeps `layer_types` (a cut model must too)


# ---- config.json -----------------------------------------------------------------------------------


def common_fields(raw: dict, defaults: dict | None = None) -> dict:
    """The ModelConfig fields every family reads the same way; `defaults` are the family's
    transformers config defaults for keys a config.json may leave out."""
    d = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, **(defaults or {})}

    def get(key: str):
        value = raw.get(key)
        return d.get(key) if value is None else value

    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        fields = dict(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(get("max_position_embeddings")),
            rms_norm_eps=float(get("rms_norm_eps")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
        )
    except KeyError as exc:
        raise UserError(f"config.json lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise UserError(f"config.json has a malformed size: {exc}") from None
    eos = raw.get("eos_token_id", d.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    fields.update(bos_token_id=raw.get("bos_token_id", d.get("bos_token_id")),
                  eos_token_ids=tuple(int(e) for e in eos_ids),
                  stored_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"))
    return fields


def activation(raw: dict, key: str = "hidden_act", default: str = "silu") -> str:
    act = raw.get(key) or default
    if act not in ACTIVATIONS:
        raise UserError(f"unsupported {key} {act!r}: supported are {', '.join(ACTIVATIONS)}")
    return act


def window_layer_types(num_layers: int, sliding_window: int | None, raw_types) -> tuple[str, ...]:
    """Per-layer attention types from config.json's `layer_types` (checked), else every layer
    sliding when there is a window (Mistral, Phi-3), else every layer full."""
    if raw_types is None:
        return ((SLIDING_ATTENTION if sliding_window else FULL_ATTENTION),) * num_layers
    types = tuple(raw_types)
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise UserError(f"config.json layer_types must list {num_layers} of {', '.join(LAYER_TYPES)}; got {raw_types}")
    if SLIDING_ATTENTION in types and not sliding_window:
        raise UserError("config.json layer_types has sliding_attention layers but no sliding_window")
    return types


def positive_window(value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or value < 1:
        raise UserError(f"config.json sliding_window must be a positive integer, got {value!r}")
    return value


def rope_params(raw: dict) -> dict:
    """The one RoPE parameter dict of a config, from either spelling (transformers >= 5 writes
    `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`)."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return params


def parse_rope(params: dict, raw: dict, allowed: tuple[str, ...] = ROPE_TYPES) -> RopeConfig:
    """A RopeConfig from one RoPE parameter dict; `raw` supplies config-level fallbacks."""
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in allowed:
        raise UserError(f"unsupported rope_scaling type {rope_type!r}: supported are {', '.join(allowed)}")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if rope_type == "longrope":  # a config-level value wins, as transformers has it for Phi-3
        original = raw.get("original_max_position_embeddings") or original or raw.get("max_position_embeddings")
        if not params.get("short_factor") or not params.get("long_factor"):
            raise UserError("longrope rope_scaling needs short_factor and long_factor")
    return RopeConfig(
        theta=float(params.get("rope_theta") if params.get("rope_theta") is not None else 10000.0),
        rope_type=rope_type,
        factor=float(factor) if factor is not None else 1.0,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original else None,
        attention_factor=params.get("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        is_factor_set=factor is not None,
    )


def yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim)
    return get_mscale(rope.factor)


def longrope_attention_factor(rope: RopeConfig, max_position_embeddings: int) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor if rope.is_factor_set else max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


# ---- tensors ---------------------------------------------------------------------------------------


def decoder_layout(cfg, keys, names: LayerTensors) -> dict[str, tuple[str, ...]]:
    """The engine's fused layout over a checkpoint's tensor names `keys` (with the `model.`
    prefix): each engine weight's HF tensors, stacked by rows in this order (one name: taken as
    it is). A missing tensor is a UserError naming it. `cfg` is the checkpoint's ModelConfig."""
    keys = set(keys)

    def take(*hf_names: str) -> tuple[str, ...]:
        for name in hf_names:
            if name not in keys:
                raise UserError(f"checkpoint is missing tensor {name!r}")
        return hf_names

    embed = take("model.embed_tokens.weight")
    out = {"embed": embed, "norm": take("model.norm.weight"),
           "lm_head": embed if cfg.tie_word_embeddings or "lm_head.weight" not in keys else ("lm_head.weight",)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[f"{i}.qkv"] = take(*(f"{p}{part}.weight" for part in names.qkv))
        if cfg.attention_bias:
            out[f"{i}.qkv_bias"] = take(*(f"{p}{part}.bias" for part in names.qkv))
            if f"{p}{names.o}.bias" in keys:
                out[f"{i}.o_bias"] = (f"{p}{names.o}.bias",)
        out[f"{i}.o"] = take(f"{p}{names.o}.weight")
        out[f"{i}.gate_up"] = take(*(f"{p}{part}.weight" for part in names.gate_up))
        out[f"{i}.down"] = take(f"{p}{names.down}.weight")
        if cfg.mlp_bias:
            out[f"{i}.gate_up_bias"] = take(*(f"{p}{part}.bias" for part in names.gate_up))
            out[f"{i}.down_bias"] = take(f"{p}{names.down}.bias")
        for engine_name, hf_name in names.norms:
            out[f"{i}.{engine_name}"] = take(f"{p}{hf_name}.weight")
    return out


def check_layout(cfg, layout: dict[str, tuple[str, ...]], shape_of: Callable[[str], tuple[int, ...]]) -> None:
    """Checks the embedding's shape and layer 0's q/k/v rows against the config, from the HF
    tensors' shapes (`shape_of`), before any of them need be read."""
    expected = (cfg.vocab_size, cfg.hidden_size)
    embed = tuple(shape_of(layout["embed"][0]))
    if embed != expected:
        raise UserError(f"embedding shape {embed} does not match config {expected}")
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    rows = sum(shape_of(name)[0] for name in layout["0.qkv"]) if cfg.num_layers else qkv_rows
    if rows != qkv_rows:
        raise UserError(f"layer 0's q/k/v projections have {rows} rows; the config says {qkv_rows}")


def fuse(tensors: list["torch.Tensor"]) -> "torch.Tensor":
    """HF tensors stacked by rows (a lone one as it is), with a GGUF's block codes where every
    part has them (`engine/models/gguf.py`)."""
    import torch  # here alone: the rest of this module parses configs, which torch-free processes do

    if len(tensors) == 1:
        return tensors[0]
    out = torch.cat(tensors)
    codes = [getattr(t, "block_codes", None) for t in tensors]
    if codes[0] is not None:  # `cat` gives None unless every part has codes
        out.block_codes = type(codes[0]).cat(codes)
    return out


def decoder_weights(cfg, state: dict[str, "torch.Tensor"], names: LayerTensors) -> dict[str, "torch.Tensor"]:
    """HF tensors (with the `model.` prefix) -> the engine's fused layout (`decoder_layout`); a
    tied head is the embedding's very tensor."""
    layout = decoder_layout(cfg, state.keys(), names)
    check_layout(cfg, layout, lambda name: tuple(state[name].shape))
    return {engine: fuse([state[name] for name in hf_names]) for engine, hf_names in layout.items()}
