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

from specinfer.limits import BOOST_KL_TOP_K, DEFAULT_MLP_KEEP
from specinfer.pool.tuning_config import DataConfig, DraftConfig, TrainConfig
from specinfer.serving.settings import Flag, add_declared, parse_bool
from specinfer.serving.shared_flags import (
    NONE, cache_dir_flag, device_flag, llm_flag, num_prompts_flag, out_flag, quiet_flag, seed_flag, ssm_flag,
    temperature_flag,
)


def add_pool_parsers(subparsers) -> None:
    """Adds the `make-ssm`, `boost-tune` and `make-draft` subcommands to the CLI's subparsers (torch-free: every
    command builds this parser, `specinfer up`'s long-lived supervisor and `client` among them)."""
    add_make_ssm_parser(subparsers)
    add_boost_tune_parser(subparsers)
    add_make_draft_parser(subparsers)


def add_make_ssm_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("make-ssm", help="cut an SSM from the LLM's own layers (optionally pruned)")
    add_declared(p, *make_ssm_flags())
    return p


def make_ssm_flags() -> list[Flag]:
    return [
        Flag("--from-llm", NONE, Path, None, "LLM checkpoint directory or .gguf file", is_required=True),
        layers_flag("make-ssm"), mlp_keep_flag(), out_flag("make-ssm"), overwrite_flag(),
    ]


def add_boost_tune_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("boost-tune", help="collective boost-tuning of an SSM pool on the LLM's own outputs")
    add_declared(p, *boost_tune_flags())
    return p

def add_make_draft_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("make-draft", help="build a draft (SSM) for an LLM: cut from its layers and distilled "
                                                 "on its own answers, within a time budget")
    add_declared(p, *make_draft_flags())
    return p


def make_draft_flags() -> list[Flag]:
    """`make-draft`'s options; the defaults are `DraftConfig`'s."""
    d = DraftConfig()
    return [
        llm_flag("make-draft"), out_flag("make-draft"),
        Flag("--minutes", NONE, float, d.minutes, f"time budget of the whole build (default {d.minutes:g}); an "
             "interrupted build resumes where it stopped when run again"),
        corpus_flag("make-draft"), layers_flag("make-draft", d.layers), mlp_keep_flag(d.mlp_keep),
        Flag("--vocab", NONE, int, d.vocab, f"tokens the draft's LM head scores, the LLM's most frequent answer "
             f"tokens (default {d.vocab}; 0 = every token): a smaller head makes each draft pass cheaper"),
        seed_flag("make-draft"), cache_dir_flag("service"), overwrite_flag(), quiet_flag("make-draft"),
    ]


def layers_flag(of: str, default: str | None = None) -> Flag:
    help_text = {"make-ssm": "N = the first N layers, or indices like 0,1,7 or 0-2,7 (kept in ascending order)",
                 "make-draft": f"the LLM layers the draft keeps: N = the first N, or indices like 0,1,29 "
                               f"(default {default})"}[of]
    return Flag("--layers", NONE, str, default, help_text, is_required=of == "make-ssm")


def mlp_keep_flag(default: float = DEFAULT_MLP_KEEP) -> Flag:
    return Flag("--mlp-keep", NONE, float, default,
                f"fraction of MLP channels to keep per layer, by weight magnitude (default {default})")


def overwrite_flag() -> Flag:
    return Flag("--overwrite", NONE, parse_bool, False, "replace a non-empty --out", is_toggle=True)


def corpus_flag(of: str) -> Flag:
    is_boost = of == "boost-tune"
    help_text = ("text files, or directories (their *.py)" if is_boost else
                 "a text file to draw prompts from (default: the built-in chat prompts, in the LLM's chat template)")
    return Flag("--corpus", NONE, Path, None, help_text, nargs="+" if is_boost else None, is_required=is_boost)


def boost_tune_flags() -> list[Flag]:
    """`boost-tune`'s options; the training's defaults are `DataConfig`'s and `TrainConfig`'s."""
    d, t = DataConfig(), TrainConfig()
    return [
        llm_flag("boost-tune"), ssm_flag("boost-tune"),
        corpus_flag("boost-tune"),
        Flag("--exclude", NONE, Path, [], "corpus files to leave out", nargs="*"),
        out_flag("boost-tune"),
        num_prompts_flag("boost-tune", d.num_prompts),
        Flag("--eval-prompts", NONE, int, d.eval_prompts, "held-out prompts for the summary"),
        Flag("--prompt-tokens", NONE, int, d.prompt_tokens, "longest prompt (shortest: half)"),
        Flag("--continuation-tokens", NONE, int, d.continuation_tokens, ""),
        Flag("--sampled-fraction", NONE, float, d.sampled_fraction,
             "fraction of prompts continued by sampling instead of greedily"),
        temperature_flag("boost-tune", d.temperature),
        Flag("--steps", NONE, int, t.steps, "optimizer steps per SSM"),
        Flag("--batch-size", NONE, int, t.batch_size, ""),
        Flag("--lr", NONE, float, t.lr, ""),
        Flag("--kl-weight", NONE, float, t.kl_weight, "weight of the KL term (0 = none)"),
        Flag("--kl-top-k", NONE, int, BOOST_KL_TOP_K, "LLM probabilities kept per position for the KL term"),
        Flag("--warmup-steps", NONE, int, t.warmup_steps, "linear warmup, then cosine decay"),
        Flag("--checkpoint-every", NONE, int, t.checkpoint_every, ""),
        seed_flag("boost-tune"), device_flag(),
        Flag("--resume", NONE, parse_bool, False, "continue an interrupted run in --out", is_toggle=True),
        quiet_flag("boost-tune"),
    ]


def run_pool_command(args: argparse.Namespace) -> int:
    """Runs `make-ssm`, `boost-tune` or `make-draft` (by `args.command`)."""
    from specinfer.pool import boost_tune, make_draft, make_ssm  # torch: not at CLI start-up

    run = {"make-ssm": make_ssm.run_make_ssm, "make-draft": make_draft.run_make_draft,
           "boost-tune": boost_tune.run_boost_tune}[args.command]
    return run(args)
