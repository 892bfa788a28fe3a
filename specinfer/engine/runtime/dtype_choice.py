"""The SSMs' dtype, chosen at load time: the fastest on this machine, measured once and cached.

An SSM only proposes tokens and the LLM verifies every one of them, so the dtype an SSM computes
in never changes the output, only how fast it drafts. Which dtype is fastest depends on the
machine: a CPU with bf16 instructions runs a small SSM's pass in about half the fp32 time, one
without them emulates bf16 and is slower; a GPU is fastest in half precision. So `auto` (the
default of every entry point) measures instead of guessing.

`load_ssm` with `auto` reads the checkpoint once and builds a small runner per candidate dtype
(on a CPU float32, and bfloat16 where the CPU runs it at all; on CUDA bfloat16, float16 and
float32), each casting the same weights with a KV cache in its own dtype. It times their
forward passes on the shapes of one token-tree level (1, 4 and 8 new tokens over a ~128-token
context, within the model's context), candidates and shapes interleaved, the fastest of several
repeats each (at least `TRIAL_REPEATS` rounds, more until `TRIAL_MIN_S` of passes were timed, so
that a neighbour busy for a moment does not decide; fewer on a machine so loaded that the passes
take `TRIAL_MAX_S`), and keeps the dtype with the lowest mean
time per pass; within `TIE_TOLERANCE` of
it, the preferred dtype (the LLM's) wins. A candidate that fails or computes non-finite logits
is dropped. The runner returned is built in the chosen dtype, its KV cache too.

The choice is cached in `CACHE_FILE` under a cache directory, keyed by what decides it: the
device (the CPU's model and instruction flags, or the CUDA device's name), torch's version and
thread count, the attention backend, the candidates, the preferred dtype and the SSM's
architecture (family, layers, sizes, heads, attention windows, vocabulary), so a later load
measures nothing. Without a cache directory, or with one that cannot be written, every load
measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime.exec_config import ExecConfig
from specinfer.limits import AUTO_DTYPE, MODEL_DTYPES

log = logging.getLogger(__name__)

CACHE_FILE = "ssm-dtype.json"
CACHE_VERSION = 1  # bumped when the measurement changes, so older choices are measured again
TRIAL_SIZES = (1, 4, 8)  # new tokens per timed pass: one tree level's worth
TRIAL_CONTEXT = 128  # committed tokens the timed passes attend to
TRIAL_REPEATS = 3  # timed rounds per candidate and size (after one warm-up round); the fastest counts
TRIAL_MIN_S = 0.2  # more rounds until the timed passes took this long in all...
TRIAL_MAX_REPEATS = 50  # ...but never more rounds than this
TRIAL_MAX_S = 1.0  # and no further round once they took this long (at least one timed round)
TIE_TOLERANCE = 0.05  # the preferred dtype wins when within this fraction of the fastest
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ARCHITECTURE_FIELDS = ("architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                       "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias", "mlp_bias", "family",
                       "hidden_act", "layer_types", "sliding_window", "rotary_dim", "is_qk_norm", "is_sandwich_norm")

TimePass = Callable[..., float]  # (runner, work) -> seconds of one forward pass


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype `auto` resolved to, and the measured milliseconds per pass of every candidate."""

    dtype: str
    ms_per_pass: dict[str, float]
    is_cached: bool = False  # read from the cache: measured by an earlier load

    def describe(self) -> str:
        """'dtype bfloat16 (measured: bf16 0.61 ms, fp32 1.20 ms per pass)'."""
        if not self.ms_per_pass:
            return f"dtype {self.dtype} (no candidate could be measured)"
        timings = ", ".join(f"{SHORT_NAMES.get(d, d)} {ms:.2f} ms"
                            for d, ms in sorted(self.ms_per_pass.items(), key=lambda item: item[1]))
        return f"dtype {self.dtype} ({'measured earlier' if self.is_cached else 'measured'}: {timings} per pass)"

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "ms_per_pass": dict(self.ms_per_pass), "cached": self.is_cached}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


# ---- what the choice depends on ------------------------------------------------------------------
def runs_bfloat16(device) -> bool:
    """Whether bf16 matrix products work on `device` at all (how fast is what `auto` measures)."""
    try:
        x = torch.ones(4, 4, dtype=torch.bfloat16, device=device)
        return bool((x @ x == 4).all())
    except (RuntimeError, TypeError):
        return False


