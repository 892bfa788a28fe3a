"""`specinfer bench --shared-prefix-tokens N`: what automatic prefix caching buys.

Every prompt is one shared prefix of about N tokens (a system prompt, a few-shot preamble or a
RAG context) followed by a question of its own. Two measurements, their arms interleaved:

- time to first token, one request at a time: `cold` after the cache is emptied, against
  `cached` after one earlier request with the same prefix and another question;
- throughput of `--concurrency-in-process` requests that arrive together and share the prefix,
  with prefix caching on against off (the same engine, the cache emptied before each round).

Greedy outputs of every arm must equal the cold ones token for token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
import threading
from specinfer.cli.bench import machine_info, print_report
from specinfer.cli.commands import bench_prompts, load_for_prompts, resolve_paths
from specinfer.engine.llm_engine import mode_params
from specinfer.engine.runtime.load import check_models, load_tokenizer
from specinfer.errors import UserError
from specinfer.cli.client import GatewayClient
from specinfer.cli.launcher import Stack, StackConfig, check_ports


def shared_prefix_prompts(tokenizer, prompts: list[str], num_tokens: int) -> tuple[str, list[str]]:
    """A prefix of at least `num_tokens` tokens made of the prompts themselves, and each prompt
    after it."""
    parts, text = [], ""
    while len(tokenizer.encode(text)) < num_tokens:
        parts.append(prompts[len(parts) % len(prompts)])
        text = "\n\n".join(parts)
    prefix = text + "\n\n"
    return prefix, [prefix + p for p in prompts]


def _time_to_first_tokens(engine, prompt_ids: list[list[int]], first) -> tuple[dict, list[float], bool]:
    """Each prompt's time to its first token with a cold prefix cache and with another question
    after the same prefix read first (the arms' order alternating); the cached share of each
    prompt; whether both arms' first tokens agree."""

    def time_to_first_token(ids: list[int]) -> tuple[float, int, list[int]]:
        started = time.perf_counter()
        generation = engine.start(ids, first)
        num_cached = generation.session.num_reused
        result = engine.generate_batch([generation])[0]
        return time.perf_counter() - started, num_cached, result.output_ids

    time_to_first_token(prompt_ids[0])  # warm-up: lazy inits, the cost model
    ttft = {"cold": [], "cached": []}
    cached_share, first_tokens_agree = [], True
    for i, ids in enumerate(prompt_ids):
        firsts = {}
        for arm in (("cold", "cached") if i % 2 == 0 else ("cached", "cold")):
            engine.scheduler.reset_prefix_cache()
            if arm == "cached":  # another question after the same prefix came first
                engine.generate(prompt_ids[(i + 1) % len(prompt_ids)], first)
            seconds, num_cached, firsts[arm] = time_to_first_token(ids)
            ttft[arm].append(seconds)
            if arm == "cached":
                cached_share.append(num_cached / len(ids))
        first_tokens_agree = first_tokens_agree and firsts["cached"] == firsts["cold"]
        print(f"bench: time to first token, prompt {i + 1}/{len(prompt_ids)}", file=sys.stderr, flush=True)
    return ttft, cached_share, first_tokens_agree


def _throughputs(engine, batch: list[list[int]], params, rounds: int, caching_on, caching_off
                 ) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Output tokens per second of the batch with prefix caching on and off, rounds alternating
    the arms' order; each arm's last outputs. Leaves caching on."""
    scheduler = engine.scheduler
    throughput = {"prefix_caching": [], "no_prefix_caching": []}
    outputs: dict[str, list[list[int]]] = {}
    for round_ in range(rounds):
        order = ("prefix_caching", "no_prefix_caching") if round_ % 2 == 0 else ("no_prefix_caching", "prefix_caching")
        for arm in order:
            scheduler.cfg = caching_on if arm == "prefix_caching" else caching_off
            scheduler.reset_prefix_cache()
            started = time.perf_counter()
            results = engine.generate_batch([engine.start(ids, params) for ids in batch])
            seconds = time.perf_counter() - started
            throughput[arm].append(sum(len(r.output_ids) for r in results) / seconds)
            outputs[arm] = [r.output_ids for r in results]
        print(f"bench: throughput round {round_ + 1}/{rounds}", file=sys.stderr, flush=True)
    scheduler.cfg = caching_on
    return throughput, outputs


def run_prefix_bench(args: argparse.Namespace, cache_dir: Path) -> int:
    paths, demo_prompts = resolve_paths(args, cache_dir, ssm_needed_by="bench")
    questions = bench_prompts(args, demo_prompts, paths.llm)
    num_together = args.concurrency_in_process
    if num_together < 1 or args.shared_prefix_tokens < 1:
        raise UserError("--shared-prefix-tokens and --concurrency-in-process must be >= 1")
    questions = [questions[i % len(questions)] for i in range(max(num_together, args.num_prompts or 0))]
    tokenizer = load_tokenizer(paths, check_models(paths)[0])
    prefix, prompts = shared_prefix_prompts(tokenizer, questions, args.shared_prefix_tokens)
    loaded = argparse.Namespace(**{**vars(args), "samples": num_together})  # KV for that many at once
    _, prompt_ids, engine = load_for_prompts(loaded, paths, prompts, cache_dir)
    scheduler = engine.scheduler
    caching_on = scheduler.cfg if scheduler.cfg.is_prefix_caching else replace(scheduler.cfg, is_prefix_caching=True)
    caching_off = replace(caching_on, is_prefix_caching=False)
    num_prefix = len(tokenizer.encode(prefix))
    params = mode_params("auto", args.max_new_tokens, is_ignore_eos=True)
    first = mode_params("auto", 1, is_ignore_eos=True)

    scheduler.cfg = caching_on
    ttft, cached_share, first_tokens_agree = _time_to_first_tokens(engine, prompt_ids, first)
    throughput, outputs = _throughputs(engine, prompt_ids[:num_together], params, args.rounds_in_process,
                                       caching_on, caching_off)

    median_cold, median_cached = statistics.median(ttft["cold"]), statistics.median(ttft["cached"])
    tokens_per_s = {arm: round(statistics.median(v), 2) for arm, v in throughput.items()}
    report = {
        "machine": machine_info(args.dtype),
        "config": {"llm": str(paths.llm), "ssms": [str(s) for s in paths.ssms] + list(paths.model_free),
                   "shared_prefix_tokens": num_prefix, "num_prompts": len(prompt_ids),
                   "prompt_tokens_median": statistics.median(len(p) for p in prompt_ids),
                   "concurrency_in_process": num_together, "rounds": args.rounds_in_process,
                   "max_new_tokens": args.max_new_tokens, "mode": "auto (the defaults)", "decoding": "greedy"},
        "time_to_first_token": {
            "cold_median_ms": round(1000 * median_cold, 1), "cached_median_ms": round(1000 * median_cached, 1),
            "cold_over_cached": round(median_cold / median_cached, 2),
            "cached_share_of_prompt_median": round(statistics.median(cached_share), 3),
            "first_tokens_equal_cold": first_tokens_agree,
        },
        "throughput": {
            "output_tokens_per_s": tokens_per_s,
            "prefix_caching_over_off": round(tokens_per_s["prefix_caching"] / tokens_per_s["no_prefix_caching"], 2),
            "outputs_equal": outputs["prefix_caching"] == outputs["no_prefix_caching"],
        },
    }
    engine.verifier.runner.close()
    print_report(report, args.output)
    return 0 if first_tokens_agree and report["throughput"]["outputs_equal"] else 1


def _prefix_groups(tokenizer, questions: list[str], num_groups: int, num_prefix_tokens: int
                   ) -> list[tuple[int, list[str]]]:
    """(prefix tokens, prompts) per group: each group's prefix is the questions in another order."""
    groups = []
    for g in range(num_groups):
        rotated = questions[g % len(questions):] + questions[: g % len(questions)]
        prefix, _ = shared_prefix_prompts(tokenizer, rotated, num_prefix_tokens)
        groups.append((len(tokenizer.encode(prefix)), [prefix + f"# {g}.{i}\n" + q for i, q in enumerate(questions)]))
    return groups


def _run_plan(client, plan: list[tuple[int, str]], concurrency: int, max_new_tokens: int
              ) -> tuple[list[tuple], list[str], float]:
    """Streams the planned requests `concurrency` at a time; per request (index, group, time to
    first token, cached prompt tokens, prompt tokens), the errors, and the wall time."""
    records, errors, lock, next_index = [], [], threading.Lock(), [0]
    def worker(client) -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(plan):
                return
            group, prompt = plan[i]
            started, first, last = time.perf_counter(), None, None
            try:
                for delta in client.generate_stream(prompt, max_tokens=max_new_tokens, temperature=0.0,
                                                    ignore_eos=True):
                    if first is None and delta.token_ids:
                        first = time.perf_counter() - started
                    last = delta
            except Exception as exc:  # noqa: BLE001 - reported: one failure must not hide the rest
                with lock:
                    errors.append(str(exc))
                continue
            stats = last.stats
            with lock:
                records.append((i, group, first, stats.cached_prompt_tokens, stats.prompt_tokens))

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(client,)) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, errors, time.perf_counter() - started


