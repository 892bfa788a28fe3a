"""The `specinfer` command line: generate, bench, demo-models (and the service commands).

Bad input prints one line naming the problem and exits with code 2, with no traceback.
Configuration is read here, in `main()`, from flags and environment variables, and passed down.
"""

from __future__ import annotations

import argparse
import sys

from specinfer.cli.request_flags import add_request_flags
from specinfer.engine.runtime.cpu import configure_cpu_runtime
from specinfer.errors import UserError
from specinfer.serving.shared_flags import (
    add_declared, add_exclusive, bench_arm_flags, bench_flags, demo_models_flags, generate_flags,
    generate_request_flags, model_flags, output_flag, prompt_flag, prompts_flag, resolve_declared, spec_flags,
)
from specinfer.cli.client import add_client_parser, run_client
from specinfer.cli.launcher import add_up_parser, run_up
from specinfer.pool.commands import add_pool_parsers, run_pool_command
from specinfer.util import default_cache_dir


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2
        raise UserError(f"{self.prog}: {message}")

    def parse_args(self, args=None, namespace=None):
        """The declared options resolved too: each flag, else its variable, else its default."""
        return resolve_declared(super().parse_args(args, namespace))


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, composed of the options `specinfer.serving.shared_flags` declares."""
    parser = _Parser(prog="specinfer", description="Tree-based speculative inference (SpecInfer).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from one prompt or a JSONL file of prompts")
    add_declared(g, *model_flags())
    add_exclusive(g, prompt_flag(), prompts_flag(), is_required=True)
    add_declared(g, *generate_flags(), *spec_flags(), *generate_request_flags())
    add_request_flags(g)
    add_declared(g, output_flag("generate"))

    b = sub.add_parser("bench", help="compare incremental, sequence, tree and transformers' assisted generation")
    add_declared(b, *model_flags(), *bench_flags())
    add_request_flags(b)
    add_declared(b, *bench_arm_flags())

    add_up_parser(sub)
    add_client_parser(sub)
    add_pool_parsers(sub)

    d = sub.add_parser("demo-models", help="fetch the demo LLM (SmolLM2-135M-Instruct) and build its draft, "
                                           "or find them cached")
    add_declared(d, *demo_models_flags())
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_cpu_runtime()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        cache_dir = default_cache_dir(getattr(args, "cache_dir", None))
        if args.command in ("generate", "demo-models"):
            from specinfer.cli.commands import run_demo_models, run_generate  # torch: not at start-up

            return (run_generate if args.command == "generate" else run_demo_models)(args, cache_dir)
        if args.command == "bench":
            import specinfer.cli.bench, specinfer.cli.bench_prefix, specinfer.cli.bench_serving  # noqa: E401 (torch)

            bench, prefix, serving = specinfer.cli.bench, specinfer.cli.bench_prefix, specinfer.cli.bench_serving
            if args.shared_prefix_tokens:
                run = prefix.run_serving_prefix_bench if args.concurrency else prefix.run_prefix_bench
            else:
                run = serving.run_serving_bench if args.concurrency else bench.run_bench
            return run(args, cache_dir)
        if args.command == "up":
            return run_up(args, cache_dir)
        if args.command in ("make-ssm", "boost-tune", "make-draft"):
            return run_pool_command(args)
        if args.command == "client":
            return run_client(args)
        raise UserError(f"unknown command {args.command!r}")
    except UserError as exc:
        print(f"specinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specinfer: interrupted", file=sys.stderr)
        return 130

