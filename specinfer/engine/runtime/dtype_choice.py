"""The SSMs' dtype, chosen at load time: the fastest on this machine, measured once and cached.

An SSM only proposes tokens and the LLM verifies every one of them, so the dtype an SSM computes
in never changes the output, only how fast it drafts. Which dtype is fastest depends on the
machine: a CPU with bf16 instructions runs a small SSM's pass in about half the fp32 time, one
without them emulates bf16 and is slower; a GPU is fastest in half precision. So `auto` (the
default of every entry point) measures instead of guessing.

`load_ssm` with `auto` reads the checkpoint once and builds a small runner per candidate dtype
(on a CPU float32, bfloat16 where the CPU runs it at all, and `q8_0` where the matrix kernel is
built: float32 arithmetic over the matrices rounded to 8-bit block codes, a quarter of the bytes a
pass streams; on CUDA bfloat16, float16 and float32), each casting the same weights with a KV cache
in its own dtype. It times their
forward passes on the shapes of one token-tree level (1, 4 and 8 new tokens over a ~128-token
context, within the model's context), candidates and shapes interleaved, the fastest of several
repeats each (at least `TRIAL_REPEATS` rounds, more until `TRIAL_MIN_S` of passes were timed, so
that a neighbour busy for a moment does not decide; fewer on a machine so loaded that the passes
take `TRIAL_MAX_S`), and keeps the dtype with the lowest mean
time per pass; within `TIE_TOLERANCE` of
it, the preferred dtype (the LLM's) wins. A candidate that fails or computes non-finite logits
is dropped. The runner returned is built in the chosen dtype, its KV cache too.

When the repeats spread so far apart that the machine was busy, the candidates are timed again
(`machine_cache.is_busy`), keeping each one's fastest pass.

The choice is cached in `CACHE_FILE` under a cache directory (`machine_cache`), keyed by what
decides it: the device (the CPU's model and instruction flags, or the CUDA device's name), torch's
version and thread count, the attention backend, the candidates, the preferred dtype, the SSM's
architecture (family, layers, sizes, heads, attention
windows, vocabulary) and its weights' content (`weights_digest`: a
boost-tuned SSM written where its untuned cut was is another SSM), so a later load measures
nothing. A choice measured on a machine that stayed busy is used but not cached. Without a cache
directory, or with one that cannot be written, every load measures again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime import machine_cache
from specinfer.engine.runtime.exec_config import ExecConfig
from specinfer.engine.runtime.machine_cache import (  # noqa: F401 (device_name, key_id: their names here too)
    MAX_ATTEMPTS, device_name, key_id, machine_key, read_entry, weights_digest, write_entry,
)
from specinfer.engine.scheduling.policy import is_busy
from specinfer.limits import AUTO_DTYPE, MODEL_DTYPES, Q8_DTYPE
from specinfer.engine.layers import cpu_gemm
from specinfer.engine.runtime.runner import ModelRunner, Work
from specinfer.engine.runtime.backend import resolve_exec
from specinfer.engine.models.checkpoint import engine_weights, load_state_dict

log = logging.getLogger(__name__)

CACHE_FILE = "ssm-dtype.json"
CACHE_VERSION = 2  # bumped when the measurement changes, so older choices are measured again
TRIAL_SIZES = (1, 4, 8)  # new tokens per timed pass: one tree level's worth
TRIAL_CONTEXT = 128  # committed tokens the timed passes attend to
TRIAL_REPEATS = 3  # timed rounds per candidate and size (after one warm-up round); the fastest counts
TRIAL_MIN_S = 0.2  # more rounds until the timed passes took this long in all...
TRIAL_MAX_REPEATS = 50  # ...but never more rounds than this
TRIAL_MAX_S = 1.0  # and no further round once they took this long (at least one timed round)
TRIAL_EMBED_ROWS = 1024  # token embedding rows a trial runner holds (`trial_weights`); trial tokens lie below
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
    is_busy: bool = False  # measured while the machine stayed busy: not cached

    def describe(self) -> str:
        """'dtype bfloat16 (measured: bf16 0.61 ms, fp32 1.20 ms per pass)'."""
        if not self.ms_per_pass:
            return f"dtype {self.dtype} (no candidate could be measured)"
        timings = ", ".join(f"{SHORT_NAMES.get(d, d)} {ms:.2f} ms"
                            for d, ms in sorted(self.ms_per_pass.items(), key=lambda item: item[1]))
        how = "measured earlier" if self.is_cached else "measured while the machine was busy, not cached" \
            if self.is_busy else "measured"
        return f"dtype {self.dtype} ({how}: {timings} per pass)"

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "ms_per_pass": dict(self.ms_per_pass), "cached": self.is_cached}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def runner_dtype(runner) -> str:
    """The dtype name a runner was built with: its model's dtype, or `Q8_DTYPE` over block codes."""
    return Q8_DTYPE if getattr(runner.model, "is_q8_0", False) else dtype_name(runner.model.dtype)


