"""How busy other processes keep this machine's CPUs, from the kernel's CPU-time counters.

Two things ask it: a start-up measurement, which is not cached when other work slowed it
(`engine/runtime/machine_cache.py`), and `specinfer up`, whose demo draft, building in the
background, stops while the stack or anything else wants the CPUs (`pool/demo_pretrained.py`).
The one-minute load average lags work that has just started; CPU time spent does not. Linux's
/proc only: elsewhere nothing is measured (None). Plain Python: the launcher imports this.
"""

from __future__ import annotations

import os
import time
from typing import Iterable


class CpuSnapshot:
    """The machine's busy CPU time, and the CPU time of the processes left out of "other work"
    (this one, and `excluded` pids), at one moment."""

    def __init__(self, excluded: Iterable[int] = ()):
        self.excluded = tuple(excluded)
        self.wall_s, self.busy_s, self.own_s = time.monotonic(), machine_busy_s(), self._own_s()

    def _own_s(self) -> float:
        return own_cpu_s() + sum(process_cpu_s(pid) or 0.0 for pid in self.excluded)

    def other_cores(self) -> float | None:
        """Cores other processes kept busy on average since this snapshot, or None (unknown)."""
        busy, wall = machine_busy_s(), time.monotonic() - self.wall_s
        if busy is None or self.busy_s is None or wall <= 0:
            return None
        return max(0.0, (busy - self.busy_s) - (self._own_s() - self.own_s)) / wall


def machine_busy_s() -> float | None:
    """Seconds of CPU time all CPUs have spent busy since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def process_cpu_s(pid: int) -> float | None:
    """CPU time (user + system, all threads) process `pid` has used, or None when it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def process_state(pid: int) -> str | None:
    """The process's state letter (R running, S sleeping, T stopped, Z zombie...), or None when gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces): the state is the first."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()
