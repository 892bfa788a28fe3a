"""CPU runtime settings that must be in place before the first matrix multiply.

Plain Python (no torch import): the command line and the model services call this first.
"""

from __future__ import annotations

import os
from pathlib import Path


# How long an idle OpenMP thread spins before it sleeps. GNU OpenMP's default (300,000 spins
# when no wait policy is set) is longer than a decoding pass's gaps between parallel regions last
# on a machine whose cores are busy with other processes: the spinning threads then take the cores
# the working ones need, and a pass of SmolLM2 on 2 threads went from 31 ms to a median of 842 ms.
# 10,000 spins still cover the gaps of an idle machine (the same 51-52 ms a pass there).
GOMP_SPINCOUNT = "10000"


def configure_cpu_runtime() -> None:
    """Must run before torch is imported (GNU OpenMP reads its settings when torch loads it) and
    before the first matrix multiply (MKL reads its own when it initialises). OpenMP threads
    spin briefly before sleeping (`GOMP_SPINCOUNT`). MKL picks slow small-matrix kernels on
    non-Intel CPUs unless told which code path to use; AVX-512 machines get the AVX-512 path.
    Settings already in the environment win."""
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    if " avx512f" in flags:
        os.environ.setdefault("MKL_CBWR", "AVX512")
