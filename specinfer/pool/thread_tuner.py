"""Torch threads that follow the machine's load, for long CPU training runs.

Building the demo models (`specinfer.pool.demo_models`) trains for minutes on whatever CPUs the
machine has; other processes come and go meanwhile. `ThreadTuner` keeps torch on as many threads
as there are CPUs left free. Parallel reductions split differently on another thread count, so
the count can change the last bits of the trained weights (not how well they are trained).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator

import torch


@contextlib.contextmanager
def restore_threads() -> Iterator[None]:
    """Restores torch's thread count on exit."""
    previous = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class ThreadTuner:
    """Keeps torch on as many threads as there are CPUs that other processes leave free.

    With one thread per core, a core shared with another busy process stalls every parallel
    region: on two cores a training step took 5x longer on 2 threads, 2x on 1. So the count is
    re-checked every `every` steps from /proc/stat (all CPU time, less this process's own). A
    build is bitwise reproducible for a given seed, budget and sequence of thread counts.
    """

    def __init__(self, every: int = 20):
        self.every = every
        self.cpus = _usable_cpus()
        self.used: list[int] = []
        self._set(self._free(_busy_cpus()))
        self._last = _cpu_snapshot()

    @property
    def current(self) -> int:
        return self.used[-1]

    def step(self, step: int) -> None:
        if step == 0 or step % self.every:
            return
        snapshot = _cpu_snapshot()
        if snapshot is not None and self._last is not None:
            self._set(self._free(_others_busy(self._last, snapshot)))
        self._last = snapshot

    def _free(self, busy: float) -> int:
        return max(1, min(self.cpus, int(self.cpus - busy + 0.5)))

    def _set(self, count: int) -> None:
        if not self.used or count != self.used[-1]:
            torch.set_num_threads(count)
        self.used.append(count)


def _cpu_snapshot() -> tuple[int, int, int] | None:
    """(all CPU jiffies, idle jiffies, this process's jiffies) from /proc; None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields), idle, int(own[11]) + int(own[12])  # utime + stime


def _others_busy(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    """CPUs kept busy by other processes between two snapshots."""
    total, idle, own = (a - b for a, b in zip(after, before))
    if total <= 0:
        return 0.0
    return max(0.0, (total - idle - own) / total * (os.cpu_count() or 1))


def _busy_cpus(window_s: float = 0.3) -> float:
    """How many CPUs other processes use right now (we sleep meanwhile); 0 when unknown."""
    before = _cpu_snapshot()
    time.sleep(window_s)
    after = _cpu_snapshot()
    return 0.0 if before is None or after is None else _others_busy(before, after)


def _usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)
