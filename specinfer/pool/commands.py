"""Command-line entry points of the SSM pool (SpecInfer Section 3): `make-ssm`, `boost-tune` and
`make-draft`.

`specinfer make-ssm` cuts an SSM from the LLM's own layers (`specinfer.pool.make_ssm`);
`specinfer make-draft` cuts one and distills it from the LLM within a time budget
(`specinfer.pool.make_draft`);
`specinfer boost-tune` aligns a pool of SSMs with the LLM by collective boost-tuning
(`specinfer.pool.boost_tune`). The pool is then served merged (`Speculator.propose`), with the
"merge" or "mixed" tree policy (`TreeShape.policy`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specinfer.pool.tuning_config import DataConfig, DraftConfig, TrainConfig


def add_pool_parsers(subparsers) -> None:
    """Adds the `make-ssm`, `boost-tune` and `make-draft` subcommands to the CLI's subparsers (torch-free: every
    command builds this parser, `specinfer up`'s long-lived supervisor and `client` among them)."""
    add_make_ssm_parser(subparsers)
    add_boost_tune_parser(subparsers)
    add_make_draft_parser(subparsers)


def add_make_ssm_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("make-ssm", help="cut an SSM from the LLM's own layers (optionally pruned)")
    p.add_argument("--from-llm", type=Path, required=True, help="LLM checkpoint directory or .gguf file")
    p.add_argument("--layers", required=True,
                   help="N = the first N layers, or indices like 0,1,7 or 0-2,7 (kept in ascending order)")
    p.add_argument("--mlp-keep", type=float, default=1.0,
                   help="fraction of MLP channels to keep per layer, by weight magnitude (default 1.0)")
    p.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def add_boost_tune_parser(subparsers) -> argparse.ArgumentParser:
    d, t = DataConfig(), TrainConfig()
    p = subparsers.add_parser("boost-tune", help="collective boost-tuning of an SSM pool on the LLM's own outputs")
    p.add_argument("--llm", type=Path, required=True, help="LLM checkpoint directory or .gguf file")
    p.add_argument("--ssm", type=Path, action="append", required=True,
                   help="SSM checkpoint directory or .gguf file (repeatable; pool order: SSM 1 first); the tuned "
                        "SSMs are written as checkpoint directories")
    p.add_argument("--corpus", type=Path, nargs="+", required=True, help="text files, or directories (their *.py)")
    p.add_argument("--exclude", type=Path, nargs="*", default=[], help="corpus files to leave out")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="training prompts")
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts, help="held-out prompts for the summary")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="longest prompt (shortest: half)")
    p.add_argument("--continuation-tokens", type=int, default=d.continuation_tokens)
    p.add_argument("--sampled-fraction", type=float, default=d.sampled_fraction,
                   help="fraction of prompts continued by sampling instead of greedily")
    p.add_argument("--temperature", type=float, default=d.temperature, help="for the sampled continuations")
    p.add_argument("--steps", type=int, default=t.steps, help="optimizer steps per SSM")
    p.add_argument("--batch-size", type=int, default=t.batch_size)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--kl-weight", type=float, default=t.kl_weight, help="weight of the KL term (0 = none)")
    p.add_argument("--kl-top-k", type=int, default=32, help="LLM probabilities kept per position for the KL term")
    p.add_argument("--warmup-steps", type=int, default=t.warmup_steps, help="linear warmup, then cosine decay")
    p.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p

def add_make_draft_parser(subparsers) -> argparse.ArgumentParser:
    d = DraftConfig()
    p = subparsers.add_parser("make-draft", help="build a draft (SSM) for an LLM: cut from its layers and distilled "
                                                 "on its own answers, within a time budget")
    p.add_argument("--llm", type=Path, required=True, help="LLM checkpoint directory or .gguf file")
    p.add_argument("--out", type=Path, required=True, help="the draft's checkpoint directory (then: --ssm OUT)")
    p.add_argument("--minutes", type=float, default=d.minutes,
                   help=f"time budget of the whole build (default {d.minutes:g}); an interrupted build resumes "
                        "where it stopped when run again")
    p.add_argument("--corpus", type=Path,
                   help="a text file to draw prompts from (default: the built-in chat prompts, in the LLM's chat "
                        "template)")
    p.add_argument("--layers", default=d.layers,
                   help=f"the LLM layers the draft keeps: N = the first N, or indices like 0,1,29 (default {d.layers})")
    p.add_argument("--mlp-keep", type=float, default=d.mlp_keep, help="fraction of MLP channels kept per layer")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--cache-dir", type=Path, help="where a GGUF's metadata files are made and reused")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress")
    return p


def run_pool_command(args: argparse.Namespace) -> int:
    """Runs `make-ssm`, `boost-tune` or `make-draft` (by `args.command`)."""
    if args.command == "make-ssm":
        from specinfer.pool.make_ssm import run_make_ssm

        return run_make_ssm(args)
    if args.command == "make-draft":
        from specinfer.pool.make_draft import run_make_draft

        return run_make_draft(args)
    from specinfer.pool.boost_tune import run_boost_tune

    return run_boost_tune(args)
