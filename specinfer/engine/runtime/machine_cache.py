"""What start-up measures on this machine, measured robustly and cached under the cache directory.

Two things depend on the machine more than on anything a config says: which dtype runs an SSM
fastest (`dtype_choice`) and what an LLM pass of n tokens costs (`calibration`, the load-aware
policy's cost model). Both are measured once and cached under the cache directory (`--cache-dir`,
$SPECINFER_CACHE_DIR, else ~/.cache/specinfer), one JSON file each, keyed by everything that
decides them: the device (the CPU's model and instruction flags, or the CUDA device's name),
torch's version and thread count, and the model (its architecture; an SSM also by its weights'
content, `weights_digest`, so another checkpoint in the same place is measured on its own).

A measurement is the fastest of several repeats (a neighbour busy for a moment slows some repeats,
never speeds one up), and when the repeats spread so far apart that the machine was busy
(`policy.is_busy`), it is measured again; one that stays busy is used but not cached, so that a later,
calmer start measures it again instead of reusing it for good. Nor is one cached that began while
other work kept every CPU busy, or during which other processes kept half a core or more busy
(`is_loaded`): steadily slow repeats do not spread, but they say what this machine does under
that load, not what it can do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

from specinfer.cpu_load import CpuSnapshot
from specinfer.engine.layers import cpu_gemm
from specinfer.engine.models.checkpoint import safetensors_files
from specinfer.limits import OTHER_WORK_CORES

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # measurements of one thing while the machine stays busy
DIGESTS_FILE = "weights-digests.json"


# ---- the machine ---------------------------------------------------------------------------------
def device_name(device, cpuinfo: str | None = None) -> str:
    """The CUDA device's name, or the CPU's model with a digest of its instruction flags (one
    model name may cover CPUs with and without bf16 instructions). `cpuinfo` replaces
    /proc/cpuinfo."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev.index if dev.index is not None else torch.cuda.current_device())
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown cpu"
    flags = fields.get("flags") or fields.get("Features") or ""
    return f"{model} (flags {hashlib.sha256(flags.encode()).hexdigest()[:12]})" if flags else model


def machine_key(device, cpuinfo: str | None = None) -> dict:
    """The machine as a cache key: device kind and name, torch's version, its CPU threads, and on
    a CPU which kernels multiply float32 weights (`layers/cpu_gemm.py` where it is built, else
    oneDNN's): they set what a pass costs."""
    dev = torch.device(device)
    return {
        "device": dev.type,
        "device_name": device_name(dev, cpuinfo),
        "torch": torch.__version__,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "cpu_matmul": (cpu_gemm.kernel_name() if cpu_gemm.available() else "onednn") if dev.type == "cpu" else None,
    }


def is_loaded(device="cpu", load_average: float | None = None, num_cpus: int | None = None,
              since: "CpuSnapshot | None" = None) -> bool:
    """Whether other work keeps this machine's CPUs busy (for a measurement on them).

    Without `since`, now: the one-minute load average above the CPUs this process may use,
    asked before the timing starts, whose own threads would count. With `since` (a snapshot taken
    when the timing started), during it: other processes kept at least `OTHER_WORK_CORES` cores
    busy on average. The load average lags work that starts with the measurement (a build spawned
    a moment before); the CPU time spent meanwhile does not."""
    if torch.device(device).type != "cpu":
        return False
    if since is not None:
        cores = since.other_cores()
        return cores is not None and cores >= OTHER_WORK_CORES
    try:
        load = os.getloadavg()[0] if load_average is None else load_average
    except OSError:
        return False
    if num_cpus is None:
        num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return load > num_cpus


class LoadCheck:
    """Whether other work made a measurement on `device` a busy one (`is_loaded`): other
    processes kept the CPUs busy while it ran, or, where their CPU time is not known (no
    /proc/stat), the CPUs were loaded when it began. Where it is known, the load average is not
    asked: it stays high for a minute after work that has ended (the demo draft's build, stopped
    while the stack starts), and would keep a quiet measurement out of the cache. Made when the
    measurement begins."""

    def __init__(self, device):
        self.device, self.timing = device, CpuSnapshot()
        self.is_loaded_at_start = is_loaded(device) if self.timing.busy_s is None else False

    def was_loaded(self) -> bool:
        return self.is_loaded_at_start or is_loaded(self.device, since=self.timing)


def key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


# ---- the cache files -----------------------------------------------------------------------------
def read_entry(cache_dir: Path | None, file_name: str, key: dict) -> dict | None:
    """The cached value for `key`, or None (no cache, no entry, an unreadable file, another key)."""
    if cache_dir is None:
        return None
    try:
        entry = json.loads((Path(cache_dir) / file_name).read_text())[key_id(key)]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != json.loads(json.dumps(key)):  # as JSON reads it back
        return None
    return entry


def write_entry(cache_dir: Path | None, file_name: str, key: dict, value: dict) -> bool:
    """Adds `value` under `key` to the cache file (written whole, then renamed into place); False
    when there is no cache directory or it cannot be written."""
    if cache_dir is None:
        return False
    path = Path(cache_dir) / file_name
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            entries = json.loads(path.read_text())
            entries = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            entries = {}
        entries[key_id(key)] = {**value, "key": key}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.debug("not cached in %s: %s", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False


# ---- what a checkpoint holds ---------------------------------------------------------------------
def weights_digest(model: str | Path, cache_dir: Path | None = None) -> str:
    """A digest of the checkpoint's content: its config and the sha256 of every weights file (of
    a model that is one file, that file's). A file's hash is computed once and remembered under
    `cache_dir` by its path, size and modification time (the content decides the digest; those
    only say when to hash again)."""
    model = Path(model)
    if model.is_file():
        return _file_sha256(model, cache_dir)[:32]
    total = hashlib.sha256((model / "config.json").read_bytes())
    for path in safetensors_files(model):
        total.update(_file_sha256(path, cache_dir).encode())
    return total.hexdigest()[:32]


def _file_sha256(path: Path, cache_dir: Path | None) -> str:
    stat = path.stat()
    key = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cached = read_entry(cache_dir, DIGESTS_FILE, key)
    if cached is not None and isinstance(cached.get("sha256"), str):
        return cached["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    write_entry(cache_dir, DIGESTS_FILE, key, {"sha256": digest.hexdigest()})
    return digest.hexdigest()
