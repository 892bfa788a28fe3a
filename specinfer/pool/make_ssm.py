"""`specinfer make-ssm`: an SSM cut from the LLM itself (a subset of its layers, optionally pruned).

SpecInfer (arXiv 2305.09781, Section 3) speculates with small speculative models (SSMs) that
share the LLM's tokenizer: "distilled, quantized, and/or pruned variants" of the LLM or small
models of its family. This module builds the cheapest such variant without any training:

* the embedding, the final norm and the LM head are copied unchanged (so the SSM speaks the
  LLM's vocabulary and reads its hidden states with the LLM's own head);
* only the chosen transformer layers are kept (``--layers N`` = the first N layers, or an explicit
  list such as ``0,1,7`` or ``0-2,7``), renumbered consecutively in ascending order;
* optionally, every kept layer's gated MLP keeps only a fraction of its channels, the ones with
  the largest weight magnitude: channel c scores ``sqrt(|gate[c,:]|^2 + |up[c,:]|^2 + |down[:,c]|^2)``
  (gate and up as separate tensors, or fused in one ``gate_up_proj`` as Phi-3 stores them).

Every supported family can be cut (`specinfer.engine.models.config.FAMILIES`): a family whose
layers differ (sliding-window and global layers of Gemma 3, Qwen2/Qwen3 windows) gets the kept
layers' ``layer_types`` written out explicitly, so the cut model windows exactly the layers the
LLM windows.

The result is an ordinary Hugging Face checkpoint (``config.json`` with the new
``num_hidden_layers``/``intermediate_size``, ``model.safetensors``, ``generation_config.json`` and
the LLM's tokenizer files), plus ``make_ssm.json`` recording where it came from. Such a model is
usually a poor speculator as cut; collective boost-tuning (``specinfer boost-tune``,
`specinfer.pool.boost_tune`) is what makes it agree with the LLM. The LLM may be a checkpoint
directory (safetensors only) or a GGUF file, whose weights are cut dequantized (float32, or the
file's F16/BF16) and whose tokenizer is the one built from its metadata.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from specinfer.engine.models.config import ModelConfig, family_of
from specinfer.errors import UserError
from specinfer.engine.models.checkpoint import load_state_dict
from specinfer.model_source import resolve
from specinfer.util import staged_dir, write_json
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")
PROVENANCE_NAME = "make_ssm.json"
_LAYER_KEY = re.compile(r"^(.*?layers\.)(\d+)(\..+)$")
_MLP_ROWS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.bias")
_FUSED_MLP_ROWS = ("mlp.gate_up_proj.weight", "mlp.gate_up_proj.bias")  # gate rows, then up rows


@dataclass(frozen=True)
class CutSpec:
    """Which layers to keep and what fraction of MLP channels per kept layer."""

    layers: tuple[int, ...]
    mlp_keep: float = 1.0

    def kept_channels(self, intermediate_size: int) -> int:
        return max(1, round(self.mlp_keep * intermediate_size))


# ---- parsing and validation -----------------------------------------------------------------


def parse_layers(text: str, num_layers: int) -> tuple[int, ...]:
    """'N' = the first N layers; 'i,j,k' (items may be ranges 'a-b', inclusive) = those layers."""
    text = str(text).strip()
    if re.fullmatch(r"\d+", text):
        n = int(text)
        if not 1 <= n <= num_layers:
            raise UserError(f"--layers {text}: the LLM has {num_layers} layers; keep between 1 and {num_layers}")
        return tuple(range(n))
    picked: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise UserError(f"malformed --layers {text!r}: expected N (the first N layers) or indices like 0,1,7 or 0-2,7")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise UserError(f"malformed --layers {text!r}: range {part} runs backwards")
        picked.extend(range(lo, hi + 1))
    bad = [i for i in picked if i >= num_layers]
    if bad:
        raise UserError(f"--layers {text}: index {bad[0]} out of range; the LLM has layers 0..{num_layers - 1}")
    if len(set(picked)) != len(picked):
        raise UserError(f"--layers {text}: a layer is listed twice")
    return tuple(sorted(picked))


def check_fraction(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise UserError(f"--mlp-keep must be in (0, 1], got {value}")
    return float(value)


# ---- the cut ---------------------------------------------------------------------------------


def channel_scores(state: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """L2 norm of each MLP channel across gate (row), up (row) and down (column)."""
    down = state[prefix + "mlp.down_proj.weight"].float()
    if prefix + "mlp.gate_up_proj.weight" in state:
        gate, up = state[prefix + "mlp.gate_up_proj.weight"].float().split(down.shape[1])
    else:
        gate = state[prefix + "mlp.gate_proj.weight"].float()
        up = state[prefix + "mlp.up_proj.weight"].float()
    return (gate.pow(2).sum(1) + up.pow(2).sum(1) + down.pow(2).sum(0)).sqrt()


def kept_channel_indices(state: dict[str, torch.Tensor], prefix: str, keep: int) -> torch.Tensor:
    """The `keep` highest-scoring channels of one layer, in ascending index order (ties: lower index)."""
    scores = channel_scores(state, prefix)
    order = sorted(range(len(scores)), key=lambda c: (-scores[c].item(), c))
    return torch.tensor(sorted(order[:keep]), dtype=torch.long)


def cut_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, spec: CutSpec) -> dict[str, torch.Tensor]:
    """The SSM's tensors: non-layer tensors as they are, kept layers renumbered and pruned."""
    new_index = {old: new for new, old in enumerate(spec.layers)}
    keep = spec.kept_channels(cfg.intermediate_size)
    prune = keep < cfg.intermediate_size
    channels: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _LAYER_KEY.match(name)
        if m is None:
            out[name] = tensor.contiguous()
            continue
        old = int(m.group(2))
        if old not in new_index:
            continue
        head, rest = m.group(1), m.group(3)[1:]
        if prune and rest.startswith("mlp."):
            prefix = f"{head}{old}."
            if prefix not in channels:
                channels[prefix] = kept_channel_indices(state, prefix, keep)
            tensor = _prune(tensor, rest, channels[prefix])
        out[f"{head}{new_index[old]}.{rest}"] = tensor.contiguous()
    return out


