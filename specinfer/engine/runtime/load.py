"""Wiring shared by the CLI and the services: model paths (checkpoint directories or GGUF files)
in, a ready engine out.

Everything here validates input before loading weights, so bad flags fail fast with a
`UserError` (CLI exit code 2, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime.memory import KvPlan
from specinfer.errors import UserError
from specinfer.limits import DEFAULT_DTYPE, DEFAULT_RUNNER_KV_TOKENS
from specinfer.model_source import resolve
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
    from specinfer.limits import MODEL_FREE_NAMES

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
    import torch

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


def load_runner(model_dir: str | Path, dtype: str = DEFAULT_DTYPE, device: str = "cpu",
                max_kv_tokens: int = DEFAULT_RUNNER_KV_TOKENS, block_size: int | None = None, parallel=None, exec_cfg=None):
    """A `ModelRunner` for a checkpoint; with a tensor-parallel `parallel` (a `ParallelConfig`),
    this process is rank 0 of the group (its other ranks spawned here unless a launcher started
    them) and `runner.close()` stops them. `exec_cfg` (an `ExecConfig`) picks the attention
    backend, CUDA graphs and offloading."""
    from specinfer.engine.runtime.backend import resolve_exec
    from specinfer.engine.runtime.exec_config import ExecConfig
    from specinfer.engine.models.checkpoint import parse_dtype
    from specinfer.engine.runtime.parallel import ShardSpec, check_divisible
    from specinfer.engine.runtime.runner import DEFAULT_BLOCK_SIZE, ModelRunner

    block_size = block_size or DEFAULT_BLOCK_SIZE
    if parallel is None or not parallel.is_parallel:
        return ModelRunner.from_dir(model_dir, dtype, device, max_kv_tokens, block_size, exec_cfg)
    cfg = ModelConfig.from_dir(model_dir)
    parse_dtype(dtype)  # an unknown dtype fails before any process starts
    ex = resolve_exec(exec_cfg or ExecConfig(), device, True)
    check_divisible(cfg, parallel.num_ranks)  # before any process starts
    num_blocks = -(-max_kv_tokens // block_size)
    return leader_runner(ShardSpec(str(model_dir), dtype, device, num_blocks * block_size, ex.attention),
                         parallel, block_size)


def leader_runner(spec, pc, block_size: int):
    """Rank 0's `ModelRunner` (a `parallel.ShardSpec` and `ParallelConfig`): its model call and
    KV commits reach every rank first."""
    from specinfer.engine.models.transformer import KVCache
    from specinfer.engine.runtime.parallel import LeaderKV, LeaderModel, start_group
    from specinfer.engine.runtime.runner import ModelRunner

    model, leader = start_group(spec, pc)
    kv = KVCache.allocate(model.cfg, spec.num_slots, model.dtype, model.device)
    return ModelRunner(LeaderModel(model, leader), num_blocks=spec.num_slots // block_size, block_size=block_size,
                       kv=LeaderKV(kv.k, kv.v, leader))


def load_tokenizer(paths: ModelPaths, llm_cfg: ModelConfig) -> TextTokenizer:
    return TextTokenizer.from_dir(paths.llm, llm_cfg.eos_token_ids)


def load_engine(paths: ModelPaths, dtype: str, device: str, max_kv_tokens: int, ssm_dtype: str | None = None,
                cfg=None, parallel=None, exec_cfg=None, cache_dir: Path | None = None, report=None,
                kv_reason: str = "as asked"):
    """Loads the LLM and SSM runners with KV caches sized for `max_kv_tokens` tokens each, into
    an in-process engine configured by `cfg` (an `EngineConfig`; its defaults when None).
    `exec_cfg` (an `ExecConfig`) picks the attention backend and CUDA graphs of the LLM and the
    SSMs alike, and whether the LLM's weights are offloaded (never the SSMs': they are small).
    Loading is told to `report` (default: logged): the LLM, its KV cache (why that size:
    `kv_reason`), each SSM's measured dtype.

    The SSMs may run in another dtype than the LLM: they only propose tokens, and verification
    against the LLM keeps the output exact whatever they compute in. `ssm_dtype` "auto" (None:
    the LLM's `dtype`) measures which is fastest here (`dtype_choice`), cached under `cache_dir`
    and told to `report` (default: logged) on one line per SSM. With a tensor-parallel
    `parallel` (a `ParallelConfig`) the LLM is sharded over its ranks; `engine.verifier.runner.close()`
    stops them."""
    from dataclasses import replace

    from specinfer.engine.runtime.backend import resolve_exec
    from specinfer.engine.runtime.exec_config import ExecConfig
    from specinfer.engine.runtime.dtype_choice import load_ssm
    from specinfer.engine.llm_engine import Engine, EngineConfig
    device = resolve_device(device)
    exec_cfg = exec_cfg or ExecConfig()
    is_parallel = parallel is not None and parallel.is_parallel
    resolve_exec(exec_cfg, device, is_parallel)  # a flag that cannot apply fails before any weights load
    from specinfer.engine.models.checkpoint import safetensors_files
    from specinfer.model_source import resolve

    source = resolve(paths.llm)
    if not source.is_gguf:  # no weights (or pickle only) is a one-line error, before any line of progress
        safetensors_files(source.path)
    tell = report or log.info
    tell(f"loading the LLM {paths.llm} ({dtype} on {device})")
    started = time.perf_counter()
    llm = load_runner(paths.llm, dtype=dtype, device=device, max_kv_tokens=max_kv_tokens, parallel=parallel,
                      exec_cfg=exec_cfg)
    from specinfer.engine.drafting.speculator import model_free_member

    ssm_exec = replace(exec_cfg, offload=False)
    ssms = [load_ssm(p, ssm_dtype or dtype, device, max_kv_tokens, ssm_exec, prefer=dtype, cache_dir=cache_dir,
                     report=report)
            for p in paths.ssms]
    per_token = sum(2 * r.kv.k[:, 0].numel() * r.kv.k.element_size() for r in [llm, *ssms])
    tell(f"models loaded in {time.perf_counter() - started:.1f}s; "
         f"{KvPlan(llm.kv.num_slots, per_token, kv_reason).describe()}")
    return Engine.from_runners(llm, ssms, cfg or EngineConfig(),
                               model_free=[model_free_member(n) for n in paths.model_free],
                               grammars=load_grammars(paths.llm, llm.cfg))


def load_grammars(model_dir: Path, llm_cfg: ModelConfig):
    """Structured output over the LLM's tokenizer (a `grammar.GrammarCompiler`); None where the
    model has no tokenizer or no EOS token (an output could not end where its grammar does), or
    where its tokenizer does not fit its vocabulary: then a request with a constraint is
    refused, and every other request runs as before."""
    from specinfer.engine.verification.grammar import GrammarCompiler

    if resolve(model_dir).tokenizer_file is None or not llm_cfg.eos_token_ids:
        return None
    try:
        return GrammarCompiler(model_dir, llm_cfg.vocab_size, llm_cfg.eos_token_ids)
    except ValueError as exc:
        log.warning("structured output is off for %s: %s", model_dir, exc)
        return None


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
