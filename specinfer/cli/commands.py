"""Implementations of `specinfer generate` and `specinfer demo-models`, and the model and prompt
loading that the commands share."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specinfer.engine.runtime.load import (
    ModelPaths, check_context, check_models, encode_prompts, load_tokenizer, read_prompts, split_pool,
)
from specinfer.errors import UserError
from specinfer.limits import CALIBRATION_TOKENS, DEFAULT_IS_PREFIX_CACHING, parse_tree_width
from specinfer.model_source import resolve
from specinfer.pool.demo_pretrained import ensure_pretrained_demo
from specinfer.engine.runtime.exec_config import ExecConfig
from specinfer.params import TreeShape
from specinfer.cli.request_flags import constraint_from_flags, sampling_from_flags


def is_no_pool(ssm_args) -> bool:
    """Whether `--ssm none` asked for no pool at all."""
    return [str(e) for e in ssm_args] == ["none"]


def resolve_paths(
    args: argparse.Namespace, cache_dir: Path, ssm_needed_by: str = "", is_draft_awaited: bool = True,
) -> tuple[ModelPaths, Path | None]:
    """The models from the flags (checkpoint directories or GGUF files), or the demo models
    (fetched and their draft built on first use; without `is_draft_awaited` the draft is built in
    the background and left out until it is ready).

    Returns the paths and, for the demo models, their held-out prompts file. With
    `ssm_needed_by` (what needs them, e.g. "the stack"), no SSM at all is a `UserError`.
    """
    ssm_dirs, model_free = split_pool(args.ssm, getattr(args, "model_free", True))
    is_none = is_no_pool(args.ssm)
    if args.llm is None:
        if ssm_dirs:
            raise UserError("--ssm given without --llm")
        demo = ensure_pretrained_demo(cache_dir, progress=True, is_draft_awaited=is_draft_awaited)
        paths = ModelPaths(demo.llm, () if is_none else tuple(demo.ssms), model_free)
        demo_prompts = demo.prompts
    else:
        paths, demo_prompts = ModelPaths(args.llm, ssm_dirs, model_free), None
    if ssm_needed_by and not paths.ssms and not paths.model_free:
        raise UserError(f"{ssm_needed_by} needs at least one --ssm")
    for model in (paths.llm, *paths.ssms):  # a GGUF's metadata files under --cache-dir; a bad path fails here
        resolve(model, cache_dir)
    return paths, demo_prompts


def bench_prompts(args: argparse.Namespace, demo_prompts: Path | None, llm: Path) -> list[str]:
    """The prompts of `--prompts`, else the demo models' held-out prompts."""
    path = args.prompts or demo_prompts
    if path is None:
        raise UserError("--prompts is required with --llm")
    return prompt_texts(path, llm)


def prompt_texts(path: Path, llm: Path) -> list[str]:
    """A prompts file's prompts as text: {"prompt": ...} lines as they are, {"messages": [...]}
    lines rendered with the LLM's chat template (as the gateway renders a chat request)."""
    prompts = read_prompts(path, allow_messages=True)
    if all(isinstance(p, str) for p in prompts):
        return prompts
    from specinfer.chat_template import ChatRenderer, ChatTemplate  # jinja2 and numpy: not at CLI start-up

    renderer = ChatRenderer(ChatTemplate.from_dir(llm))
    return [p if isinstance(p, str) else renderer.render(p) for p in prompts]


def load_for_prompts(args: argparse.Namespace, paths: ModelPaths, prompts: list[str], cache_dir: Path | None = None):
    """Checks models and prompts before any weights load (configs, vocabularies, every prompt
    plus `--max-new-tokens` within the context), then loads the engine with a KV cache for the
    longest prompt, its new tokens and one token tree per SSM, and the tree flags as the shape of
    `auto` mode, and calibrates the load-aware policy where `auto` mode will use it. What is
    measured (the SSMs' dtype, the LLM's cost model) is cached under `cache_dir`; every step of
    the start-up is told on stderr. Returns (tokenizer, prompt ids, engine)."""
    from specinfer.engine.llm_engine import EngineConfig  # torch: as in resolve_paths
    from specinfer.engine.runtime.assemble import load_engine  # torch: as in resolve_paths
    from specinfer.engine.scheduling.scheduler import SchedulerConfig  # torch: as in resolve_paths

    llm_cfg, ssm_cfgs = check_models(paths)
    tokenizer = load_tokenizer(paths, llm_cfg)
    prompt_ids = encode_prompts(tokenizer, prompts)
    needed = check_context(llm_cfg, ssm_cfgs, prompt_ids, args.max_new_tokens)
    # A request reserves one tree per SSM it speculates with (their merged tree is at most that);
    # `bench --samples N` runs N requests at once.
    per_request = needed + args.max_tree_nodes * (len(paths.ssms) + len(paths.model_free)) + 64
    is_load_aware = getattr(args, "mode", None) in (None, "auto") and bool(paths.ssms or paths.model_free)
    num_tokens = per_request * max(1, getattr(args, "samples", 1))
    if is_load_aware:  # room for the calibration's passes: one calibration fits every prompt
        num_tokens = max(num_tokens, CALIBRATION_TOKENS)
    report = lambda line: print(f"specinfer: {line}", file=sys.stderr, flush=True)  # noqa: E731
    engine = load_engine(paths, args.dtype, args.device, max_kv_tokens=num_tokens,
                         ssm_dtype=args.ssm_dtype, cfg=EngineConfig(
                             default_shape=tree_shape(args), scheduler=SchedulerConfig(
                                 admission_timeout_s=0.0, is_prefix_caching=getattr(args, "prefix_caching", DEFAULT_IS_PREFIX_CACHING))),
                         parallel=tensor_parallel(args), exec_cfg=exec_config(args),
                         cache_dir=cache_dir, report=report, kv_reason="what the longest prompt, its new tokens and "
                                                                       "its trees need")
    if is_load_aware:  # each step's tree priced by the LLM's measured costs
        engine.calibrate(cache_dir, report)
    return tokenizer, prompt_ids, engine


