"""`specinfer bench --concurrency 1,2,4,...`: throughput and latency through the real services.

SpecInfer's serving evaluation (Section 6.2, Figure 10) compares speculation against incremental
decoding as the batch grows. This starts the stack (speculator, verifier, gateway) on localhost,
then, at each concurrency, runs the same prompts through the gateway in three arms, interleaved
in rounds (each round runs every arm on a share of the requests, in rotating order, so that the
machine's drifts hit all arms alike): incremental decoding (the verifier batches requests), a
fixed token tree (`--tree-width`, the paper's static expansion), and the defaults (what a
request naming no tree gets: dynamic trees priced by the load-aware policy, or none). It
reports output tokens/s, p50/p99 per-token latency (request latency / output tokens), and whether
every greedy output equals the single-request output.

The gateway admits against a fixed limit here unless `--adaptive-admission` is given: its measured
limit is one for all arms, so a slow arm (a fixed tree at temperature 1) would lower the limit the
next arm runs under, and the arms would no longer compare decoding alone.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
import os
import subprocess
import json
import urllib.request

from specinfer.errors import UserError
from specinfer.engine.runtime.dtype_choice import runner_dtype
from specinfer.engine.runtime.assemble import load_engine
from specinfer.engine.runtime.load import check_models, load_tokenizer
from specinfer.engine.llm_engine import mode_params
from specinfer.params import TreeShape
from specinfer.cli.client import GatewayClient
from specinfer.cli.commands import bench_prompts, resolve_paths
from specinfer.cli.launcher import Stack, StackConfig, check_ports
from specinfer.limits import parse_tree_width
from specinfer.cli.bench import machine_info, print_report


@dataclass(frozen=True)
class ArmSpec:
    name: str
    speculate: bool
    widths: tuple[int, ...]  # () = the verifier's choice (load-aware)
    ssm_names: tuple[str, ...] = ()  # the pool it speculates with (default: the verifier's)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_load(client, prompts: list[str], concurrency: int, num_requests: int, arm: ArmSpec,
             max_tokens: int, temperature: float, first: int = 0) -> dict:
    """`concurrency` client threads issue requests `first` .. `first + num_requests - 1`."""
    lock = threading.Lock()
    next_index = [first]
    records: list[tuple[int, list[int], float]] = []
    errors: list[str] = []

    def worker():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= first + num_requests:
                return
            params = dict(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True,
                          speculate=arm.speculate)
            if arm.widths:
                params["tree_width"] = arm.widths
            if arm.ssm_names:
                params["ssm_names"] = arm.ssm_names
            start = time.perf_counter()
            try:
                reply = client.generate(prompts[i % len(prompts)], **params)
            except Exception as exc:  # noqa: BLE001 - reported, not raised: one failure must not hide the rest
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                records.append((i, list(reply.token_ids), time.perf_counter() - start))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall_s": time.perf_counter() - start, "records": records, "errors": errors}


def noisy_phase(client, prompts: list[str], seconds: float, max_tokens: int) -> dict:
    """Busies every CPU with spinning processes for `seconds` while load-aware requests run, greedy
    and sampled in turn, so the policy and the guard learn under load the measurement will not
    have; returns what ran."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    num_requests, errors = 0, []
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for temperature in (0.0, 1.0):
                load = run_load(client, prompts, 2, 2, ArmSpec("defaults", True, ()), max_tokens, temperature,
                                num_requests)
                num_requests += len(load["records"])
                errors += load["errors"]
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    return {"seconds": seconds, "num_busy_processes": len(burners), "num_requests": num_requests,
            "errors": errors[:3]}


def summarize(loads: list[dict]) -> dict:
    """One arm's figures over its rounds: tokens/s over the summed wall time, per-request p50/p99."""
    records = [r for load in loads for r in load["records"]]
    wall = sum(load["wall_s"] for load in loads)
    num_tokens = sum(len(r[1]) for r in records)
    per_token = [r[2] / max(1, len(r[1])) for r in records]
    return {
        "output_tokens_per_s": round(num_tokens / max(wall, 1e-9), 2),
        "p50_ms_per_token": round(1000 * _percentile(per_token, 0.5), 2),
        "p99_ms_per_token": round(1000 * _percentile(per_token, 0.99), 2),
        "num_requests": len(records),
        "errors": [e for load in loads for e in load["errors"]][:3],
        "outputs": {i: tokens for i, tokens, _ in records},
    }


