"""One pass's cost with the matrices as they are stored against the same model in float32 panels.

    python scripts/storage_pass_cost.py [--model PATH] [--rows 1,4,8,16] [--repeats 20] [--cache-dir DIR]

The CPU kernel keeps a bfloat16 or float16 checkpoint's matrices in 16 bits and a GGUF's
quantized ones as their block codes (`specinfer/engine/layers/cpu_gemm.py`). Both arms hold the
same model (a checkpoint directory or a GGUF file) over the same 300-token context, one as stored
and one with every matrix in float32 panels; passes of each row count alternate between the arms.
It prints the median of each (the first two left out), the ratio, and whether the two arms'
logits are bitwise equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specinfer.engine.runtime.cpu import configure_cpu_runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("../shared/models/reference-llm"))
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cache-dir", type=Path)
    args = ap.parse_args()
    configure_cpu_runtime()
    import torch

    from specinfer.engine.layers import cpu_gemm, linear
    from specinfer.engine.runtime.calibration import weight_storage
    from specinfer.engine.runtime.runner import ModelRunner, chain_work
    from specinfer.model_source import resolve

    source = resolve(args.model, args.cache_dir)
    exact_storage, defines = cpu_gemm.exact_storage, linear._defines
    runners = {}
    for arm in ("float32", "as stored"):
        if arm == "float32":
            cpu_gemm.exact_storage, linear._defines = (lambda w: torch.float32), (lambda codes, w: False)
        else:
            cpu_gemm.exact_storage, linear._defines = exact_storage, defines
        runners[arm] = ModelRunner.from_dir(source.path, "float32", "cpu", 4096)
    print(f"{args.model}: matrices stored as {weight_storage(runners['as stored'].model)}")
    rows = [int(r) for r in args.rows.split(",")]
    seqs = {}
    for arm, runner in runners.items():
        seqs[arm] = runner.new_sequence()
        runner.prefill(seqs[arm], list(range(100, 400)))
    times = {(arm, n): [] for arm in runners for n in rows}
    logits = {}
    for _ in range(args.repeats):
        for n in rows:
            for arm, runner in runners.items():
                work = chain_work(seqs[arm], list(range(500, 500 + n)), logits="all")
                start = time.perf_counter()
                logits[arm, n] = runner.run([work])[0]
                times[arm, n].append(time.perf_counter() - start)
    print("rows   float32 ms   as stored ms   float32 / as stored   same logits")
    for n in rows:
        wide, stored = (1000 * statistics.median(times[arm, n][2:]) for arm in runners)
        same = torch.equal(logits["float32", n], logits["as stored", n])
        print(f"{n:4d}   {wide:10.2f}   {stored:12.2f}   {wide / stored:19.2f}   {same}")


if __name__ == "__main__":
    main()
