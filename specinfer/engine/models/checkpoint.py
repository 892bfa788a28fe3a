"""Loads Llama-family weights from a local Hugging Face checkpoint directory (safetensors only)
or a GGUF file (`specinfer.model_source` says which a path is).

Both a single `model.safetensors` and a sharded `model.safetensors.index.json` are read. Pickled
`.bin` checkpoints are refused: loading them would execute arbitrary code. A GGUF's tensors are
dequantized from the file as they are read (`gguf.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from specinfer.engine.models.config import ModelConfig
from specinfer.engine.models.gguf import GGUFTensors
from specinfer.errors import UserError
from specinfer.model_source import ModelSource, resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unsupported dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise UserError(f"malformed {index}: {exc}") from exc
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise UserError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise UserError(f"{model_dir} holds only pickle checkpoints (.bin/.pt); convert them to safetensors")
    raise UserError(f"no *.safetensors weights in {model_dir}")


def open_checkpoint(model: str | Path | ModelSource, dtype: torch.dtype | None = None) -> Iterator:
    """The checkpoint's tensor files, each open while it is iterated: handles with `keys()`,
    `get_tensor(name)` and `get_slice(name)` (safetensors' `safe_open`, or `GGUFTensors`, which
    dequantizes a GGUF's tensors to `dtype` as they are read)."""
    source = resolve(model)
    if source.is_gguf:
        with GGUFTensors(source, dtype) as f:
            yield f
        return
    for path in safetensors_files(source.path):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f


def load_state_dict(model: str | Path | ModelSource, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, on CPU, under their Hugging Face names: a checkpoint
    directory's in their stored dtype; a GGUF's dequantized to `dtype` (None: block types to
    float32, float types as stored)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in open_checkpoint(model, dtype):
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    return tensors


def llama_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames HF tensors to the runner's fused layout and checks that nothing is missing."""
    # Some exports drop the `model.` prefix.
    if "model.embed_tokens.weight" not in state and "embed_tokens.weight" in state:
        state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in state.items()}

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise UserError(f"checkpoint is missing tensor {name!r}")
        return state[name]

    out: dict[str, torch.Tensor] = {"embed": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        out["lm_head"] = out["embed"]
    else:
        out["lm_head"] = state["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[f"{i}.qkv"] = torch.cat(
            [take(p + "self_attn.q_proj.weight"), take(p + "self_attn.k_proj.weight"), take(p + "self_attn.v_proj.weight")]
        )
        if cfg.attention_bias:
            out[f"{i}.qkv_bias"] = torch.cat(
                [take(p + "self_attn.q_proj.bias"), take(p + "self_attn.k_proj.bias"), take(p + "self_attn.v_proj.bias")]
            )
            if p + "self_attn.o_proj.bias" in state:
                out[f"{i}.o_bias"] = state[p + "self_attn.o_proj.bias"]
        out[f"{i}.o"] = take(p + "self_attn.o_proj.weight")
        out[f"{i}.gate_up"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        out[f"{i}.down"] = take(p + "mlp.down_proj.weight")
        if cfg.mlp_bias:
            out[f"{i}.gate_up_bias"] = torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
            out[f"{i}.down_bias"] = take(p + "mlp.down_proj.bias")
        out[f"{i}.in_norm"] = take(p + "input_layernorm.weight")
        out[f"{i}.post_norm"] = take(p + "post_attention_layernorm.weight")
    expected = (cfg.vocab_size, cfg.hidden_size)
    if tuple(out["embed"].shape) != expected:
        raise UserError(f"embedding shape {tuple(out['embed'].shape)} does not match config {expected}")
    return out
