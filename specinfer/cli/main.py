"""The `specinfer` command line: generate, bench, demo-models (and the service commands).

Bad input prints one line naming the problem and exits with code 2, with no traceback.
Configuration is read here, in `main()`, from flags and environment variables, and passed down.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specinfer.cli.flags import add_dtype_flags, add_exec_flags, add_kv_flags, add_model_free_flag, add_prefix_caching_flag
from specinfer.cli.request_flags import add_constraint_flags, add_processor_flags
from specinfer.serving.shared_flags import resolve_declared
from specinfer.engine.runtime.cpu import configure_cpu_runtime
from specinfer.errors import UserError
from specinfer.limits import DEFAULT_MAX_TREE_NODES, PAPER_TREE_WIDTH
from specinfer.util import default_cache_dir


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2
        raise UserError(f"{self.prog}: {message}")

    def parse_args(self, args=None, namespace=None):
        """The shared settings resolved too: each flag, else its variable, else its default."""
        return resolve_declared(super().parse_args(args, namespace))


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", type=Path,
                   help="LLM checkpoint directory or .gguf file (default: the built-in demo models)")
    p.add_argument("--ssm", type=Path, action="append", default=[],
                   help="SSM checkpoint directory or .gguf file, or a model-free speculator: lookup (n-grams of the "
                        "request's own context) or suffix (its context and recent outputs); repeatable. Both "
                        "model-free members join the pool unless one is named or --no-model-free is given; none: "
                        "no pool")
    add_model_free_flag(p)
    add_dtype_flags(p)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--cache-dir", type=Path, help="where demo models are built and cached, and the SSMs' measured dtype")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the LLM over N processes on this host (GPUs with NCCL, else CPU with gloo)")
    add_exec_flags(p)


def _add_spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree-width", default=",".join(map(str, PAPER_TREE_WIDTH)),
                   help="the static expansion of tree and sequence modes: children per level, e.g. 1,1,3,1 "
                        "(default: the paper's)")
    p.add_argument("--max-tree-nodes", type=int, default=DEFAULT_MAX_TREE_NODES, help="cap on a static tree's nodes per step")
    p.add_argument("--min-path-prob", type=float, default=0.0,
                   help="prune tree branches whose SSM path probability is below this (0 = off)")
    add_prefix_caching_flag(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specinfer", description="Tree-based speculative inference (SpecInfer).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from one prompt or a JSONL file of prompts")
    _add_model_flags(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", type=Path, help='JSONL file with one {"prompt": "..."} or {"messages": [...]} '
                                                 "(rendered with the model's chat template) per line")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--mode", choices=["incremental", "sequence", "tree", "auto"],
                   help="default: auto with a pool, else incremental. auto: dynamic trees, each step's grown from the "
                        "drafts' calibrated chances of acceptance and sized by the load-aware policy (or none where "
                        "speculation does not pay); tree: the static expansion --tree-width; sequence: a chain")
    _add_spec_flags(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--tree-sampling", choices=["sampled", "topk"], default="sampled",
                   help="how stochastic mode picks tree children: coupled with the LLM's sample, or the SSM's top-k")
    add_processor_flags(g)
    add_constraint_flags(g)
    g.add_argument("--output", type=Path, help="write JSONL results here (default: stdout)")

    b = sub.add_parser("bench", help="compare incremental, sequence, tree and transformers' assisted generation")
    _add_model_flags(b)
    b.add_argument("--prompts", type=Path, help='JSONL of {"prompt": "..."} or {"messages": [...]} lines (rendered '
                                            "with the model's chat template; default: the demo models' held-out "
                                            "prompts)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    _add_spec_flags(b)
    b.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    b.add_argument("--no-transformers", action="store_true", help="skip transformers' assisted generation")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="in process: sample every arm at this temperature (seeded per prompt; transformers' arms are "
                        "left out); 0 = greedy (default)")
    add_processor_flags(b)
    add_constraint_flags(b)
    b.add_argument("--logprobs", type=int, help="add a tree arm that returns logprobs with this many alternatives")
    b.add_argument("--samples", type=int, default=1,
                   help="N > 1 adds two tree arms of N samples per prompt: sharing the prompt's KV, and not")
    b.add_argument("--output", type=Path, help="also write the JSON result here")
    b.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="benchmark prefix caching instead: every prompt starts with one shared prefix of about this "
                        "many tokens; in process, time to first token cold against cached, and throughput with "
                        "caching on against off; with --concurrency, through the stack: how often the gateway "
                        "sends a request where its prefix is cached")
    b.add_argument("--num-verifiers", type=int, default=1,
                   help="with --shared-prefix-tokens and --concurrency: verifier processes the gateway routes between")
    b.add_argument("--prefix-groups", type=int, default=2,
                   help="with --shared-prefix-tokens and --concurrency: distinct shared prefixes, their requests "
                        "interleaved")
    b.add_argument("--concurrency-in-process", type=int, default=16,
                   help="with --shared-prefix-tokens: requests that arrive together in the throughput arms")
    b.add_argument("--rounds-in-process", type=int, default=3,
                   help="with --shared-prefix-tokens: interleaved rounds of the throughput arms")
    b.add_argument("--concurrency", help="e.g. 1,2,4,8,16: benchmark the services under load instead")
    b.add_argument("--requests-per-level", type=int, default=16, help="with --concurrency: requests per arm")
    b.add_argument("--rounds", type=int, default=1,
                   help="with --concurrency: interleave the arms in this many rounds per level (noisy machines)")
    b.add_argument("--temperatures", default="0,1", help="with --concurrency: comma-separated temperatures")
    b.add_argument("--co-located", action="store_true",
                   help="with --concurrency: the verifier hosts the SSMs itself (the default: --num-speculators 0)")
    b.add_argument("--num-speculators", type=int, default=0,
                   help="with --concurrency: speculator processes hosting the SSMs; 0 = the verifier hosts them, as "
                        "`specinfer up` does by default")
    b.add_argument("--noisy-phase-s", type=float, default=0.0,
                   help="with --concurrency: first busy every CPU for this long while load-aware requests run, "
                        "then measure (the policy starts from verdicts made under other load)")
    b.add_argument("--compare-pipeline", action="store_true",
                   help="with --concurrency: add arms whose speculator drafts ahead, against one that does not "
                        "(two speculator processes)")
    b.add_argument("--adaptive-admission", action="store_true",
                   help="with --concurrency: keep the gateway's measured admission limit (one limit for all arms, "
                        "so one arm's latencies set the next arm's); default: a fixed limit, so the arms compare "
                        "decoding alone")
    b.add_argument("--shared-suffix-cache", action="store_true",
                   help="with --concurrency: keep the suffix member's cache of recent outputs shared across requests "
                        "(off by default here: every arm and round sends the same prompts, so it would draft each "
                        "output from an earlier arm's)")
    b.add_argument("--port", type=int, default=50151, help="with --concurrency: first port of the stack")
    b.add_argument("--verifier-threads", type=int, default=0, help="with --concurrency: torch threads (0 = default)")
    b.add_argument("--speculator-threads", type=int, default=0, help="with --concurrency: torch threads (0 = default)")
    b.add_argument("--omp-wait-policy", choices=["ACTIVE", "PASSIVE"], help="with --concurrency: OpenMP idle waits")
    add_kv_flags(b)  # with --concurrency: the stack's verifiers' (in process, the cache fits the prompts)

    from specinfer.cli.launcher import add_up_parser

    add_up_parser(sub)
    from specinfer.cli.client import add_client_parser

    add_client_parser(sub)
    from specinfer.pool.commands import add_pool_parsers

    add_pool_parsers(sub)

    d = sub.add_parser("demo-models", help="build (or find cached) demo LLM and SSMs")
    d.add_argument("--cache-dir", type=Path)
    d.add_argument("--tiny", action="store_true", help="tiny training budget (for tests)")
    d.add_argument("--force", action="store_true", help="rebuild even if cached")
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_cpu_runtime()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        cache_dir = default_cache_dir(getattr(args, "cache_dir", None))
        if args.command == "generate":
            from specinfer.cli.commands import run_generate

            return run_generate(args, cache_dir)
        if args.command == "bench" and args.shared_prefix_tokens:
            from specinfer.cli.bench_prefix import run_prefix_bench, run_serving_prefix_bench

            if args.concurrency:
                return run_serving_prefix_bench(args, cache_dir)
            return run_prefix_bench(args, cache_dir)
        if args.command == "bench" and args.concurrency:
            from specinfer.cli.bench_serving import run_serving_bench

            return run_serving_bench(args, cache_dir)
        if args.command == "bench":
            from specinfer.cli.bench import run_bench

            return run_bench(args, cache_dir)
        if args.command == "demo-models":
            from specinfer.cli.commands import run_demo_models

            return run_demo_models(args, cache_dir)
        if args.command == "up":
            from specinfer.cli.launcher import run_up

            return run_up(args, cache_dir)
        if args.command in ("make-ssm", "boost-tune", "make-draft"):
            from specinfer.pool.commands import run_pool_command

            return run_pool_command(args)
        if args.command == "client":
            from specinfer.cli.client import run_client

            return run_client(args)
        raise UserError(f"unknown command {args.command!r}")
    except UserError as exc:
        print(f"specinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specinfer: interrupted", file=sys.stderr)
        return 130