def _prune(tensor: torch.Tensor, rest: str, idx: torch.Tensor) -> torch.Tensor:
    if rest in _MLP_ROWS:
        return tensor.index_select(0, idx)
    if rest in _FUSED_MLP_ROWS:  # the kept channels of gate, then the same channels of up
        half = tensor.shape[0] // 2
        return tensor.index_select(0, torch.cat([idx, idx + half]))
    if rest == "mlp.down_proj.weight":
        return tensor.index_select(1, idx)
    return tensor  # down_proj.bias lives in the hidden dimension


def cut_config(raw: dict, cfg: ModelConfig, spec: CutSpec) -> dict:
    out = dict(raw)
    out["num_hidden_layers"] = len(spec.layers)
    out["intermediate_size"] = spec.kept_channels(cfg.intermediate_size)
    if family_of(cfg).has_layer_types:  # explicit: a pattern or first-windowed-layer rule would shift
        out["layer_types"] = [cfg.layer_types[i] for i in spec.layers]
    elif isinstance(raw.get("layer_types"), list) and len(raw["layer_types"]) == cfg.num_layers:
        out["layer_types"] = [raw["layer_types"][i] for i in spec.layers]
    return out


def make_ssm(llm_dir: str | Path, out_dir: str | Path, layers: str, mlp_keep: float = 1.0,
             overwrite: bool = False) -> Path:
    """Writes the cut checkpoint to `out_dir` (atomically: a temporary sibling renamed into place)."""
    llm_dir, out_dir = Path(llm_dir), Path(out_dir)
    cfg = ModelConfig.from_dir(llm_dir)  # missing dir/config, unsupported architecture: UserError
    spec = CutSpec(parse_layers(layers, cfg.num_layers), check_fraction(mlp_keep))
    if out_dir.resolve() == llm_dir.resolve():
        raise UserError("--out must differ from --from-llm")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise UserError(f"output directory {out_dir} is not empty (pass --overwrite to replace it)")
    source = resolve(llm_dir)  # a GGUF's metadata files are its config and tokenizer; its weights dequantized
    raw = source.read_config()
    tensors = cut_state_dict(load_state_dict(source), cfg, spec)
    with staged_dir(out_dir) as tmp:
        write_checkpoint(tmp, tensors, cut_config(raw, cfg, spec), source.meta_dir)
        write_json(tmp / PROVENANCE_NAME, {
            "from_llm": str(llm_dir.resolve()), "layers": list(spec.layers), "mlp_keep": spec.mlp_keep,
            "llm_num_layers": cfg.num_layers, "llm_intermediate_size": cfg.intermediate_size,
            "num_parameters": sum(t.numel() for t in tensors.values()),
        })
    return out_dir


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], config: dict, source: Path) -> None:
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config)
    gen = source / "generation_config.json"
    if gen.is_file():
        shutil.copyfile(gen, out / "generation_config.json")
    else:
        write_json(out / "generation_config.json", {k: config[k] for k in ("bos_token_id", "eos_token_id")
                                                     if config.get(k) is not None})
    copy_tokenizer_files(source, out)


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


# ---- command line ----------------------------------------------------------------------------


def run_make_ssm(args: argparse.Namespace) -> int:
    out = make_ssm(args.from_llm, args.out, args.layers, args.mlp_keep, overwrite=args.overwrite)
    cfg = ModelConfig.from_dir(out)
    info = json.loads((out / PROVENANCE_NAME).read_text())
    print(json.dumps({"out": str(out), "layers": info["layers"], "num_hidden_layers": cfg.num_layers,
                      "intermediate_size": cfg.intermediate_size, "num_parameters": info["num_parameters"]}))
    return 0
