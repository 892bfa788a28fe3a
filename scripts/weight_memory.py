"""What a model's weights take once loaded: the bytes of every weight it holds, the process's
resident memory once it is loaded, its peak while loading, and what the KV plan counts for them.

    python scripts/weight_memory.py MODEL [--dtype float32]

MODEL is a checkpoint directory or a GGUF file. Linux only (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import gc
import sys

from specinfer.engine.layers.embedding import CodedTable
from specinfer.engine.runtime.memory import weight_bytes
from specinfer.engine.runtime.runner import ModelRunner

MIB = 2 ** 20


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    before = _status_mib("VmRSS")
    model = ModelRunner.from_dir(args.model, args.dtype, "cpu", 64).model
    gc.collect()
    weights = {id(t): t for t in model.w.values()}.values()  # a tied head's tensor once
    held = sum(t.nbytes() if isinstance(t, CodedTable) else t.numel() * t.element_size() for t in weights)
    print(f"weights held {held / MIB:.1f} MiB; resident {_status_mib('VmRSS'):.0f} MiB once loaded "
          f"({before:.0f} before), peak {_status_mib('VmHWM'):.0f} MiB; the KV plan counts "
          f"{weight_bytes(args.model, args.dtype) / MIB:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
