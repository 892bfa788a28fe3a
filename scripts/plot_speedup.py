"""Draws speedup against concurrency from a `specinfer bench --concurrency` result (JSON) as a PNG:
one line per arm and temperature, each output tokens/s over incremental decoding's in the same run.

    python scripts/plot_speedup.py benchmarks/results/defaults-serving-reference.json \
        benchmarks/speedup-vs-concurrency.png

Needs matplotlib (`pip install matplotlib`); the product does not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="a `specinfer bench --concurrency` JSON result")
    p.add_argument("output", type=Path, help="the PNG to write")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(args.results.read_text())
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for temp_key, levels in report["results"].items():
        temperature = temp_key.split("=", 1)[1]
        concurrencies = sorted(levels, key=int)
        arms = [a for a in levels[concurrencies[0]] if a != "incremental"]
        for arm in arms:
            ys = [levels[c][arm]["speedup_vs_incremental"] for c in concurrencies]
            style = "-" if arm == "defaults" else ":"
            ax.plot([int(c) for c in concurrencies], ys, style, marker="o", label=f"{arm}, T = {float(temperature):g}")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(c) for c in concurrencies], [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s over incremental decoding")
    machine = report.get("machine", {})
    ax.set_title(f"Through the stack: {machine.get('cpu', '')} ({machine.get('num_cpus', '?')} CPUs)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
