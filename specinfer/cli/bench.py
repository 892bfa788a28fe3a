"""`specinfer bench`: incremental vs sequence vs tree speculation vs transformers, side by side.

SpecInfer's headline metrics (Section 6): tokens verified per LLM step, and end-to-end latency
per token against incremental decoding. Every arm runs on the same models and prompts in the same
process, interleaved prompt by prompt (arm order rotating), so machine noise hits all arms alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specinfer.engine.runtime.load import ModelPaths
from specinfer.util import quiet_transformers
import torch
from specinfer.cli.commands import bench_prompts, load_for_prompts, resolve_paths, tree_shape
from specinfer.cli.request_flags import constraint_from_flags, sampling_from_flags
from specinfer.engine.llm_engine import mode_params
from specinfer.limits import parse_tree_width
from specinfer.params import SamplingParams
from specinfer.engine.runtime.dtype_choice import runner_dtype
from specinfer.engine.models.checkpoint import compute_dtype
from specinfer.pool.hf_model import load_hf_model


@dataclass
class ArmResult:
    outputs: list[list[int]] = field(default_factory=list)
    num_tokens: int = 0
    num_steps: int = 0
    seconds: float = 0.0
    processing_s: float = 0.0  # in the logits processors and the grammar

    def add(self, output: list[int], steps: int, seconds: float, num_tokens: int | None = None,
            processing_s: float = 0.0) -> None:
        self.outputs.append(output)
        self.num_tokens += len(output) if num_tokens is None else num_tokens
        self.num_steps += steps
        self.seconds += seconds
        self.processing_s += processing_s

    def summary(self, baseline: "ArmResult", reference_outputs: list[list[int]]) -> dict:
        ms = 1000 * self.seconds / max(1, self.num_tokens)
        base_ms = 1000 * baseline.seconds / max(1, baseline.num_tokens)
        return {
            "tokens_per_llm_step": round(self.num_tokens / max(1, self.num_steps), 3),
            "ms_per_token": round(ms, 3),
            "speedup_vs_incremental": round(base_ms / ms, 3) if ms else None,
            "greedy_equals_incremental": self.outputs == reference_outputs,
            "num_output_tokens": self.num_tokens,
            "ms_per_step": round(1000 * self.seconds / max(1, self.num_steps), 3),
            "processors_share_of_time": round(self.processing_s / self.seconds, 4) if self.seconds else None,
        }


def machine_info(dtype: str) -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dtype": dtype,
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


class _TransformersArms:
    """transformers' greedy generate and assisted generation (assistant_model = first SSM).

    transformers' own reports stay quiet (`quiet_transformers`): its weight-loading progress bars,
    and the deprecation warning its assisted generation raises from within (its candidate
    generator calls the assistant's `generate` with a `generation_config` and generation arguments
    together; the call here passes arguments only)."""

    def __init__(self, paths: ModelPaths, dtype: str, ssm_dtype: str, device: str):
        self.torch = torch
        self.device = device
        self.llm = load_hf_model(paths.llm, getattr(torch, dtype), device)
        # The assistant runs in the same dtype as our SSMs, so both sides get the same help.
        # in the dtype it computes in (float32 for an SSM over 8-bit codes, limits.Q8_DTYPE)
        self.ssm = load_hf_model(paths.ssms[0], compute_dtype(ssm_dtype, device)[0], device)
        self.num_calls = 0
        self.llm.register_forward_hook(self._count)

    def _count(self, *_):
        self.num_calls += 1

    def run(self, ids: list[int], max_new_tokens: int, is_assisted: bool) -> tuple[list[int], int, float]:
        torch = self.torch
        inputs = torch.tensor([ids], device=self.device)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.llm.config.eos_token_id or 0)
        if is_assisted:
            kwargs["assistant_model"] = self.ssm
        self.num_calls = 0
        start = time.perf_counter()
        with torch.no_grad(), quiet_transformers():
            out = self.llm.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
        seconds = time.perf_counter() - start
        return out[0, len(ids):].tolist(), self.num_calls, seconds


def _arms(args: argparse.Namespace, ssm_names: tuple[str, ...], model_free: tuple[str, ...], is_tp1: bool
          ) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The engine's arms: name -> (mode, pool members used)."""
    # "defaults" is what `specinfer generate` does with these models and no other flag: dynamic
    # trees of the whole pool, load-aware. The static arms (SpecInfer's expansion, --tree-width)
    # speculate with the first SSM only; "+pool" arms add the model-free members (merged into the
    # same tree, their union), and each model-free member also runs alone; "auto_ssm" is dynamic
    # trees of the first SSM alone. Greedy throughout.
    arms = {"incremental": ("incremental", ()), "defaults": ("auto", ())}
    if ssm_names:
        arms |= {"sequence": ("sequence", ssm_names[:1]), "tree": ("tree", ssm_names[:1])}
        if model_free:
            arms["auto_ssm"] = ("auto", ssm_names[:1])
    for name in model_free:
        arms[name] = ("tree", (name,))
    if ssm_names and model_free:
        arms["tree+" + "+".join(model_free)] = ("tree", ssm_names[:1] + model_free)
    if len(ssm_names) > 1:
        arms["tree_merged"] = ("tree", ssm_names)
    if is_tp1:
        arms |= {f"tp1_{name}": arms[name] for name in ("incremental", "tree") if name in arms}
    # --logprobs: the tree arm returning logprobs; --samples N: N samples of each prompt stepping
    # together, sharing the prompt's KV (one prefix group) or each reading it (separate requests).
    if ssm_names and args.logprobs is not None:
        arms["tree_logprobs"] = ("tree", ssm_names[:1])
    if ssm_names and args.samples > 1:
        arms[f"tree_n{args.samples}_shared"] = arms[f"tree_n{args.samples}_separate"] = ("tree", ssm_names[:1])
    return arms