def candidates(device) -> list[str]:
    """The dtypes `auto` times on `device`."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return (["bfloat16"] if torch.cuda.is_bf16_supported() else []) + ["float16", "float32"]
    return ["float32"] + (["bfloat16"] if runs_bfloat16(dev) else [])


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


def cache_key(cfg: ModelConfig, device, attention: str, prefer: str, cands: list[str],
              cpuinfo: str | None = None) -> dict:
    """Everything the choice depends on, as plain JSON."""
    dev = torch.device(device)
    return {
        "version": CACHE_VERSION,
        "device": dev.type,
        "device_name": device_name(dev, cpuinfo),
        "torch": torch.__version__,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "attention": attention,
        "prefer": prefer,
        "candidates": list(cands),
        "model": {name: _plain(getattr(cfg, name)) for name in ARCHITECTURE_FIELDS},
    }


def _plain(value):
    """A config value as JSON reads it back (tuples are lists there), so a cached key compares equal."""
    return list(value) if isinstance(value, tuple) else value


def key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


# ---- the cache -----------------------------------------------------------------------------------
def read_cached(cache_dir: Path | None, key: dict) -> DtypeChoice | None:
    """The cached choice for `key`, or None (no cache, no entry, or an unreadable file)."""
    if cache_dir is None:
        return None
    try:
        entries = json.loads((Path(cache_dir) / CACHE_FILE).read_text())
        entry = entries[key_id(key)]
        dtype, ms = entry["dtype"], {str(d): float(t) for d, t in entry["ms_per_pass"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if dtype not in key["candidates"] or entry.get("key") != key:
        return None
    return DtypeChoice(dtype, ms, is_cached=True)


def write_cached(cache_dir: Path | None, key: dict, choice: DtypeChoice) -> bool:
    """Adds `choice` to the cache file (written whole, then renamed into place); False when there
    is no cache directory or it cannot be written."""
    if cache_dir is None:
        return False
    path = Path(cache_dir) / CACHE_FILE
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            entries = json.loads(path.read_text())
            entries = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            entries = {}
        entries[key_id(key)] = {"dtype": choice.dtype, "ms_per_pass": choice.ms_per_pass, "key": key}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.debug("SSM dtype choice not cached in %s: %s", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False


# ---- measuring -----------------------------------------------------------------------------------
def pick(ms_per_pass: dict[str, float], prefer: str, tolerance: float = TIE_TOLERANCE) -> str:
    """The fastest dtype; `prefer` when it is within `tolerance` of the fastest."""
    fastest = min(ms_per_pass, key=ms_per_pass.__getitem__)
    if prefer in ms_per_pass and ms_per_pass[prefer] <= ms_per_pass[fastest] * (1 + tolerance):
        return prefer
    return fastest


def time_pass(runner, work) -> float:
    """Seconds of one forward pass (waiting for the device to finish it)."""
    is_cuda = runner.model.device.type == "cuda"
    if is_cuda:
        torch.cuda.synchronize(runner.model.device)
    start = time.perf_counter()
    runner.run([work])
    if is_cuda:
        torch.cuda.synchronize(runner.model.device)
    return time.perf_counter() - start


def trial_shapes(cfg: ModelConfig) -> tuple[list[int], int]:
    """(new tokens per timed pass, committed context), within the model's context."""
    max_context = cfg.max_context
    sizes = [n for n in TRIAL_SIZES if n < max_context] or [1]
    return sizes, max(0, min(TRIAL_CONTEXT, max_context - max(sizes)))


