"""Command-line entry points of the SSM pool (SpecInfer Section 3): `make-ssm` and `boost-tune`.

`specinfer make-ssm` cuts an SSM from the LLM's own layers (`specinfer.pool.make_ssm`);
`specinfer boost-tune` aligns a pool of SSMs with the LLM by collective boost-tuning
(`specinfer.pool.boost_tune`). The pool is then served merged (`Speculator.propose`), with the
"merge" or "mixed" tree policy (`TreeShape.policy`).
"""

from __future__ import annotations

import argparse

def add_pool_parsers(subparsers) -> None:
    """Adds the `make-ssm` and `boost-tune` subcommands to the CLI's subparsers."""
    from specinfer.pool.boost_tune import add_boost_tune_parser
    from specinfer.pool.make_ssm import add_make_ssm_parser

    add_make_ssm_parser(subparsers)
    add_boost_tune_parser(subparsers)


def run_pool_command(args: argparse.Namespace) -> int:
    """Runs `make-ssm` or `boost-tune` (by `args.command`)."""
    if args.command == "make-ssm":
        from specinfer.pool.make_ssm import run_make_ssm

        return run_make_ssm(args)
    from specinfer.pool.boost_tune import run_boost_tune

    return run_boost_tune(args)