def _run_samples(engine, num_samples: int, shape, is_shared: bool, ids: list[int], max_new: int, names_used
                 ) -> tuple[list[int], int, float, int]:
    """Greedy samples are all the same output: sample 0's is returned when they agree."""
    params = mode_params("tree", max_new, shape, ssm_names=tuple(names_used))
    scheduler = engine.scheduler
    caching = scheduler.cfg
    scheduler.reset_prefix_cache()
    if not is_shared:  # each sample reads the prompt: no prefix cache to share it through
        scheduler.cfg = replace(caching, is_prefix_caching=False)
    started = time.perf_counter()
    try:
        gens = [engine.start(ids, params, prefix_group="bench" if is_shared else None) for _ in range(num_samples)]
        results = engine.generate_batch(gens)
    finally:
        scheduler.cfg = caching
    seconds = time.perf_counter() - started
    same = all(r.output_ids == results[0].output_ids for r in results)
    return ((results[0].output_ids if same else []), sum(r.num_llm_steps for r in results), seconds,
            sum(len(r.output_ids) for r in results))


def _config(args: argparse.Namespace, paths, engine, num_prompts: int, widths, ssm_dtypes, ssm_dtype_choice,
            constraint, processed) -> dict:
    """The report's configuration: what was run, as resolved."""
    return {
        "llm": str(paths.llm),
        "ssms": [str(s) for s in paths.ssms] + list(paths.model_free),
        "num_prompts": num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "tree_width": list(widths),
        "max_tree_nodes": args.max_tree_nodes,
        "min_path_prob": args.min_path_prob,
        "ssm_dtype": ssm_dtypes[0] if len(set(ssm_dtypes)) == 1 else (ssm_dtypes or None),  # resolved
        "ssm_dtype_choice": ssm_dtype_choice,  # with --ssm-dtype auto: what was measured
        "tensor_parallel": args.tensor_parallel,
        "attention": engine.verifier.runner.model.attention_name,  # resolved
        "cuda_graphs": engine.verifier.runner.graphs is not None,
        "offload": args.offload,
        "logprobs": args.logprobs,
        "samples": args.samples,
        # Sampled arms are seeded per prompt: they equal incremental sampling token for token too.
        "decoding": f"sampled, temperature {args.temperature}" if args.temperature else "greedy",
        "constraint": None if constraint is None else {"kind": constraint.kind, "spec": constraint.spec,
                                                       "choices": list(constraint.choices)},
        "processors": {k: v for k, v in asdict(processed).items() if k not in ("temperature", "seed")}
        if processed.has_processors else None,
        "note": "LLM steps exclude our prefill; transformers counts every LLM forward call",
    }