def measure(make_runner: Callable[[str], object], cands: list[str], cfg: ModelConfig,
            timer: TimePass = time_pass, repeats: int = TRIAL_REPEATS, min_seconds: float = TRIAL_MIN_S,
            max_repeats: int = TRIAL_MAX_REPEATS, max_seconds: float = TRIAL_MAX_S) -> dict[str, float]:
    """Milliseconds per pass of each candidate that works: the mean over the trial sizes of the
    fastest of at least `repeats` timed passes (more, up to `max_repeats`, until `min_seconds` of
    passes were timed; fewer, at least one, once `max_seconds` were). `make_runner(dtype)` builds
    a runner whose KV holds the trial context and the largest trial level."""
    from specinfer.engine.runtime.runner import Work

    sizes, context = trial_shapes(cfg)
    vocab = cfg.vocab_size
    works, runners = {}, {}
    for dtype in cands:
        try:
            runner = make_runner(dtype)
            seq = runner.new_sequence()
            seq.ensure_capacity(context + max(sizes))
            if context:
                runner.prefill(seq, [(31 * i + 1) % vocab for i in range(context)])
            # One tree level: n siblings hanging off the committed prefix.
            works[dtype] = {n: Work(seq, [(7 * i + 3) % vocab for i in range(n)], [context] * n, [-1] * n, "all")
                            for n in sizes}
            logits = runner.run([works[dtype][max(sizes)]])[0]
            if not bool(torch.isfinite(logits).all()):
                log.info("SSM dtype %s dropped: non-finite logits", dtype)
                works.pop(dtype)
                continue
            runners[dtype] = runner
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            log.info("SSM dtype %s dropped: %s", dtype, exc)
            works.pop(dtype, None)
    if not runners:
        return {}
    best = {dtype: {n: float("inf") for n in sizes} for dtype in runners}
    order = list(runners)
    timed, r = 0.0, 0  # r: rounds run, the warm-up included
    while r <= max_repeats:
        for dtype in order[r % len(order):] + order[: r % len(order)]:  # interleaved: a busy moment hits all alike
            for n in sizes:
                seconds = timer(runners[dtype], works[dtype][n])
                if r:  # the first round is a warm-up
                    best[dtype][n] = min(best[dtype][n], seconds)
                    timed += seconds
        r += 1
        if (r > 1 and timed >= max_seconds) or (r > repeats and timed >= min_seconds):
            break
    return {dtype: round(1000 * sum(per.values()) / len(per), 4) for dtype, per in best.items()}


def choose_dtype(cfg: ModelConfig, weights: dict[str, torch.Tensor], device, exec_cfg: ExecConfig,
                 prefer: str = "float32", cache_dir: Path | None = None, timer: TimePass = time_pass,
                 cpuinfo: str | None = None) -> DtypeChoice:
    """The cached choice for this machine and architecture, else one measured now (and cached)."""
    from specinfer.engine.runtime.runner import ModelRunner

    cands = candidates(device)
    key = cache_key(cfg, device, exec_cfg.attention, prefer, cands, cpuinfo)
    cached = read_cached(cache_dir, key)
    if cached is not None:
        return cached
    sizes, context = trial_shapes(cfg)
    trial_exec = replace(exec_cfg, cuda_graphs=False, offload=False)  # the passes themselves, nothing captured

    def make_runner(dtype: str):
        return ModelRunner.from_weights(cfg, weights, dtype, device, max_kv_tokens=context + max(sizes),
                                        exec_cfg=trial_exec)

    ms = measure(make_runner, cands, cfg, timer)
    if not ms:  # nothing ran: the preferred dtype, whose load reports what is wrong
        return DtypeChoice(prefer if prefer in MODEL_DTYPES else "float32", {})
    choice = DtypeChoice(pick(ms, prefer), ms)
    write_cached(cache_dir, key, choice)
    return choice


def load_ssm(model_dir: str | Path, dtype: str, device: str, max_kv_tokens: int, exec_cfg: ExecConfig | None = None,
             prefer: str = "float32", cache_dir: Path | None = None, report: Callable[[str], None] | None = None,
             timer: TimePass = time_pass):
    """An SSM's runner in `dtype`; with "auto", in the dtype `choose_dtype` picks (preferring
    `prefer`, the LLM's, on ties), reported on one line through `report` (default: logged) and
    kept as the runner's `dtype_choice`."""
    from specinfer.engine.runtime.backend import resolve_exec
    from specinfer.engine.models.checkpoint import engine_weights, load_state_dict
    from specinfer.engine.runtime.runner import ModelRunner

    if dtype != AUTO_DTYPE:
        return ModelRunner.from_dir(model_dir, dtype=dtype, device=device, max_kv_tokens=max_kv_tokens,
                                    exec_cfg=exec_cfg)
    cfg = ModelConfig.from_dir(model_dir)
    ex = resolve_exec(exec_cfg or ExecConfig(), device)
    weights = engine_weights(cfg, load_state_dict(model_dir))
    choice = choose_dtype(cfg, weights, device, ex, prefer, cache_dir, timer)
    runner = ModelRunner.from_weights(cfg, weights, choice.dtype, device, max_kv_tokens, exec_cfg=ex)
    runner.dtype_choice = choice
    (report or log.info)(f"SSM {Path(model_dir).name}: {choice.describe()}")
    return runner
