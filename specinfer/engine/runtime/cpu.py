"""CPU runtime settings that must be in place before the first matrix multiply.

Plain Python (no torch import): the command line and the model services call this first.
"""

from __future__ import annotations

import os
from pathlib import Path


def configure_cpu_runtime() -> None:
    """Must run before the first matrix multiply (MKL reads it when it initialises). MKL picks
    slow small-matrix kernels on non-Intel CPUs unless told which code path to use; AVX-512
    machines get the AVX-512 path. An explicit MKL_CBWR in the environment wins."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    if " avx512f" in flags:
        os.environ.setdefault("MKL_CBWR", "AVX512")