def _forget(engine) -> None:
    """No arm learns from another's outputs, and every arm reads its prompt: none is served
    another's KV."""
    for member in engine.source.speculator.model_free:
        if hasattr(member, "cache"):
            member.cache.clear()
    engine.scheduler.reset_prefix_cache()


def _run_interleaved(names: list[str], prompt_ids: list[list[int]], max_new_tokens: int, run_arm, results: dict
                     ) -> None:
    """A warm-up of every arm (allocators, caches, lazy inits), then every prompt through every
    arm, the arms' order rotating from prompt to prompt."""
    for name in names:
        run_arm(name, prompt_ids[0], min(8, max_new_tokens))
    for i, ids in enumerate(prompt_ids):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            results[name].add(*run_arm(name, ids, max_new_tokens))
        print(f"bench: prompt {i + 1}/{len(prompt_ids)} done", file=sys.stderr, flush=True)


def run_bench(args: argparse.Namespace, cache_dir: Path) -> int:
    widths = parse_tree_width(args.tree_width)
    paths, demo_prompts = resolve_paths(args, cache_dir, ssm_needed_by="bench")
    prompts = bench_prompts(args, demo_prompts, paths.llm)
    if args.num_prompts > 0:
        prompts = prompts[: args.num_prompts]
    _, prompt_ids, engine = load_for_prompts(args, paths, prompts, cache_dir)
    single = None
    if args.tensor_parallel > 1:  # the same LLM in one process: "tp1_" arms, interleaved with the sharded ones
        _, _, single = load_for_prompts(argparse.Namespace(**{**vars(args), "tensor_parallel": 1}), paths, prompts,
                                        cache_dir)
    ssm_dtypes, ssm_dtype_choice = resolved_ssm_dtypes(engine, paths)
    model_free = tuple(paths.model_free)
    ssm_names = tuple(n for n in engine.source.names if n not in model_free)
    shape = tree_shape(args)  # the static arms' expansion (and every arm's sampling settings)
    arms = _arms(args, ssm_names, model_free, is_tp1=single is not None)
    # --json-schema, --regex, --choice, --grammar and the penalties apply to every arm; the
    # "incremental_free" arm decodes without them, for what they cost a step.
    constraint = constraint_from_flags(args)
    processed = sampling_from_flags(args)
    is_processed = constraint is not None or processed.has_processors
    if is_processed:
        arms["incremental_free"] = ("incremental", ())
    if not paths.ssms or args.temperature or is_processed:
        args.no_transformers = True  # assisted generation needs an SSM (and is compared greedy, unprocessed)
    hf = None if args.no_transformers else _TransformersArms(paths, args.dtype, ssm_dtypes[0],
                                                             engine.verifier.runner.model.device.type)
    names = list(arms) + ([] if hf is None else ["transformers_greedy", "transformers_assisted"])
    results = {name: ArmResult() for name in names}

    def run_arm(name: str, ids: list[int], max_new: int) -> tuple[list[int], int, float]:
        if name.startswith("transformers"):
            return hf.run(ids, max_new, is_assisted=name == "transformers_assisted")
        mode, names_used = arms[name]
        target = single if name.startswith("tp1_") else engine
        if name.startswith(f"tree_n{args.samples}_"):
            return _run_samples(engine, args.samples, shape, name.endswith("_shared"), ids, max_new, names_used)
        _forget(target)
        extra = {"num_logprobs": args.logprobs} if name == "tree_logprobs" else {}
        sampling = SamplingParams(args.temperature, seed=len(ids)) if args.temperature else SamplingParams()
        if name != "incremental_free":
            sampling = replace(processed, temperature=sampling.temperature, seed=sampling.seed)
            extra["constraint"] = constraint
        r = target.generate(ids, mode_params(mode, max_new, shape, sampling, ssm_names=tuple(names_used), **extra))
        return r.output_ids, r.num_llm_steps, r.latency_s, None, r.processing_s

    _run_interleaved(names, prompt_ids, args.max_new_tokens, run_arm, results)
    reference = results["incremental"].outputs
    report = {
        "machine": machine_info(args.dtype),
        "config": _config(args, paths, engine, len(prompt_ids), widths, ssm_dtypes, ssm_dtype_choice, constraint,
                          processed),
        "results": {name: results[name].summary(results["incremental"], reference) for name in names},
        # what each SSM's drafts alone brought in dynamic trees, at the bench's decoding (greedy or sampled)
        "pool_members": member_verdicts(engine, paths.ssms, is_greedy=not args.temperature),
    }
    report["summary"] = summary(report["results"])
    engine.verifier.runner.close()
    print_report(report, args.output)
    return 0


