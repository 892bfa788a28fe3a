"""One LLM pass's cost with the CPU weights packed for oneDNN against plain `F.linear`, by rows.

    python scripts/pass_cost.py [--model PATH] [--rows 1,2,8,16] [--repeats 20] [--cache-dir DIR]

Both arms hold the same model (a checkpoint directory or a GGUF file) over the same 300-token
context; passes of each row count alternate between the arms, and the median of each (the first
two left out) is printed with the ratio packed / plain.
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
    ap.add_argument("--rows", default="1,2,8,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cache-dir", type=Path)
    args = ap.parse_args()
    configure_cpu_runtime()
    import specinfer.engine.models.transformer as transformer
    from specinfer.engine.runtime.runner import ModelRunner, chain_work
    from specinfer.model_source import resolve

    source = resolve(args.model, args.cache_dir)
    can_pack = transformer.can_pack
    runners = {}
    for arm in ("plain", "packed"):
        transformer.can_pack = can_pack if arm == "packed" else (lambda *_: False)
        runners[arm] = ModelRunner.from_dir(source.path, "float32", "cpu", 4096)
    transformer.can_pack = can_pack
    rows = [int(r) for r in args.rows.split(",")]
    seqs = {}
    for arm, runner in runners.items():
        seqs[arm] = runner.new_sequence()
        runner.prefill(seqs[arm], list(range(100, 400)))
    times = {(arm, n): [] for arm in runners for n in rows}
    for _ in range(args.repeats):
        for n in rows:
            for arm, runner in runners.items():
                work = chain_work(seqs[arm], list(range(500, 500 + n)), logits="all")
                start = time.perf_counter()
                runner.run([work])
                times[(arm, n)].append(time.perf_counter() - start)
    for n in rows:
        plain, packed = (statistics.median(times[(arm, n)][2:]) for arm in ("plain", "packed"))
        print(f"rows {n:3d}: plain {plain * 1e3:7.1f} ms  packed {packed * 1e3:7.1f} ms  packed/plain {packed / plain:.2f}")


if __name__ == "__main__":
    main()