def exec_config(args: argparse.Namespace):
    """`--attention`, `--cuda-graphs` and `--offload` as the engine's `ExecConfig`."""
    return ExecConfig(attention=getattr(args, "attention", "auto"), cuda_graphs=getattr(args, "cuda_graphs", None),
                      offload=getattr(args, "offload", False))


def tensor_parallel(args: argparse.Namespace):
    """`--tensor-parallel N`: a group of N ranks on this host whose rank 0 is this process."""
    from specinfer.engine.runtime.parallel import ParallelConfig  # torch: as in resolve_paths

    num_ranks = getattr(args, "tensor_parallel", 1)
    if num_ranks < 1:
        raise UserError(f"--tensor-parallel must be >= 1, got {num_ranks}")
    return ParallelConfig.spawned(num_ranks) if num_ranks > 1 else None


def tree_shape(args: argparse.Namespace):
    """The token tree shape of `--tree-width`, `--max-tree-nodes`, `--tree-sampling` and
    `--min-path-prob`: what `tree` mode expands, and what bounds `auto` mode's choices."""
    widths = parse_tree_width(args.tree_width)
    if args.max_tree_nodes < 1:
        raise UserError(f"--max-tree-nodes must be >= 1, got {args.max_tree_nodes}")
    if not 0.0 <= args.min_path_prob < 1.0:
        raise UserError(f"--min-path-prob must be in [0, 1), got {args.min_path_prob}")
    return TreeShape(widths, max_nodes=args.max_tree_nodes,
                     is_sampled=getattr(args, "tree_sampling", "sampled") == "sampled",
                     min_path_prob=args.min_path_prob)


def generation_params(args: argparse.Namespace, has_ssm: bool, mode: str | None, sampling, constraint=None):
    """The request parameters of the mode flags (`--mode`, else auto with a pool and incremental
    without), with `constraint` (structured output, or None). Returns (mode, params)."""
    from specinfer.engine.llm_engine import mode_params  # torch: as in resolve_paths

    shape = tree_shape(args)
    mode = mode or ("auto" if has_ssm else "incremental")
    if mode != "incremental" and not has_ssm:
        raise UserError(f"--mode {mode} needs at least one --ssm")
    return mode, mode_params(mode, args.max_new_tokens, shape, sampling, constraint=constraint)


def run_generate(args: argparse.Namespace, cache_dir: Path) -> int:
    # the same SamplingParams and Constraint `specinfer client generate` sends, checked before any model loads
    params = sampling_from_flags(args, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 seed=args.seed)
    constraint = constraint_from_flags(args)
    if args.prompt is not None:
        prompts = [args.prompt]
    else:
        read_prompts(args.prompts, allow_messages=True)  # malformed: fails before any model is built or loaded
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    parse_tree_width(args.tree_width)  # fail fast, before any model is built or loaded
    paths, _ = resolve_paths(args, cache_dir)
    if args.prompt is None:
        prompts = prompt_texts(args.prompts, paths.llm)
    mode, gen_params = generation_params(args, bool(paths.ssms or paths.model_free), args.mode, params, constraint)
    tokenizer, prompt_ids, engine = load_for_prompts(args, paths, prompts, cache_dir)
    out = open(args.output, "w") if args.output else sys.stdout
    try:
        for text, ids in zip(prompts, prompt_ids):
            r = engine.generate(ids, gen_params)
            record = {
                "prompt": text,
                "text": tokenizer.decode(r.output_ids),
                "output_token_ids": r.output_ids,
                "num_llm_steps": r.num_llm_steps,
                "tokens_per_step": round(r.tokens_per_step, 4),
                "latency_s": round(r.latency_s, 6),
                "mode": mode,
                "finish_reason": r.finish_reason,
                "mean_accepted": round(sum(r.accepted_per_step) / max(1, r.num_llm_steps), 4),
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
        engine.verifier.runner.close()
    return 0


def run_demo_models(args: argparse.Namespace, cache_dir: Path) -> int:
    """The demo models: SmolLM2-135M-Instruct and its draft; with --tiny, the small pair trained
    here from Python's standard library, which needs no download (tests, the compose smoke)."""
    if args.tiny:
        from specinfer.pool.demo_models import DemoBudget, ensure_demo_models  # torch: this module also serves `specinfer up`

        demo = ensure_demo_models(cache_dir / "tiny", budget=DemoBudget.tiny(), progress=True, force=args.force)
    else:
        demo = ensure_pretrained_demo(cache_dir, progress=True, force=args.force, is_background=args.background)
    print(json.dumps({"llm": str(demo.llm), "ssms": [str(s) for s in demo.ssms], "prompts": str(demo.prompts)}))
    return 0
