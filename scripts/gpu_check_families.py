"""Every model family on a GPU: Triton tree attention (sliding windows included) and CUDA graphs
decode exactly what transformers does, in float32 (SpecInfer Section 4.2: one verification pass
over the whole token tree, with a topology-aware mask).

The test suite runs the same families on the CPU, with Triton's interpreter; this runs them where
the kernels are compiled. Two steps, so the GPU machine needs no transformers:

    python scripts/gpu_check_families.py prepare DIR      # here: random checkpoints (the test
                                                          # suite's builders), make-ssm cuts and
                                                          # transformers' greedy outputs
    python scripts/gpu_check_families.py run DIR OUT.md   # on the GPU: each family x backend x mode

`run` compares, for every family, three backends (SDPA; Triton eager; Triton with CUDA graphs,
the serving default on CUDA) in two modes (plain decoding; dynamic trees of the make-ssm cut plus
`lookup` and `suffix`, every step forced to draft, requests batched and reusing a cached prefix
longer than every window) with transformers' greedy output. Exits 1 on any difference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NEW_TOKENS = 24


def prepare(out: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_families as tf  # the suite's builders and its transformers reference

    from specinfer.pool.make_ssm import make_ssm

    out.mkdir(parents=True, exist_ok=True)
    refs = {}
    for seed, name in enumerate(tf.BUILDERS):
        if name not in tf.FAMILIES:
            continue
        llm = tf.save_family(out / name, tf.BUILDERS[name], seed)
        make_ssm(llm, out / f"{name}-ssm", "0,2", mlp_keep=0.5)
        prompts = [tf.SHARED + p[:6] for p in tf.PROMPTS] + tf.PROMPTS
        refs[name] = {"prompts": prompts, "expected": [tf.hf_generate(llm, p, NEW_TOKENS) for p in prompts]}
        print(name, "ready", flush=True)
    (out / "refs.json").write_text(json.dumps(refs))


def run(models: Path, out: Path) -> int:
    import torch

    from specinfer.engine.drafting.speculator import model_free_member
    from specinfer.engine.llm_engine import Engine, mode_params
    from specinfer.engine.runtime.exec_config import ExecConfig
    from specinfer.engine.runtime.runner import ModelRunner
    from specinfer.params import TreeBudget

    sys.path.insert(0, str(ROOT / "tests"))
    from policies import FixedBudget  # every step drafts, so trees are really grown and verified

    backends = {"sdpa": ExecConfig(attention="sdpa", cuda_graphs=False),
                "triton": ExecConfig(attention="triton", cuda_graphs=False),
                "triton+graphs": ExecConfig(attention="triton", cuda_graphs=True)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # a smoke run of the script itself: SDPA only
        backends = {"sdpa": backends["sdpa"]}
    refs = json.loads((models / "refs.json").read_text())
    lines = ["# Model families on the GPU: float32, greedy, against transformers", "",
             f"{torch.cuda.get_device_name(0) if device == 'cuda' else 'CPU'}, torch {torch.__version__}", "",
             "| family | backend | mode | prompts equal | tokens accepted | largest tree | seconds | LLM graphs |",
             "|---|---|---|---|---|---|---|---|"]
    failures = []

    def replays(r: ModelRunner) -> str:
        graphs = getattr(r, "graphs", None)
        return f" {graphs.num_replays} replays, {graphs.num_fallbacks} eager |" if graphs is not None else " |"

    def runner(path: Path, ex: ExecConfig) -> ModelRunner:
        return ModelRunner.from_dir(path, dtype="float32", device=device, max_kv_tokens=2048, block_size=8,
                                    exec_cfg=ex)

    for name, ref in refs.items():
        prompts, expected = ref["prompts"], ref["expected"]
        shared, plain = prompts[:3], prompts[3:]
        for backend, ex in backends.items():
            started = time.perf_counter()
            llm = runner(models / name, ex)
            engine = Engine.from_runners(llm, [])
            got = [engine.generate(p, mode_params("incremental", NEW_TOKENS)).output_ids for p in plain]
            same = sum(g == e for g, e in zip(got, expected[3:]))
            lines.append(f"| {name} | {backend} | plain | {same}/{len(plain)} | | | "
                         f"{time.perf_counter() - started:.1f} |{replays(llm)}")
            if same != len(plain):
                failures.append(f"{name} {backend} plain")
            started = time.perf_counter()
            engine = Engine.from_runners(runner(models / name, ex), [runner(models / f"{name}-ssm", ex)],
                                         model_free=[model_free_member("lookup"), model_free_member("suffix")])
            engine.load_policy = FixedBudget(TreeBudget(max_nodes=16, max_depth=8, node_cost=0.002, level_cost=0.01))
            first = engine.generate(shared[0], mode_params("auto", NEW_TOKENS))
            later = [engine.start(p, mode_params("auto", NEW_TOKENS)) for p in shared[1:]]
            reused = min(g.session.num_reused for g in later)
            results = [first] + engine.generate_batch(later)
            same = sum(r.output_ids == e for r, e in zip(results, expected[:3]))
            accepted = sum(sum(r.accepted_per_step) for r in results)
            largest = max(n for r in results for n in r.tree_nodes_per_step)
            lines.append(f"| {name} | {backend} | dynamic trees, batched, {reused} tokens reused | "
                         f"{same}/{len(shared)} | {accepted} | {largest} | {time.perf_counter() - started:.1f} |"
                         f"{replays(engine.verifier.runner)}")
            if same != len(shared) or accepted == 0:
                failures.append(f"{name} {backend} trees")
            del engine, llm
            if device == "cuda":
                torch.cuda.empty_cache()
            out.write_text("\n".join(lines) + "\n")
            print(lines[-2], lines[-1], sep="\n", flush=True)
    lines += ["", f"Failures: {', '.join(failures) or 'none'}"]
    out.write_text("\n".join(lines) + "\n")
    print(lines[-1])
    return 1 if failures else 0


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
        return 0
    if len(sys.argv) >= 4 and sys.argv[1] == "run":
        os.environ.setdefault("TRITON_INTERPRET", "0")
        return run(Path(sys.argv[2]), Path(sys.argv[3]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