# ---- what the choice depends on ------------------------------------------------------------------
def runs_bfloat16(device) -> bool:
    """Whether bf16 matrix products work on `device` at all (how fast is what `auto` measures)."""
    try:
        x = torch.ones(4, 4, dtype=torch.bfloat16, device=device)
        return bool((x @ x == 4).all())
    except (RuntimeError, TypeError):
        return False


def candidates(device) -> list[str]:
    """The dtypes `auto` times on `device`: on a CPU with the matrix kernel, 8-bit block codes too."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return (["bfloat16"] if torch.cuda.is_bf16_supported() else []) + ["float16", "float32"]
    return ["float32"] + (["bfloat16"] if runs_bfloat16(dev) else []) + ([Q8_DTYPE] if cpu_gemm.available() else [])


def cache_key(cfg: ModelConfig, device, attention: str, prefer: str, cands: list[str],
              cpuinfo: str | None = None, weights: str = "") -> dict:
    """Everything the choice depends on, as plain JSON (`weights`: the SSM's `weights_digest`)."""
    return {
        "version": CACHE_VERSION,
        **machine_key(device, cpuinfo),
        "attention": attention,
        "prefer": prefer,
        "candidates": list(cands),
        "model": {name: _plain(getattr(cfg, name)) for name in ARCHITECTURE_FIELDS},
        "weights": weights,
    }


def _plain(value):
    """A config value as JSON reads it back (tuples are lists there), so a cached key compares equal."""
    return list(value) if isinstance(value, tuple) else value


# ---- the cache -----------------------------------------------------------------------------------
def read_cached(cache_dir: Path | None, key: dict) -> DtypeChoice | None:
    """The cached choice for `key`, or None (no cache, no entry, or an unreadable file)."""
    entry = read_entry(cache_dir, CACHE_FILE, key)
    try:
        dtype, ms = entry["dtype"], {str(d): float(t) for d, t in entry["ms_per_pass"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if dtype not in key["candidates"]:
        return None
    return DtypeChoice(dtype, ms, is_cached=True)


def write_cached(cache_dir: Path | None, key: dict, choice: DtypeChoice) -> bool:
    """Adds `choice` to the cache file; False when there is no cache directory or it cannot be written."""
    return write_entry(cache_dir, CACHE_FILE, key, {"dtype": choice.dtype, "ms_per_pass": choice.ms_per_pass})


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
            timer: TimePass | None = None, repeats: int = TRIAL_REPEATS, min_seconds: float = TRIAL_MIN_S,
            max_repeats: int = TRIAL_MAX_REPEATS, max_seconds: float = TRIAL_MAX_S) -> tuple[dict[str, float], bool]:
    """Milliseconds per pass of each candidate that works: the mean over the trial sizes of the
    fastest of at least `repeats` timed passes (more, up to `max_repeats`, until `min_seconds` of
    passes were timed; fewer, at least one, once `max_seconds` were), all timed again while their
    repeats spread as on a busy machine (up to `MAX_ATTEMPTS` times); and whether the machine stayed
    busy. `make_runner(dtype)` builds a runner whose KV holds the trial context and the largest
    trial level."""
    sizes, _ = trial_shapes(cfg)
    runners, works = _trial_runners(make_runner, cands, cfg)
    if not runners:
        return {}, False
    best = {dtype: {n: float("inf") for n in sizes} for dtype in runners}
    for _ in range(MAX_ATTEMPTS):
        samples = _timed_rounds(runners, works, sizes, timer, repeats, min_seconds, max_repeats, max_seconds)
        for (dtype, n), times in samples.items():
            best[dtype][n] = min([best[dtype][n], *times])
        busy = is_busy(samples)
        if not busy:
            break
    return {dtype: round(1000 * sum(per.values()) / len(per), 4) for dtype, per in best.items()}, busy


def trial_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights the trial runners are built from: the SSM's own, but for the token embedding's
    rows past `TRIAL_EMBED_ROWS`. Looking a token up costs the same in any table, and the
    embedding is most of a draft's weights, so the candidates do not each hold a copy of it in
    their dtype. The LM head stays whole (tied to the embedding or not): its product is what a pass
    costs."""
    return {**weights, "embed": weights["embed"][:TRIAL_EMBED_ROWS]}


def _trial_runners(make_runner: Callable[[str], object], cands: list[str], cfg: ModelConfig) -> tuple[dict, dict]:
    """Each candidate that works: its runner, and its trial passes by size over the trial context
    (their tokens below `TRIAL_EMBED_ROWS`)."""
    sizes, context = trial_shapes(cfg)
    vocab = min(cfg.vocab_size, TRIAL_EMBED_ROWS)
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
    return runners, works


def _timed_rounds(runners: dict, works: dict, sizes: list[int], timer: TimePass, repeats: int, min_seconds: float,
                  max_repeats: int, max_seconds: float) -> dict[tuple[str, int], list[float]]:
    """A warm-up round, then timed rounds (see `measure`), candidates interleaved so that a busy
    moment hits them alike; every timed pass by (candidate, size)."""
    samples: dict[tuple[str, int], list[float]] = {(dtype, n): [] for dtype in runners for n in sizes}
    order = list(runners)
    timed, r = 0.0, 0  # r: rounds run, the warm-up included
    while r <= max_repeats:
        for dtype in order[r % len(order):] + order[: r % len(order)]:
            for n in sizes:
                seconds = (timer or time_pass)(runners[dtype], works[dtype][n])
                if r:  # the first round is a warm-up
                    samples[(dtype, n)].append(seconds)
                    timed += seconds
        r += 1
        if (r > 1 and timed >= max_seconds) or (r > repeats and timed >= min_seconds):
            break
    return samples


def cached_choice(cfg: ModelConfig, device, exec_cfg: ExecConfig, prefer: str = "float32",
                  cache_dir: Path | None = None, cpuinfo: str | None = None, weights_id: str = "") -> DtypeChoice | None:
    """The choice `choose_dtype` cached for this machine and SSM, or None."""
    key = cache_key(cfg, device, exec_cfg.attention, prefer, candidates(device), cpuinfo, weights_id)
    return read_cached(cache_dir, key)


def choose_dtype(cfg: ModelConfig, weights: dict[str, torch.Tensor], device, exec_cfg: ExecConfig,
                 prefer: str = "float32", cache_dir: Path | None = None, timer: TimePass | None = None,
                 cpuinfo: str | None = None, weights_id: str = "", report: Callable[[str], None] | None = None
                 ) -> DtypeChoice:
    """The cached choice for this machine and SSM (`weights_id`: its `weights_digest`), else one
    measured now (told to `report` first: it takes a moment) and cached unless the machine stayed busy."""
    cached = cached_choice(cfg, device, exec_cfg, prefer, cache_dir, cpuinfo, weights_id)
    if cached is not None:
        return cached
    return measure_choice(cfg, weights, device, exec_cfg, prefer, cache_dir, timer, cpuinfo, weights_id, report)


def measure_choice(cfg: ModelConfig, weights: dict[str, torch.Tensor], device, exec_cfg: ExecConfig,
                   prefer: str = "float32", cache_dir: Path | None = None, timer: TimePass | None = None,
                   cpuinfo: str | None = None, weights_id: str = "", report: Callable[[str], None] | None = None
                   ) -> DtypeChoice:
    """`choose_dtype`'s choice measured now, whatever is cached (cached unless the machine stayed busy)."""
    cands = candidates(device)
    key = cache_key(cfg, device, exec_cfg.attention, prefer, cands, cpuinfo, weights_id)
    sizes, context = trial_shapes(cfg)
    trial_exec = replace(exec_cfg, cuda_graphs=False, offload=False)  # the passes themselves, nothing captured

    trial = trial_weights(weights)

    def make_runner(dtype: str):
        return ModelRunner.from_weights(cfg, trial, dtype, device, max_kv_tokens=context + max(sizes),
                                        exec_cfg=trial_exec)

    if report is not None:
        report(f"measuring which dtype runs it fastest here ({', '.join(cands)})")
    load = machine_cache.LoadCheck(device)
    ms, busy = measure(make_runner, cands, cfg, timer)
    busy = busy or load.was_loaded()
    if not ms:  # nothing ran: the preferred dtype, whose load reports what is wrong
        return DtypeChoice(prefer if prefer in MODEL_DTYPES else "float32", {})
    choice = DtypeChoice(pick(ms, prefer), ms, is_busy=busy)
    if not busy:
        write_cached(cache_dir, key, choice)
    return choice


def load_ssm(model_dir: str | Path, dtype: str, device: str, max_kv_tokens: int, exec_cfg: ExecConfig | None = None,
             prefer: str = "float32", cache_dir: Path | None = None, report: Callable[[str], None] | None = None,
             timer: TimePass | None = None):
    """An SSM's runner in `dtype`; with "auto", in the dtype `choose_dtype` picks (preferring
    `prefer`, the LLM's, on ties), reported on one line through `report` (default: logged) and
    kept as the runner's `dtype_choice`."""
    if dtype != AUTO_DTYPE:
        return ModelRunner.from_dir(model_dir, dtype=dtype, device=device, max_kv_tokens=max_kv_tokens,
                                    exec_cfg=exec_cfg)
    cfg = ModelConfig.from_dir(model_dir)
    ex = resolve_exec(exec_cfg or ExecConfig(), device)
    tell = report or log.info
    weights_id = weights_digest(model_dir, cache_dir)
    choice = cached_choice(cfg, device, ex, prefer, cache_dir, weights_id=weights_id)
    if choice is not None:  # read a weight at a time, as any model loads: no state dict beside it
        runner = ModelRunner.from_dir(model_dir, choice.dtype, device, max_kv_tokens, exec_cfg=ex)
    else:  # the state dict read once serves the trial runners of every dtype, then the one chosen
        weights = engine_weights(cfg, load_state_dict(model_dir))
        choice = measure_choice(cfg, weights, device, ex, prefer, cache_dir, timer, weights_id=weights_id,
                                report=lambda line: tell(f"SSM {Path(model_dir).name}: {line}"))
        runner = ModelRunner.from_weights(cfg, weights, choice.dtype, device, max_kv_tokens, exec_cfg=ex)
    runner.dtype_choice = choice
    tell(f"SSM {Path(model_dir).name}: {choice.describe()}")
    return runner
