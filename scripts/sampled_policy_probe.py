"""How the dynamic trees spend their steps, arm by arm: the demo's bench arms (or the model-free
members alone, `free`; the defaults under the services' measured guard, `guarded`), each run over the
prompts in turn instead of interleaved prompt by prompt as `specinfer bench` does, with what every
speculative step drafted.

    python scripts/sampled_policy_probe.py [--temperature 0.7] [--arms incremental,suffix,defaults,free,guarded]
        [--rounds 2] [--num-prompts 8] [--max-new-tokens 64] [--llm L --ssm S ...]

For each arm and round it prints tokens a step, milliseconds a token, and, of the steps the
load-aware policy speculated, the tokens accepted and the nodes drafted on average and how many
ran each number of SSM levels; then the SSMs' calibration cells for the decoding it ran (greedy or
sampled) with at least three observations. The arms share one engine (and so the calibration and
the drafting-cost fit), as in `specinfer bench`. It writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import sys

from specinfer.cli import bench
from specinfer.cli.commands import bench_prompts, load_for_prompts, resolve_paths
from specinfer.cli.main import build_parser
from specinfer.engine.llm_engine import mode_params
from specinfer.engine.scheduling.guard import SpeculationGuard
from specinfer.engine.scheduling.policy import LoadAwarePolicy
from specinfer.params import SamplingParams
from specinfer.util import default_cache_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--arms", default="incremental,suffix,defaults,free")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args, rest = parser.parse_known_args(argv)
    bench_args = build_parser().parse_args(["bench", "--num-prompts", str(args.num_prompts), "--max-new-tokens",
                                            str(args.max_new_tokens), "--no-transformers", "--temperature",
                                            str(args.temperature), *rest])
    cache = default_cache_dir(getattr(bench_args, "cache_dir", None))
    paths, demo_prompts = resolve_paths(bench_args, cache, ssm_needed_by="bench")
    prompts = bench_prompts(bench_args, demo_prompts, paths.llm)[: args.num_prompts]
    _, prompt_ids, engine = load_for_prompts(bench_args, paths, prompts, cache)

    steps_seen: list[tuple[int, int, int]] = []  # (accepted, nodes, SSM levels) of each speculative step
    observe = LoadAwarePolicy.observe_step

    def recording(self, num_accepted, num_nodes, num_levels, *rest, **kw):
        steps_seen.append((num_accepted, num_nodes, num_levels))
        return observe(self, num_accepted, num_nodes, num_levels, *rest, **kw)

    LoadAwarePolicy.observe_step = recording
    model_free = tuple(paths.model_free)
    ssm_names = tuple(n for n in engine.source.names if n not in model_free)
    arms = bench._arms(bench_args, ssm_names, model_free, is_tp1=False)
    arms["free"] = ("auto", model_free)
    arms["guarded"] = arms["defaults"]  # the defaults under a measured guard of their own, as the services run them
    guards = {name: SpeculationGuard() if name == "guarded" else None for name in arms}
    shape = bench.tree_shape(bench_args)
    for name in args.arms.split(","):
        if name not in arms:
            print(f"unknown arm {name!r}: choose from {', '.join(arms)}", file=sys.stderr)
            return 2
    for round_index in range(args.rounds):
        for name in args.arms.split(","):
            mode, members = arms[name]
            steps_seen.clear()
            num_steps = num_tokens = 0
            seconds = 0.0
            engine.guard = guards[name]
            for ids in prompt_ids:
                bench._forget(engine)
                sampling = SamplingParams(args.temperature, seed=len(ids)) if args.temperature else SamplingParams()
                r = engine.generate(ids, mode_params(mode, args.max_new_tokens, shape, sampling,
                                                     ssm_names=tuple(members)))
                num_steps += r.num_llm_steps
                num_tokens += len(r.output_ids)
                seconds += r.latency_s
            n = max(1, len(steps_seen))
            levels = dict(sorted(collections.Counter(lv for _, _, lv in steps_seen).items()))
            print(f"round {round_index + 1} {name}: {num_tokens / num_steps:.3f} tokens a step, "
                  f"{1000 * seconds / num_tokens:.1f} ms a token; {len(steps_seen)} of {num_steps} steps speculated, "
                  f"{sum(a for a, _, _ in steps_seen) / n:.2f} accepted and {sum(d for _, d, _ in steps_seen) / n:.2f} "
                  f"nodes a speculated step; SSM levels: {levels}", flush=True)
    calibration = engine.source.speculator.calibration[not args.temperature]
    for key, (accepted, count) in sorted(calibration._cells.items()):
        if count >= 3 and key[0].startswith("ssm"):
            print(f"calibration {key}: {count:.0f} observed, {accepted / count:.3f} accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
