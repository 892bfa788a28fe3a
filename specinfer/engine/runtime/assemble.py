"""Loading: checkpoints in, ready model runners and an in-process engine out (SpecInfer's LLM and
SSMs, Section 2), sharded over tensor-parallel ranks where asked.

The light half of the wiring (paths, checks, tokenizers, prompts) is `load`; this module loads
torch and the models.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from safetensors.torch import load_file

from specinfer.engine.drafting.speculator import model_free_member
from specinfer.engine.llm_engine import Engine, EngineConfig
from specinfer.engine.models.checkpoint import parse_dtype, safetensors_files
from specinfer.engine.models.config import DRAFT_ANSWERS_FILE, ModelConfig
from specinfer.engine.models.transformer import KVCache
from specinfer.engine.runtime.backend import resolve_exec
from specinfer.engine.runtime.dtype_choice import load_ssm
from specinfer.engine.runtime.exec_config import ExecConfig
from specinfer.engine.runtime.load import ModelPaths, resolve_device
from specinfer.engine.runtime.memory import KvPlan
from specinfer.engine.runtime.parallel import LeaderKV, LeaderModel, ShardSpec, check_divisible, start_group
from specinfer.engine.runtime.runner import DEFAULT_BLOCK_SIZE, ModelRunner
from specinfer.engine.verification.grammar import GrammarCompiler
from specinfer.errors import UserError
from specinfer.limits import DEFAULT_DTYPE, DEFAULT_RUNNER_KV_TOKENS, SUFFIX_CACHE_TOKENS, SUFFIX_SEED_TOKENS
from specinfer.model_source import resolve

log = logging.getLogger(__name__)


def load_runner(model_dir: str | Path, dtype: str = DEFAULT_DTYPE, device: str = "cpu",
                max_kv_tokens: int = DEFAULT_RUNNER_KV_TOKENS, block_size: int | None = None, parallel=None, exec_cfg=None):
    """A `ModelRunner` for a checkpoint; with a tensor-parallel `parallel` (a `ParallelConfig`),
    this process is rank 0 of the group (its other ranks spawned here unless a launcher started
    them) and `runner.close()` stops them. `exec_cfg` (an `ExecConfig`) picks the attention
    backend, CUDA graphs and offloading."""
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
    model, leader = start_group(spec, pc)
    kv = KVCache.allocate(model.cfg, spec.num_slots, model.dtype, model.device)
    return ModelRunner(LeaderModel(model, leader), num_blocks=spec.num_slots // block_size, block_size=block_size,
                       kv=LeaderKV(kv.k, kv.v, leader))


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
    device = resolve_device(device)
    exec_cfg = exec_cfg or ExecConfig()
    is_parallel = parallel is not None and parallel.is_parallel
    resolve_exec(exec_cfg, device, is_parallel)  # a flag that cannot apply fails before any weights load

    source = resolve(paths.llm)
    if not source.is_gguf:  # no weights (or pickle only) is a one-line error, before any line of progress
        safetensors_files(source.path)
    tell = report or log.info
    tell(f"loading the LLM {paths.llm} ({dtype} on {device})")
    started = time.perf_counter()
    llm = load_runner(paths.llm, dtype=dtype, device=device, max_kv_tokens=max_kv_tokens, parallel=parallel,
                      exec_cfg=exec_cfg)

    ssm_exec = replace(exec_cfg, offload=False)
    ssms = [load_ssm(p, ssm_dtype or dtype, device, max_kv_tokens, ssm_exec, prefer=dtype, cache_dir=cache_dir,
                     report=report)
            for p in paths.ssms]
    per_token = sum(2 * r.kv.k[:, 0].numel() * r.kv.k.element_size() for r in [llm, *ssms])
    tell(f"models loaded in {time.perf_counter() - started:.1f}s; "
         f"{KvPlan(llm.kv.num_slots, per_token, kv_reason).describe()}")
    return Engine.from_runners(llm, ssms, cfg or EngineConfig(),
                               model_free=model_free_members(paths.model_free, paths.ssms),
                               grammars=load_grammars(paths.llm, llm.cfg))


def model_free_members(names, ssm_paths, cache_tokens: int = SUFFIX_CACHE_TOKENS) -> list:
    """The model-free pool members called `names`; the suffix member also drafts from the answers
    the pool's drafts were built from (`draft_answers`)."""
    answers = draft_answers(ssm_paths) if "suffix" in names else []
    if answers:
        log.info("the suffix drafts read %d stored answers (%d tokens) of %s", len(answers),
                 sum(map(len, answers)), ", ".join(str(p) for p in ssm_paths))
    return [model_free_member(n, cache_tokens, answers) for n in names]


def draft_answers(ssm_paths, max_tokens: int = SUFFIX_SEED_TOKENS) -> list[list[int]]:
    """The LLM's answers stored with drafts built by `make-draft` (`DRAFT_ANSWERS_FILE` in their
    directories), up to `max_tokens` tokens in all, in order. A draft without them adds none."""
    out, total = [], 0
    for path in ssm_paths:
        file = Path(path) / DRAFT_ANSWERS_FILE
        if not file.is_file():
            continue
        try:
            tensors = load_file(str(file))
            tokens, lengths = tensors["tokens"].tolist(), tensors["lengths"].tolist()
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same error
            raise UserError(f"{file}: not a readable answers file ({exc})") from exc
        if sum(lengths) != len(tokens) or min(lengths, default=0) < 0:
            raise UserError(f"{file}: its lengths do not add up to its tokens")
        start = 0
        for n in lengths:
            if total + n > max_tokens:
                return out
            out.append(tokens[start:start + n])
            start, total = start + n, total + n
    return out


def load_grammars(model_dir: Path, llm_cfg: ModelConfig):
    """Structured output over the LLM's tokenizer (a `grammar.GrammarCompiler`); None where the
    model has no tokenizer or no EOS token (an output could not end where its grammar does), or
    where its tokenizer does not fit its vocabulary: then a request with a constraint is
    refused, and every other request runs as before."""
    if resolve(model_dir).tokenizer_file is None or not llm_cfg.eos_token_ids:
        return None
    try:
        return GrammarCompiler(model_dir, llm_cfg.vocab_size, llm_cfg.eos_token_ids)
    except ValueError as exc:
        log.warning("structured output is off for %s: %s", model_dir, exc)
        return None
