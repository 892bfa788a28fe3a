"""One LLM pass's cost in two arms over the same model, by rows.

    python scripts/pass_cost.py [--model PATH] [--compare layout|storage|ops|library] [--rows 1,2,8,16] [--repeats 20]
        [--context 300] [--baseline-library OLD.so] [--cache-dir DIR]

`--compare layout` (the default): the CPU weights packed for the GEMM kernels against plain
`F.linear`. `--compare storage`: the matrices as the kernel stores them (a bfloat16 or float16
checkpoint's in 16 bits, a GGUF's quantized ones as their block codes) against the same model
with every matrix in float32 panels; it also says whether the two arms' logits are bitwise equal.
`--compare ops`: torch's RMSNorm, RoPE and SDPA against the CPU kernel's (`layers/norms.py`,
`layers/rope.py`, `cpu_gemm.attention`), with the same check of the logits. `--compare library`:
another build of the CPU kernels (`--baseline-library`, a `_cpu_gemm*.so` built from an earlier
version's `layers/cpu_*.c`) against this one's, the same check of the logits.

Both arms hold the same model (a checkpoint directory or a GGUF file) over the same context
(`--context` tokens); passes of each row count alternate between the arms, and the median of each
(the first two left out) is printed with the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specinfer.engine.runtime.cpu import configure_cpu_runtime


def load_arms(path: Path, compare: str) -> dict:
    """The two arms' runners: {name: ModelRunner}, the baseline first (for `library`, the same
    runner twice: the arms differ in the kernel library put in place before each pass)."""
    import torch

    import specinfer.engine.models.transformer as transformer
    from specinfer.engine.layers import cpu_gemm, linear
    from specinfer.engine.layers.norms import rms_norm
    from specinfer.engine.layers.rope import apply_rope
    from specinfer.engine.runtime.runner import ModelRunner

    runners = {}
    if compare == "layout":
        can_pack = transformer.can_pack
        for arm in ("plain", "packed"):
            transformer.can_pack = can_pack if arm == "packed" else (lambda *_: False)
            runners[arm] = ModelRunner.from_dir(path, "float32", "cpu", 4096)
        transformer.can_pack = can_pack
        return runners
    if compare == "library":
        runner = ModelRunner.from_dir(path, "float32", "cpu", 4096)
        return {"baseline library": runner, "this library": runner}
    if compare == "ops":
        norm_for, rope_for = transformer.norm_for, transformer.rope_for
        for arm in ("torch", "kernel"):
            if arm == "torch":
                transformer.norm_for, transformer.rope_for = (lambda *_: rms_norm), (lambda *_: apply_rope)
            runners[arm] = ModelRunner.from_dir(path, "float32", "cpu", 4096)
            runners[arm].model.is_kernel_attention &= arm == "kernel"
            transformer.norm_for, transformer.rope_for = norm_for, rope_for
        return runners
    exact_storage, defines = cpu_gemm.exact_storage, linear._defines
    for arm in ("float32", "as stored"):
        if arm == "float32":
            cpu_gemm.exact_storage, linear._defines = (lambda w: torch.float32), (lambda codes, w: False)
        runners[arm] = ModelRunner.from_dir(path, "float32", "cpu", 4096)
        cpu_gemm.exact_storage, linear._defines = exact_storage, defines
    return runners


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("../shared/models/reference-llm"))
    ap.add_argument("--compare", choices=("layout", "storage", "ops", "library"), default="layout")
    ap.add_argument("--context", type=int, default=300, help="tokens of context before each pass")
    ap.add_argument("--baseline-library", type=Path, help="with --compare library: the other build")
    ap.add_argument("--rows", default="1,2,8,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cache-dir", type=Path)
    args = ap.parse_args()
    configure_cpu_runtime()
    import torch

    from specinfer.engine.layers import cpu_gemm
    from specinfer.engine.runtime.calibration import weight_storage
    from specinfer.engine.runtime.runner import chain_work
    from specinfer.model_source import resolve

    if args.compare == "library" and args.baseline_library is None:
        ap.error("--compare library needs --baseline-library")
    libraries = {"baseline library": cpu_gemm.load(args.baseline_library) if args.baseline_library else None,
                 "this library": cpu_gemm._library()}
    if args.compare == "library" and libraries["baseline library"] is None:
        ap.error(f"{args.baseline_library}: not a kernel library this CPU runs")
    runners = load_arms(resolve(args.model, args.cache_dir).path, args.compare)
    (base, base_runner), (other, other_runner) = runners.items()
    print(f"{args.model}: matrices {base}: {weight_storage(base_runner.model)}, "
          f"{other}: {weight_storage(other_runner.model)}")
    rows = [int(r) for r in args.rows.split(",")]
    seqs = {}
    for arm, runner in runners.items():
        seqs[arm] = runner.new_sequence()
        runner.prefill(seqs[arm], [100 + t % 300 for t in range(args.context)])
    times = {(arm, n): [] for arm in runners for n in rows}
    logits = {}
    for _ in range(args.repeats):
        for n in rows:
            for arm, runner in runners.items():
                if args.compare == "library":
                    cpu_gemm._library = lambda lib=libraries[arm]: lib
                work = chain_work(seqs[arm], list(range(500, 500 + n)), logits="all")
                start = time.perf_counter()
                logits[arm, n] = runner.run([work])[0]
                times[(arm, n)].append(time.perf_counter() - start)
    for n in rows:
        a, b = (statistics.median(times[(arm, n)][2:]) for arm in (base, other))
        diff = (logits[base, n] - logits[other, n]).abs().max().item()
        same = f"  same logits {torch.equal(logits[base, n], logits[other, n])} (at most {diff:.1e} apart)" \
            if args.compare != "layout" else ""
        print(f"rows {n:3d}: {base} {a * 1e3:7.2f} ms  {other} {b * 1e3:7.2f} ms  {base}/{other} {a / b:.2f}{same}")


if __name__ == "__main__":
    main()