def measure_overhead(client, paths, prompts: list[str], widths: tuple[int, ...], max_tokens: int, dtype: str,
                     ssm_dtype: str | None, ssm_names: tuple[str, ...] = (), cache_dir=None,
                     suffix_cache_tokens: int | None = None) -> dict:
    """Per-token time of the same greedy tree decoding through the services (gateway ->
    verifier -> speculator, one request at a time) and in one process, prompt by prompt
    alternating which goes first."""
    llm_cfg, _ = check_models(paths)
    tokenizer = load_tokenizer(paths, llm_cfg)
    engine = load_engine(type(paths)(paths.llm, paths.ssms[:1], paths.model_free), dtype, "cpu", max_kv_tokens=8192,
                         ssm_dtype=ssm_dtype, cache_dir=cache_dir)
    shape = TreeShape(widths)
    engine.generate(tokenizer.encode(prompts[0]), mode_params("tree", 8, shape))  # warm-up, as the services had
    params = mode_params("tree", max_tokens, shape, is_ignore_eos=True)
    totals = {"in_process": [0.0, 0], "service": [0.0, 0]}
    is_equal = True
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        order = ["in_process", "service"] if i % 2 == 0 else ["service", "in_process"]
        outputs = {}
        for arm in order:
            for member in engine.source.speculator.model_free:  # as the stack's: no outputs shared across requests
                if hasattr(member, "cache") and suffix_cache_tokens == 0:
                    member.cache.clear()
            start = time.perf_counter()
            if arm == "in_process":
                outputs[arm] = engine.generate(ids, params).output_ids
            else:
                outputs[arm] = list(client.generate(prompt, max_tokens=max_tokens, tree_width=widths,
                                                    ignore_eos=True, ssm_names=ssm_names).token_ids)
            totals[arm][0] += time.perf_counter() - start
            totals[arm][1] += len(outputs[arm])
        is_equal = is_equal and outputs["in_process"] == outputs["service"]
    ms = {arm: 1000 * t / max(1, n) for arm, (t, n) in totals.items()}
    return {"in_process_ms_per_token": round(ms["in_process"], 3), "service_ms_per_token": round(ms["service"], 3),
            "ratio": round(ms["service"] / ms["in_process"], 3), "greedy_equal": is_equal, "num_prompts": len(prompts),
            "in_process_ssm_dtype": [runner_dtype(r) for r in engine.source.speculator.runners]}