def run_serving_prefix_bench(args: argparse.Namespace, cache_dir: Path) -> int:
    """`--concurrency C --shared-prefix-tokens N [--num-verifiers V --prefix-groups G]`: G prefixes,
    their requests interleaved, through the gateway to V verifiers with prefix caching on. Reports
    how often a request found its prefix cached where the gateway sent it, the cached share of its
    prompt, and time to first token (streamed) for hits against misses."""
    levels = [int(c) for c in str(args.concurrency).split(",")]
    if len(levels) != 1 or levels[0] < 1 or args.num_verifiers < 1 or args.prefix_groups < 1:
        raise UserError("with --shared-prefix-tokens: one --concurrency level, and --num-verifiers and "
                        "--prefix-groups >= 1")
    concurrency = levels[0]
    paths, demo_prompts = resolve_paths(args, cache_dir, ssm_needed_by="bench")
    questions = bench_prompts(args, demo_prompts, paths.llm)
    tokenizer = load_tokenizer(paths, check_models(paths)[0])
    groups = _prefix_groups(tokenizer, questions, args.prefix_groups, args.shared_prefix_tokens)
    num_requests = max(args.requests_per_level, concurrency)
    plan = [(i % len(groups), groups[i % len(groups)][1][(i // len(groups)) % len(questions)])
            for i in range(num_requests)]
    stack = Stack(StackConfig(llm=paths.llm, ssms=paths.ssms[:1], model_free=paths.model_free, is_co_located=True,
                              gateway_port=args.port, http_port=0, verifier_port=args.port + 1,
                              speculator_base_port=args.port + 1 + args.num_verifiers,
                              num_verifiers=args.num_verifiers, dtype=args.dtype, ssm_dtype=args.ssm_dtype,
                              cache_dir=cache_dir, admission_latency_factor=0.0, kv_budget=args.kv_budget,
                              kv_memory_fraction=args.kv_memory_fraction))
    check_ports(stack.cfg, moved_by="--port (the first of the stack's ports)")
    try:
        stack.start()
        stack.wait_healthy()
        client = GatewayClient(f"127.0.0.1:{args.port}", timeout_s=600)
        records, errors, wall_s = _run_plan(client, plan, concurrency, args.max_new_tokens)
    finally:
        stack.stop()
    later = [r for r in records if r[0] >= len(groups) * args.num_verifiers]  # after each prefix could be everywhere
    hits = [r for r in later if r[3] >= 0.5 * groups[r[1]][0]]
    misses = [r for r in records if r[3] < 0.5 * groups[r[1]][0]]
    median = lambda xs: round(1000 * statistics.median(xs), 1) if xs else None  # noqa: E731
    report = {
        "machine": machine_info(args.dtype),
        "config": {"llm": str(paths.llm), "num_verifiers": args.num_verifiers, "prefix_groups": args.prefix_groups,
                   "shared_prefix_tokens": [n for n, _ in groups], "concurrency": concurrency,
                   "num_requests": len(plan), "max_new_tokens": args.max_new_tokens, "decoding": "greedy",
                   "order": "the groups' requests interleaved"},
        "hit_rate": round(len(hits) / max(1, len(later)), 3),
        "hit_rate_note": "requests, after the first num_verifiers x prefix_groups, that found at least half of "
                         "their prefix cached where the gateway sent them (round robin would give about "
                         "1 / num_verifiers)",
        "cached_share_of_prompt_median": round(statistics.median(r[3] / r[4] for r in records), 3) if records else None,
        "time_to_first_token_ms": {"hits_median": median([r[2] for r in hits if r[2]]),
                                   "misses_median": median([r[2] for r in misses if r[2]]),
                                   "num_misses": len(misses)},
        "output_tokens_per_s": round(len(records) * args.max_new_tokens / wall_s, 2),
        "errors": errors[:3],
        "num_errors": len(errors),
    }
    print_report(report, args.output)
    return 0 if not errors else 1
