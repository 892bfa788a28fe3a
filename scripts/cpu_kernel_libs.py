"""Two builds of the CPU matrix kernel against each other, over a whole model's weights.

    python scripts/cpu_kernel_libs.py OLD.so NEW.so [--rows 1,2,4,8,16] [--rounds 3] [--model smollm2|reference]
        [--storage float32,bfloat16]

Each library (a `_cpu_gemm*.so` built from `specinfer/engine/layers/cpu_gemm.c`, for example with
`gcc -O3 -fopenmp -std=c11 -shared -fPIC cpu_gemm.c -o OLD.so`) multiplies `--rows` rows by every
weight matrix of the model's shape in turn (SmolLM2-135M: 30 layers and the 49,152-token head,
538 MB; or the reference LLM's 8 layers), random weights (bfloat16 values, as a bfloat16 checkpoint
gives) laid out by `cpu_gemm.pack` in each library's `--storage` (the same library twice with
`--storage float32,bfloat16` compares the two panel formats): one
pass of the products of a tree of that many nodes, the weights coming from memory, not the
caches. The libraries alternate, 7 timed passes each per round; it prints the median
milliseconds a pass per row count, and whether the two libraries' sums are bitwise equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specinfer.engine.layers import cpu_gemm
from specinfer.engine.runtime.cpu import configure_cpu_runtime

SHAPES = {  # (hidden, intermediate, kv width, layers, vocabulary)
    "smollm2": (576, 1536, 192, 30, 49152),
    "reference": (512, 1408, 256, 8, 8192),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("libs", nargs=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--storage", default="float32,float32", help="each library's panel type, comma-separated")
    args = ap.parse_args()
    storages = [getattr(torch, name) for name in args.storage.split(",")]
    configure_cpu_runtime()
    threads = torch.get_num_threads()
    hidden, inter, kv, layers, vocab = SHAPES[args.model]
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
              (hidden, inter)] * layers + [(vocab, hidden)]
    gen = torch.Generator().manual_seed(0)
    weights = [((torch.randn(n, k, generator=gen) * 0.05).bfloat16().float(), n, k) for n, k in shapes]
    mats = [[(cpu_gemm.pack(w, storage), n, k) for w, n, k in weights] for storage in storages]
    del weights
    rows = [int(r) for r in args.rows.split(",")]
    xs = {m: [torch.randn(m, k, generator=gen) for _, _, k in mats[0]] for m in rows}
    libs = [cpu_gemm.load(path) for path in args.libs]
    if None in libs:
        raise SystemExit("a library did not load, or this CPU runs neither of its paths")
    outs = [{m: [torch.empty(m, n) for _, n, _ in mats[0]] for m in rows} for _ in libs]

    def run(i: int, m: int) -> float:
        lib, isa = libs[i]
        start = time.perf_counter()
        for (panels, n, k), x, y in zip(mats[i], xs[m], outs[i][m]):
            lib.specinfer_gemm(panels.data_ptr(), cpu_gemm._FORMATS[panels.dtype], x.data_ptr(), y.data_ptr(), m, n,
                               k, isa, threads)
        return time.perf_counter() - start

    times = [{m: [] for m in rows} for _ in libs]
    for i in range(len(libs)):
        for m in rows:
            run(i, m)
    for r in range(args.rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            for m in rows:
                times[i][m].extend(run(i, m) for _ in range(7))
    megabytes = [sum(p.numel() * p.element_size() for p, _, _ in m) / 1e6 for m in mats]
    print(f"{args.model}: {len(mats[0])} matrices, {megabytes[0]:.0f} / {megabytes[1]:.0f} MB, {threads} threads")
    print("rows  " + "  ".join(f"{path.split('/')[-1] + ' ' + str(s)[6:]:>24}" for path, s in zip(args.libs, storages))
          + "   old / new")
    for m in rows:
        old, new = (1000 * statistics.median(t[m]) for t in times)
        print(f"{m:4d}  {old:21.2f} ms  {new:21.2f} ms   {old / new:.3f}x")
    same = all(torch.equal(a, b) for m in rows for a, b in zip(outs[0][m], outs[1][m]))
    print(f"bitwise equal sums: {same}")


if __name__ == "__main__":
    main()