def measure_http_overhead(client, http_url: str, model: str, prompts: list[str], widths: tuple[int, ...],
                          max_tokens: int) -> dict:
    """Per-token time of the same greedy requests through the gateway's gRPC API and its
    OpenAI-compatible HTTP API (whole responses, one request at a time, prompt by prompt
    alternating which goes first), and whether both answer the same text."""
    totals = {"grpc": [0.0, 0], "http": [0.0, 0]}
    is_equal = True
    for i, prompt in enumerate(prompts):
        texts = {}
        for arm in (["grpc", "http"] if i % 2 == 0 else ["http", "grpc"]):
            start = time.perf_counter()
            if arm == "grpc":
                reply = client.generate(prompt, max_tokens=max_tokens, tree_width=widths, ignore_eos=True)
                texts[arm], num_tokens = reply.text, len(reply.token_ids)
            else:
                body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                   "tree_width": list(widths), "ignore_eos": True}).encode()
                request = urllib.request.Request(f"{http_url}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=600) as response:
                    out = json.loads(response.read())
                texts[arm], num_tokens = out["choices"][0]["text"], out["usage"]["completion_tokens"]
            totals[arm][0] += time.perf_counter() - start
            totals[arm][1] += num_tokens
        is_equal = is_equal and texts["grpc"] == texts["http"]
    ms = {arm: 1000 * t / max(1, n) for arm, (t, n) in totals.items()}
    return {"grpc_ms_per_token": round(ms["grpc"], 3), "http_ms_per_token": round(ms["http"], 3),
            "ratio": round(ms["http"] / ms["grpc"], 3), "greedy_equal": is_equal, "num_prompts": len(prompts)}


def _check_flags(args) -> None:
    if args.rounds < 1 or args.requests_per_level < 1:
        raise UserError("--rounds and --requests-per-level must be >= 1")
    if args.noisy_phase_s < 0:
        raise UserError("--noisy-phase-s must be >= 0")
    if args.num_speculators < 0:
        raise UserError("--num-speculators must be >= 0 (0 = the verifier hosts the SSMs itself)")
    if args.compare_pipeline and args.co_located:
        raise UserError("--compare-pipeline compares speculator processes: leave out --co-located")


def _stack(args, paths, cache_dir: Path) -> Stack:
    """The stack under test, as `specinfer up` starts it, with no cache shared between arms."""
    stack = Stack(StackConfig(llm=paths.llm, ssms=paths.ssms[:1], gateway_port=args.port, http_port=args.port + 3,
                              verifier_port=args.port + 1, speculator_base_port=args.port + 4, dtype=args.dtype,
                              ssm_dtype=args.ssm_dtype, cache_dir=cache_dir, verifier_threads=args.verifier_threads,
                              speculator_threads=args.speculator_threads, omp_wait_policy=args.omp_wait_policy,
                              tree_width=args.tree_width,
                              admission_latency_factor=None if args.adaptive_admission else 0.0,
                              # Arms and rounds send the same prompts: a shared suffix cache would draft
                              # each greedy output from an earlier arm's (the repeated-task case).
                              suffix_cache_tokens=None if args.shared_suffix_cache else 0,
                              # ... and a prefix cache would serve later arms' prompts from earlier arms' KV.
                              is_prefix_caching=False, kv_budget=args.kv_budget,
                              kv_memory_fraction=args.kv_memory_fraction))
    # As `specinfer up` starts it: the verifier hosts the pool unless speculator processes are asked for.
    return Stack(replace(stack.cfg, model_free=paths.model_free, num_speculators=max(1, args.num_speculators),
                         is_co_located=args.co_located or not args.num_speculators or not paths.ssms))


def _table(client, prompts: list[str], levels: list[int], arms: list, args, temperature: float) -> dict:
    """Every arm at every concurrency level at one temperature, rounds in rotating arm order."""
    table = {}
    single: dict[str, dict[int, list[int]]] = {}
    for level in levels:
        num_requests = max(args.requests_per_level, level)
        per_round = max(level, -(-num_requests // args.rounds))
        loads: dict[str, list[dict]] = {arm.name: [] for arm in arms}
        for r in range(-(-num_requests // per_round)):
            first = r * per_round
            for arm in arms[r % len(arms):] + arms[: r % len(arms)]:  # rotating order
                loads[arm.name].append(run_load(client, prompts, level, min(per_round, num_requests - first),
                                                arm, args.max_new_tokens, temperature, first))
        row = {}
        for arm in arms:
            out = summarize(loads[arm.name])
            outputs = out.pop("outputs")
            if temperature == 0.0:
                reference = single.setdefault(arm.name, outputs if level == levels[0] else {})
                out["greedy_equals_single"] = all(reference.get(i, o) == o for i, o in outputs.items())
            row[arm.name] = out
            print(f"bench: T={temperature} c={level} {arm.name}: {out['output_tokens_per_s']} tok/s",
                  file=sys.stderr, flush=True)
        base = row["incremental"]["output_tokens_per_s"]
        for arm in arms:
            row[arm.name]["speedup_vs_incremental"] = round(row[arm.name]["output_tokens_per_s"] / max(base, 1e-9), 3)
        table[str(level)] = row
    return table


def run_serving_bench(args, cache_dir: Path) -> int:
    levels = _parse_levels(args.concurrency)
    _check_flags(args)
    widths = parse_tree_width(args.tree_width)
    paths, demo_prompts = resolve_paths(args, cache_dir, ssm_needed_by="the serving benchmark")
    check_models(paths)
    prompts = bench_prompts(args, demo_prompts, paths.llm)
    temperatures = [float(t) for t in str(args.temperatures).split(",")]
    stack = _stack(args, paths, cache_dir)
    # "defaults": what a request that names no tree gets (the verifier's dynamic trees, load-aware).
    arms = [ArmSpec("incremental", False, ()), ArmSpec("fixed_tree", True, widths), ArmSpec("defaults", True, ())]
    plain_pool: tuple[str, ...] = ()
    if args.compare_pipeline:
        stack, plain_pool, ahead_pool = _pipeline_stack(stack, cache_dir)
        arms = [arms[0], replace(arms[1], ssm_names=plain_pool), ArmSpec("fixed_tree_ahead", True, widths, ahead_pool),
                replace(arms[2], ssm_names=plain_pool), ArmSpec("load_aware_ahead", True, (), ahead_pool)]
    report = {"config": {"llm": str(paths.llm), "ssm": str(paths.ssms[0]), "model_free": list(paths.model_free),
                         "co_located": stack.cfg.is_co_located, "concurrency": levels, "ssm_dtype": args.ssm_dtype,
                         "max_tokens": args.max_new_tokens, "tree_width": list(widths),
                         "requests_per_level": args.requests_per_level, "rounds": args.rounds,
                         "temperatures": temperatures, "compare_pipeline": bool(args.compare_pipeline),
                         "noisy_phase_s": args.noisy_phase_s, "adaptive_admission": bool(args.adaptive_admission),
                         "shared_suffix_cache": bool(args.shared_suffix_cache), "prefix_caching": False},
              "results": {}}
    check_ports(stack.cfg, moved_by="--port (the first of the stack's ports)")  # before anything starts
    try:
        stack.start()
        stack.wait_healthy()
        client = GatewayClient(f"127.0.0.1:{args.port}", timeout_s=600)
        for arm in arms:  # warm-up: lazy allocations, first calibration of acceptance
            run_load(client, prompts, 2, 4, arm, min(16, args.max_new_tokens), 0.0)
        if args.noisy_phase_s:
            print(f"bench: a noisy phase of {args.noisy_phase_s:g}s", file=sys.stderr, flush=True)
            report["noisy_phase"] = noisy_phase(client, prompts, args.noisy_phase_s, args.max_new_tokens)
        report["service_overhead"] = measure_overhead(client, paths, prompts[: args.requests_per_level], widths,
                                                      args.max_new_tokens, args.dtype, args.ssm_dtype, plain_pool,
                                                      cache_dir, stack.cfg.suffix_cache_tokens)
        report["http_overhead"] = measure_http_overhead(client, f"http://127.0.0.1:{args.port + 3}", paths.llm.name,
                                                        prompts[: args.requests_per_level], widths,
                                                        args.max_new_tokens)
        for temperature in temperatures:
            table = _table(client, prompts, levels, arms, args, temperature)
            report["results"][f"temperature={temperature}"] = table
    finally:
        stack.stop()
    report["machine"] = machine_info(args.dtype)
    print_report(report, args.output)
    return 0


def _pipeline_stack(stack, cache_dir: Path):
    """The stack with two speculators hosting the same SSM under two names: one drafts ahead,
    one does not; returns it and the two pools' names (plain, ahead)."""
    ssm = stack.cfg.ssms[0].resolve()
    links = cache_dir / "pipeline-arms"
    links.mkdir(parents=True, exist_ok=True)
    plain, ahead = links / f"{ssm.name}-plain", links / f"{ssm.name}-ahead"
    for link in (plain, ahead):
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ssm, target_is_directory=True)
    cfg = replace(stack.cfg, ssms=(plain, ahead), num_speculators=2, speculator_pipeline=(False, True),
                  model_free=(), is_co_located=False)
    return type(stack)(cfg), (plain.name,), (ahead.name,)


def _parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise UserError(f"--concurrency must be a comma-separated list of integers, got {text!r}") from None
    if not levels or any(x < 1 for x in levels):
        raise UserError("--concurrency values must be >= 1")
    return levels
