"""Loads model weights from a local Hugging Face checkpoint directory (safetensors only) or a
GGUF file (`specinfer.model_source` says which a path is).

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

from specinfer.engine.models.config import ModelConfig, family_of
from specinfer.engine.models.gguf import GGUFTensors
from specinfer.engine.models.hf import decoder_weights
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


def engine_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames HF tensors to the runner's fused layout (`hf.py`), by the checkpoint's family,
    and checks that nothing is missing."""
    # Some exports drop the `model.` prefix.
    if "model.embed_tokens.weight" not in state and "embed_tokens.weight" in state:
        state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in state.items()}
    return decoder_weights(cfg, state, family_of(cfg).tensors)


llama_weights = engine_weights  # the name it had while the engine ran the Llama family only
