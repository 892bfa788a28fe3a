"""Where a decoding step's time goes: the engine's own step, profiled by operator, against the
memory traffic its weights need.

    python scripts/step_profile.py [--model PATH] [--tokens 32] [--rows 1,8] [--cache-dir DIR]

For one model (a checkpoint directory or a GGUF file), in float32 on the CPU:

1. the floor: the bytes of weights one pass reads, over this machine's measured read bandwidth
   (the median of several sums over a buffer far larger than the caches);
2. plain decoding (`Engine.generate`, mode incremental, `--tokens` new tokens after a 300-token
   prompt) under torch's profiler: milliseconds a token by operator category (the weights' matrix
   products, attention, norms and element-wise operators, everything else), and the rest of the
   wall time, which no operator accounts for (Python, the scheduler, sampling, the profiler);
3. one bare model pass of each `--rows` count over the same context (the runner alone, no
   engine), timed without the profiler: the cost of a verification pass of that many tree nodes,
   and how much of it the CPU kernel's matrix products take;
4. a one-row pass over that context held in one run of cache blocks and in scattered blocks (as
   after a cached system prompt): what gathering the paged KV cache costs, unprofiled.

The operators with the most time of their own (`--top`) are listed after the categories.

It prints a table and writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

from specinfer.engine.runtime.cpu import configure_cpu_runtime

CATEGORIES = (  # (category, substrings of operator names), first match wins
    ("matrix products (weights)", ("linear", "addmm", "aten::mm", "matmul", "mkldnn")),
    ("attention", ("scaled_dot_product", "flash_attention", "_softmax", "baddbmm", "bmm")),
    ("norms, RoPE, activations", ("mul", "add", "rsqrt", "pow", "mean", "silu", "gelu", "neg", "cat", "tanh",
                                  "div", "sub")),
    ("copies, indexing, embedding", ("copy", "index", "embedding", "slice", "select", "view", "reshape", "to",
                                     "cat", "contiguous", "transpose", "unsqueeze", "split", "chunk", "clone",
                                     "empty", "zeros", "fill", "stack", "as_strided", "_unsafe", "expand")),
)


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other operators (sampling, argmax, ...)"


def read_bandwidth_gbs(num_mib: int = 512, repeats: int = 7) -> float:
    import torch

    buf = torch.ones(num_mib * 2**20 // 4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / statistics.median(times) / 1e9


class KernelTimer:
    """Wall time spent inside the CPU matrix kernel's products (`cpu_gemm.gemm`, `gemm_codes`,
    which `layers.linear` calls through the module): torch's profiler does not see them."""

    def __init__(self):
        from specinfer.engine.layers import cpu_gemm

        self.seconds, self.calls = 0.0, 0
        for name in ("gemm", "gemm_codes"):
            setattr(cpu_gemm, name, self._timed(getattr(cpu_gemm, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed

    def take(self) -> tuple[float, int]:
        """(seconds, calls) since the last take."""
        out = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("../shared/models/reference-llm"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--top", type=int, default=12, help="operators listed by their own time")
    ap.add_argument("--cache-dir", type=Path)
    args = ap.parse_args()
    configure_cpu_runtime()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specinfer.engine.llm_engine import mode_params
    from specinfer.engine.runtime.assemble import load_engine
    from specinfer.engine.runtime.load import ModelPaths
    from specinfer.engine.runtime.runner import chain_work
    from specinfer.model_source import resolve

    source = resolve(args.model, args.cache_dir)
    engine = load_engine(ModelPaths(source.path), "float32", "cpu", max_kv_tokens=4096, report=lambda _: None)
    runner = engine.verifier.runner
    model = runner.model
    weights = getattr(model, "w", None) or getattr(getattr(model, "model", None), "w", {})
    # the bytes each matrix is stored in (float32, 16-bit panels or a GGUF's block codes)
    read_per_pass = sum(t.numel() * t.element_size() for name, t in weights.items()
                        if name.endswith((".qkv", ".o", ".gate_up", ".down", "lm_head", "norm")))
    bandwidth = read_bandwidth_gbs()
    floor_ms = read_per_pass / bandwidth / 1e6
    print(f"model {args.model}: {read_per_pass / 1e6:.0f} MB of weights read a pass; read bandwidth "
          f"{bandwidth:.1f} GB/s with {torch.get_num_threads()} threads -> floor {floor_ms:.1f} ms a pass")

    kernel = KernelTimer()
    prompt = list(range(100, 400))
    params = mode_params("incremental", args.tokens)
    engine.generate(prompt, mode_params("incremental", 4))  # warm-up
    wall = []
    for _ in range(3):
        start = time.perf_counter()
        out = engine.generate(prompt, params)
        wall.append((time.perf_counter() - start) / len(out.output_ids))
    kernel.take()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        out = engine.generate(prompt, params)
        profiled_s = time.perf_counter() - start
    kernel_s, kernel_calls = kernel.take()
    num = len(out.output_ids)
    by_cat: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.key_averages():
        if evt.key.startswith("aten::") or evt.key.startswith("mkldnn::") or evt.key.startswith("prim::"):
            by_cat[category(evt.key)] += evt.self_cpu_time_total / 1e3
            counts[category(evt.key)] += evt.count
    if kernel_calls:
        by_cat["matrix products (the CPU kernel)"] += 1e3 * kernel_s
        counts["matrix products (the CPU kernel)"] += kernel_calls
    ops_ms = sum(by_cat.values())
    print(f"\nplain decoding, {num} tokens after a {len(prompt)}-token prompt: {1e3 * statistics.median(wall):.1f} ms "
          f"a token unprofiled (median of 3 runs); profiled {1e3 * profiled_s / num:.1f} ms a token")
    print(f"{'category':40s} {'ms/token':>9s} {'share':>6s} {'ops/token':>10s}")
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"{cat:40s} {ms / num:9.2f} {ms / (1e3 * profiled_s):6.1%} {counts[cat] / num:10.0f}")
    rest = 1e3 * profiled_s - ops_ms
    print(f"{'no operator (Python, scheduler, profiler)':40s} {rest / num:9.2f} {rest / (1e3 * profiled_s):6.1%}")
    print(f"\nthe {args.top} operators with the most time of their own:")
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
    for evt in top:
        print(f"  {evt.key:40s} {evt.self_cpu_time_total / 1e3 / num:7.2f} ms/token {evt.count / num:6.0f} calls/token")

    seq = runner.new_sequence()
    runner.prefill(seq, prompt)
    rows = [int(r) for r in args.rows.split(",")]
    times = {n: [] for n in rows}
    in_kernel = {n: [] for n in rows}
    for _ in range(args.repeats):
        for n in rows:
            work = chain_work(seq, list(range(500, 500 + n)), logits="all")
            kernel.take()
            start = time.perf_counter()
            runner.run([work])
            times[n].append(time.perf_counter() - start)
            in_kernel[n].append(kernel.take()[0])
    print("\nbare model passes over the same context (median):")
    for n in rows:
        ms = 1e3 * statistics.median(times[n][2:])
        kernel_ms = 1e3 * statistics.median(in_kernel[n][2:])
        print(f"  rows {n:3d}: {ms:7.1f} ms  ({ms / floor_ms:.1f}x the floor)"
              + (f"; the CPU kernel's matrix products {kernel_ms:.1f} ms, the rest {ms - kernel_ms:.1f} ms"
                 if kernel_ms else ""))

    # The same context in blocks that are not one run (as after a cached system prompt, whose
    # blocks the request's own do not follow): attention gathers it instead of slicing it.
    scattered = runner.new_sequence()
    runner.prefill(scattered, prompt[:96])
    gap = runner.allocator.allocate(1)
    runner.prefill(scattered, prompt[96:])
    gathered = {"one run of blocks": seq, "scattered blocks": scattered}
    times = {name: [] for name in gathered}
    for _ in range(args.repeats):
        for name, s in gathered.items():
            start = time.perf_counter()
            runner.run([chain_work(s, [500], logits="all")])
            times[name].append(time.perf_counter() - start)
    print(f"\none-row passes over the {len(prompt)}-token context (median; contiguous: "
          f"{seq.contiguous_start(len(prompt)) is not None}, {scattered.contiguous_start(len(prompt)) is not None}):")
    for name in gathered:
        print(f"  {name:18s} {1e3 * statistics.median(times[name][2:]):7.1f} ms")
    runner.allocator.free(gap)


if __name__ == "__main__":
    main()
