"""A model as a transformers `AutoModelForCausalLM`, from a checkpoint directory or a GGUF file:
the SSMs `specinfer boost-tune` trains, and the transformers arms `specinfer bench` compares
against. A GGUF's model is built from its metadata's config.json with the weights this package
dequantizes (`engine/models/gguf.py`), so both sides of a comparison run the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specinfer.engine.models.checkpoint import load_state_dict, safetensors_files
from specinfer.model_source import ModelSource, resolve
from specinfer.util import quiet_transformers
from transformers import AutoConfig, AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING


def load_hf_model(model: str | Path | ModelSource, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The model in `dtype` on `device`, in eval mode (safetensors only; pickle is refused)."""
    source = resolve(model)
    with quiet_transformers():
        if source.is_gguf:
            config = AutoConfig.from_pretrained(source.meta_dir)
            model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
            hf = model_cls.from_pretrained(None, config=config, state_dict=load_state_dict(source, dtype), dtype=dtype)
        else:
            safetensors_files(source.path)  # refuses pickle-only checkpoints with a UserError
            hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, use_safetensors=True)
    return hf.to(device).eval()
