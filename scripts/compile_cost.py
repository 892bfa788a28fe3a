"""One model pass compiled by torch.compile (inductor) against the same forward run eagerly.

    python scripts/compile_cost.py [--model PATH] [--rows 1] [--repeats 20] [--cache-dir DIR]

Three arms over the same 300-token context, passes alternating between them, median of each:
the forward with CPU weights packed for oneDNN (the engine's default), the forward with plain
weights, and the plain forward compiled by inductor (`dynamic=True`, frozen weights). It prints
their costs, the compile time, and how far the compiled logits are from the eager ones.
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
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cache-dir", type=Path)
    args = ap.parse_args()
    configure_cpu_runtime()
    import torch
    import torch._inductor.config as inductor

    from specinfer.engine.models.checkpoint import engine_weights, load_state_dict
    from specinfer.engine.models.config import ModelConfig
    from specinfer.engine.models.transformer import DecoderModel
    from specinfer.engine.runtime.runner import ModelRunner, chain_work
    from specinfer.model_source import resolve

    path = resolve(args.model, args.cache_dir).path
    cfg = ModelConfig.from_dir(path)
    weights = engine_weights(cfg, load_state_dict(path, torch.float32))
    models = {"packed": DecoderModel(cfg, weights, torch.float32, "cpu"),
              "plain": DecoderModel(cfg, weights, torch.float32, "cpu", is_packed=False),
              "compiled": DecoderModel(cfg, weights, torch.float32, "cpu", is_packed=False)}
    inductor.freezing = True
    models["compiled"].forward = torch.compile(models["compiled"].forward, dynamic=True)
    runners = {name: ModelRunner(m, num_blocks=64, block_size=16) for name, m in models.items()}
    seqs = {}
    for name, runner in runners.items():
        seqs[name] = runner.new_sequence()
        runner.prefill(seqs[name], list(range(100, 400)))
    rows = list(range(500, 500 + args.rows))
    started = time.perf_counter()
    logits = {name: runner.run([chain_work(seqs[name], rows, logits="all")])[0] for name, runner in runners.items()}
    print(f"first passes (the compile included): {time.perf_counter() - started:.1f} s")
    print(f"compiled against plain: max |logit difference| {(logits['compiled'] - logits['plain']).abs().max():.2e}, "
          f"argmax equal: {torch.equal(logits['compiled'].argmax(-1), logits['plain'].argmax(-1))}")
    times = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.run([chain_work(seqs[name], rows, logits="all")])
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name:9s} {1e3 * statistics.median(t[2:]):7.1f} ms a pass of {args.rows} row(s)")


if __name__ == "__main__":
    main()
