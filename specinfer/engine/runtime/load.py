"""Wiring shared by the CLI and the services: model paths (checkpoint directories or GGUF files),
their checks, tokenizers and prompts, without torch; `assemble` loads the models.

Everything here validates input before loading weights, so bad flags fail fast with a
`UserError` (CLI exit code 2, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from specinfer.engine.models.config import ModelConfig
from specinfer.errors import UserError
from specinfer.limits import MODEL_FREE_NAMES
from specinfer.tokenizer import TextTokenizer, check_same_vocab

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPaths:
    llm: Path
    ssms: tuple[Path, ...] = ()
    model_free: tuple[str, ...] = ()  # model-free pool members by name (limits.MODEL_FREE_NAMES)


def split_pool(entries, is_model_free: bool = True) -> tuple[tuple[Path, ...], tuple[str, ...]]:
    """`--ssm` values as a pool: checkpoint directories, and the model-free members' names
    ("lookup", "suffix"; a checkpoint directory of that name is given as ./lookup). The
    model-free members join every pool, as they cost no model pass and dynamic trees keep only
    the drafts that pay, unless the entries name one of them (the pool is then exactly what they
    name) or `is_model_free` is False. `none` alone is the empty pool."""
    entries = [str(e) if str(e) in MODEL_FREE_NAMES + ("none",) else e for e in entries]
    if "none" in entries:
        if len(entries) > 1:
            raise UserError("--ssm none excludes every other --ssm")
        return (), ()
    dirs, names = [], []
    for entry in entries:
        if entry in MODEL_FREE_NAMES:
            if entry in names:
                raise UserError(f"--ssm {entry} given twice")
            names.append(entry)
        else:
            dirs.append(Path(entry))
    if not names and is_model_free:
        names = list(MODEL_FREE_NAMES)
    return tuple(dirs), tuple(names)


def resolve_device(name: str) -> str:
    import torch  # here alone: configurations and the CLI's checks use this module without torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but CUDA is not available")
    if name != "cpu" and not name.startswith("cuda"):
        raise UserError(f"unsupported device {name!r}: use cpu, cuda, cuda:N or auto")
    return name


def check_models(paths: ModelPaths) -> tuple[ModelConfig, list[ModelConfig]]:
    """Reads and cross-checks the configs (no weights): missing dirs, architecture, vocabulary."""
    llm_cfg = ModelConfig.from_dir(paths.llm)
    ssm_cfgs = []
    for ssm in paths.ssms:
        cfg = ModelConfig.from_dir(ssm)
        if cfg.vocab_size != llm_cfg.vocab_size:
            raise UserError(
                f"SSM {ssm} has vocabulary size {cfg.vocab_size} but the LLM {paths.llm} has {llm_cfg.vocab_size}"
            )
        check_same_vocab(paths.llm, ssm)
        ssm_cfgs.append(cfg)
    return llm_cfg, ssm_cfgs


def load_tokenizer(paths: ModelPaths, llm_cfg: ModelConfig) -> TextTokenizer:
    return TextTokenizer.from_dir(paths.llm, llm_cfg.eos_token_ids)


def read_prompts(path: str | Path, allow_messages: bool = False) -> list[str | list[dict[str, str]]]:
    """Reads a JSONL file of {"prompt": "..."} lines; with `allow_messages`, also of
    {"messages": [{"role": ..., "content": ...}, ...]} lines, returned as their message lists
    (for the caller to render with the model's chat template)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"prompts file not found: {p}")
    expected = 'a string field "prompt"' + (' or a list field "messages"' if allow_messages else "")
    prompts: list[str | list[dict[str, str]]] = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif allow_messages and isinstance(obj, dict) and "messages" in obj:
            prompts.append(_messages(obj["messages"], f"{p}:{lineno}"))
        else:
            raise UserError(f"{p}:{lineno}: expected an object with {expected}")
    if not prompts:
        raise UserError(f"prompts file {p} has no prompts")
    return prompts


def _messages(value, where: str) -> list[dict[str, str]]:
    """A chat's messages: a non-empty list of {"role": str, "content": str}."""
    if not isinstance(value, list) or not value:
        raise UserError(f'{where}: "messages" must be a non-empty list')
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f'{where}: every message must be {{"role": "...", "content": "..."}}')
    return [{"role": m["role"], "content": m["content"]} for m in value]


def encode_prompts(tokenizer: TextTokenizer, prompts: list[str]) -> list[list[int]]:
    out = []
    for i, text in enumerate(prompts):
        if not text:
            raise UserError(f"prompt {i} is empty")
        ids = tokenizer.encode(text)
        if not ids:
            raise UserError(f"prompt {i} encodes to no tokens")
        out.append(ids)
    return out


def check_context(llm_cfg: ModelConfig, ssm_cfgs: list[ModelConfig], prompt_ids: list[list[int]], max_new_tokens: int) -> int:
    """Raises if any prompt plus max_new_tokens exceeds the smallest model context."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    context = min(c.max_context for c in [llm_cfg, *ssm_cfgs])  # sliding windows really window: no cap
    longest = max(len(p) for p in prompt_ids)
    if longest + max_new_tokens > context:
        raise UserError(
            f"prompt of {longest} tokens plus --max-new-tokens {max_new_tokens} exceeds the model context of {context}"
        )
    return longest + max_new_tokens
