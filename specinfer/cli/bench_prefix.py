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


def shared_prefix_prompts(tokenizer, prompts: list[str], num_tokens: int) -> tuple[str, list[str]]:
    """A prefix of at least `num_tokens` tokens made of the prompts themselves, and each prompt
    after it."""
    parts, text = [], ""
    while len(tokenizer.encode(text)) < num_tokens:
        parts.append(prompts[len(parts) % len(prompts)])
        text = "\n\n".join(parts)
    prefix = text + "\n\n"
    return prefix, [prefix + p for p in prompts]


def run_prefix_bench(args: argparse.Namespace, cache_dir: Path) -> int:
    from specinfer.cli.bench import machine_info, print_report
    from specinfer.cli.commands import bench_prompts, load_for_prompts, resolve_paths
    from specinfer.engine.llm_engine import mode_params
    from specinfer.engine.load import check_models, load_tokenizer
    from specinfer.errors import UserError

    paths, demo_prompts = resolve_paths(args, cache_dir, ssm_needed_by="bench")
    questions = bench_prompts(args, demo_prompts)
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

    def time_to_first_token(ids: list[int]) -> tuple[float, int, list[int]]:
        started = time.perf_counter()
        generation = engine.start(ids, first)
        num_cached = generation.session.num_reused
        result = engine.generate_batch([generation])[0]
        return time.perf_counter() - started, num_cached, result.output_ids

    scheduler.cfg = caching_on
    time_to_first_token(prompt_ids[0])  # warm-up: lazy inits, the cost model
    ttft = {"cold": [], "cached": []}
    cached_share, first_tokens_agree = [], True
    for i, ids in enumerate(prompt_ids):
        firsts = {}
        for arm in (("cold", "cached") if i % 2 == 0 else ("cached", "cold")):
            scheduler.reset_prefix_cache()
            if arm == "cached":  # another question after the same prefix came first
                engine.generate(prompt_ids[(i + 1) % len(prompt_ids)], first)
            seconds, num_cached, firsts[arm] = time_to_first_token(ids)
            ttft[arm].append(seconds)
            if arm == "cached":
                cached_share.append(num_cached / len(ids))
        first_tokens_agree = first_tokens_agree and firsts["cached"] == firsts["cold"]
        print(f"bench: time to first token, prompt {i + 1}/{len(prompt_ids)}", file=sys.stderr, flush=True)

    batch = prompt_ids[:num_together]
    throughput = {"prefix_caching": [], "no_prefix_caching": []}
    outputs: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds_in_process):
        order = ("prefix_caching", "no_prefix_caching") if round_ % 2 == 0 else ("no_prefix_caching", "prefix_caching")
        for arm in order:
            scheduler.cfg = caching_on if arm == "prefix_caching" else caching_off
            scheduler.reset_prefix_cache()
            started = time.perf_counter()
            results = engine.generate_batch([engine.start(ids, params) for ids in batch])
            seconds = time.perf_counter() - started
            throughput[arm].append(sum(len(r.output_ids) for r in results) / seconds)
            outputs[arm] = [r.output_ids for r in results]
        print(f"bench: throughput round {round_ + 1}/{args.rounds_in_process}", file=sys.stderr, flush=True)
    scheduler.cfg = caching_on

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
