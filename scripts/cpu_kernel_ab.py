"""The CPU matrix kernel against oneDNN's packed weights, the same model loaded both ways.

    python scripts/cpu_kernel_ab.py [--model PATH] [--tokens 32] [--rows 1,4,8,16] [--rounds 6] [--avx2]

For one model (a checkpoint directory or a GGUF file), in float32 on the CPU, two engines are
loaded: one with the weights in the kernel's panels (`layers/cpu_gemm.c`, the default where it is
built) and one with oneDNN's layout (what the engine uses without the kernel). Arms alternate,
each round in the other order:

1. plain decoding (`Engine.generate`, mode incremental, `--tokens` new tokens after a 300-token
   prompt): milliseconds a token, median over rounds, and whether both decode the same tokens;
2. one bare model pass of each `--rows` count (the cost of verifying a tree of that many nodes).

`--avx2` runs the kernel's AVX2 path on a CPU that also has AVX-512 (what a CPU without AVX-512
runs; the sums are bitwise the same). It prints a table and writes nothing.
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
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cache-dir", type=Path)
    ap.add_argument("--avx2", action="store_true", help="the kernel's AVX2 path even where AVX-512 is found")
    args = ap.parse_args()
    configure_cpu_runtime()
    from specinfer.engine.layers import cpu_gemm
    from specinfer.engine.llm_engine import mode_params
    from specinfer.engine.runtime.assemble import load_engine
    from specinfer.engine.runtime.load import ModelPaths
    from specinfer.engine.runtime.runner import chain_work
    from specinfer.model_source import resolve

    if not cpu_gemm.available():
        raise SystemExit("the CPU kernel is not built for this machine (pip install . builds it with a C compiler)")
    if args.avx2:
        lib, _ = cpu_gemm._library()
        cpu_gemm._library = lambda: (lib, 1)
    path = resolve(args.model, args.cache_dir).path

    def load():
        return load_engine(ModelPaths(path), "float32", "cpu", max_kv_tokens=4096, report=lambda _: None)

    engines = {"kernel": load()}
    available = cpu_gemm.available
    cpu_gemm.available = lambda: False
    try:
        engines["oneDNN"] = load()
    finally:
        cpu_gemm.available = available

    prompt = list(range(100, 400))
    params = mode_params("incremental", args.tokens)
    rows = [int(r) for r in args.rows.split(",")]
    seqs = {}
    for arm, engine in engines.items():
        engine.generate(prompt, mode_params("incremental", 4))  # warm-up
        runner = engine.verifier.runner
        seqs[arm] = runner.new_sequence()
        runner.prefill(seqs[arm], prompt)
    per_token = {arm: [] for arm in engines}
    per_pass = {(arm, n): [] for arm in engines for n in rows}
    outputs = {}
    order = list(engines)
    for rnd in range(args.rounds):
        for arm in (order if rnd % 2 == 0 else order[::-1]):
            engine = engines[arm]
            start = time.perf_counter()
            out = engine.generate(prompt, params)
            per_token[arm].append((time.perf_counter() - start) / len(out.output_ids))
            outputs[arm] = out.output_ids
            runner = engine.verifier.runner
            for n in rows:
                work = chain_work(seqs[arm], list(range(500, 500 + n)), logits="all")
                start = time.perf_counter()
                runner.run([work])
                per_pass[(arm, n)].append(time.perf_counter() - start)
    base, new = (statistics.median(per_token[a]) for a in ("oneDNN", "kernel"))
    print(f"model {args.model}{' (AVX2 path)' if args.avx2 else ''}: plain decoding, {args.tokens} tokens after a {len(prompt)}-token prompt, "
          f"{args.rounds} rounds")
    print(f"  oneDNN {1e3 * base:.1f} ms a token, kernel {1e3 * new:.1f} ms: {base / new:.2f}x; "
          f"same tokens: {outputs['oneDNN'] == outputs['kernel']}")
    print("bare passes over the same context (median):")
    for n in rows:
        b, k = (statistics.median(per_pass[(a, n)]) for a in ("oneDNN", "kernel"))
        print(f"  rows {n:3d}: oneDNN {1e3 * b:6.1f} ms, kernel {1e3 * k:6.1f} ms: {b / k:.2f}x")


if __name__ == "__main__":
    main()