def member_verdicts(engine, ssm_dirs, is_greedy: bool = True) -> dict:
    """Each SSM of the pool (`ssm_dirs`, in pool order) in the dynamic-tree arms: what its drafts
    alone got accepted, and whether it dropped out of the trees (its passes did not pay); one
    line each on stderr. Greedy and sampled steps are judged apart: `is_greedy` says which."""
    source = engine.source
    speculator = getattr(source, "speculator", None)
    if speculator is None or engine.load_policy is None:
        return {}
    budget = engine.load_policy.budget(1)
    verdicts = {}
    for m, name in enumerate(source.names[:len(speculator.runners)]):
        member = speculator.member_gain[is_greedy].summary(m)
        verdicts[name] = {**member, "level_cost": round(budget.level_cost, 4), "start_cost": round(budget.ssm_cost, 4)}
        if not member["runs"]:
            continue
        why = (f"in the {member['runs']:g} steps it ran, its drafts alone got {member['accepted_alone']:.2f} tokens "
               f"a step accepted, for {member['levels']:.1f} levels a step costing {budget.level_cost:.2f} of a plain "
               f"step each (+{budget.ssm_cost:.2f} to start)")
        verdict = "dropped out of the trees (its passes do not pay)" if member["dropped"] else "stays in the trees"
        print(f"bench: pool member {name} ({ssm_dirs[m]}) {verdict}: {why}", file=sys.stderr, flush=True)
    return verdicts


def summary(results: dict) -> dict:
    """The defaults against the baselines: incremental, transformers' assisted generation, and the
    fastest of the hand-set arms (static trees, single members) of the same run."""
    tuned = {n: r for n, r in results.items()
             if n not in ("incremental", "defaults", "incremental_free")
             and not n.startswith(("transformers", "tp1_", "tree_n"))}
    best = max(tuned, key=lambda n: tuned[n]["speedup_vs_incremental"] or 0.0, default=None)
    defaults = results["defaults"]["ms_per_token"]
    out = {"defaults_vs_incremental": results["defaults"]["speedup_vs_incremental"], "best_tuned": best,
           "best_tuned_vs_incremental": tuned[best]["speedup_vs_incremental"] if best else None,
           "defaults_vs_best_tuned": round(tuned[best]["ms_per_token"] / defaults, 3) if best else None}
    if "incremental_free" in results:  # what the constraint and processors cost a step
        out["processors_share_of_time"] = {n: results[n]["processors_share_of_time"] for n in ("incremental", "defaults")}
        out["incremental_ms_per_step_vs_free"] = round(results["incremental"]["ms_per_step"]
                                                       / results["incremental_free"]["ms_per_step"], 3)
    if "transformers_assisted" in results:
        out["defaults_vs_transformers_assisted"] = round(results["transformers_assisted"]["ms_per_token"] / defaults, 3)
    return out


def resolved_ssm_dtypes(engine, paths: ModelPaths) -> tuple[list[str], dict | None]:
    """The dtype each SSM runs in, and, for those measured (`--ssm-dtype auto`), by SSM
    directory name: the choice and the milliseconds per pass of every candidate."""
    runners = engine.source.speculator.runners if engine.source is not None else []
    choices = {p.name: r.dtype_choice.to_json() for p, r in zip(paths.ssms, runners) if r.dtype_choice is not None}
    return [runner_dtype(r) for r in runners], choices or None


def print_report(report: dict, output: str | Path | None) -> None:
    """Prints a benchmark's JSON report and, with `output`, writes it there too."""
    text = json.dumps(report, indent=2)
    print(text)
    if output:
        Path(output).write_text(text + "\n")
