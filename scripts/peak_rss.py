"""Peak resident memory of a command and every process it starts (`specinfer up` and its children).

    python scripts/peak_rss.py [--interval-s 0.2] -- specinfer up --llm DIR --prompt hi --once

Samples /proc every `--interval-s`: the sum of the RSS of the command's process tree at each
sample, and the highest sum seen. Also each process's own peak (VmHWM), read at its last sample:
their sum bounds the tree's peak from above (the processes need not peak together). Prints one
JSON object on stdout after the command exits, with its exit code. Linux only; no dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}


def _kib(status: dict[str, str], field: str) -> int:
    value = status.get(field, "0 kB").strip().split()
    return int(value[0]) if value else 0


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def label(pid: int) -> str:
    """'services.verifier' for `python -m services.verifier`, else the program's name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    names = [os.path.basename(a) for a in argv[:2] if a]
    return names[-1] if names else "?"


def tree(root: int) -> list[int]:
    """`root` and its descendants, now."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += _children(pid)
    return pids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval-s", type=float, default=0.2)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given")
    proc = subprocess.Popen(command)
    peak_kib, peak_at, hwm, names = 0, 0.0, {}, {}
    start = time.monotonic()
    while proc.poll() is None:
        total = 0
        for pid in tree(proc.pid):
            status = _status(pid)
            if not status:
                continue
            total += _kib(status, "VmRSS")
            hwm[pid] = max(hwm.get(pid, 0), _kib(status, "VmHWM"))
            names.setdefault(pid, label(pid))
        if total > peak_kib:
            peak_kib, peak_at = total, time.monotonic() - start
        time.sleep(args.interval_s)
    result = {
        "exit_code": proc.returncode,
        "peak_total_rss_mib": round(peak_kib / 1024, 1),
        "peak_at_s": round(peak_at, 1),
        "sum_of_process_peaks_mib": round(sum(hwm.values()) / 1024, 1),
        "process_peaks_mib": {f"{pid} {names[pid]}": round(kib / 1024, 1) for pid, kib in sorted(hwm.items())},
        "wall_s": round(time.monotonic() - start, 1),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
