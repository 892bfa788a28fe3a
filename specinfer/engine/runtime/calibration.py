"""The load-aware policy's cost model of the LLM (`scheduling.policy.CostModel`), calibrated once
per model and machine: timed at start-up, then read from the cache directory by every later start.

The load-aware policy prices each step's tree with what an LLM pass of n tokens costs on this
machine (SpecInfer Section 6.2: the gains shrink as the batch grows). Timing that costs seconds on a
quiet machine and a minute or more on a loaded one, so the result is cached (`machine_cache`),
keyed by the machine (device, torch, threads), how the LLM runs (dtype, attention backend, CUDA
graphs, tensor-parallel ranks), its architecture and the sizes timed. Its weights' values do not
change what a pass costs, so a fine-tuned LLM of the same architecture shares the entry. Every
measured pass refines the model afterwards (`CostModel.observe`), cached or not.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from specinfer.engine.layers.linear import Panels
from specinfer.engine.runtime.dtype_choice import ARCHITECTURE_FIELDS, dtype_name
from specinfer.engine.runtime import machine_cache
from specinfer.engine.runtime.machine_cache import MAX_ATTEMPTS, machine_key, read_entry, write_entry
from specinfer.engine.scheduling.policy import CostModel
from specinfer.limits import CALIBRATION_CONTEXT, CALIBRATION_SIZES

log = logging.getLogger(__name__)

CACHE_FILE = "cost-model.json"
CACHE_VERSION = 2  # bumped when the calibration changes, so older ones are measured again
SIZES, CONTEXT = CALIBRATION_SIZES, CALIBRATION_CONTEXT  # tokens per timed pass; committed tokens they attend to
REPEATS = 5  # timed rounds (after a warm-up round); each size's fastest counts
MAX_SECONDS = 30.0  # no further round past this (a loaded machine): its result is busy, not cached


def calibration_key(runner, cpuinfo: str | None = None) -> dict:
    """Everything the calibration depends on, as plain JSON."""
    model = runner.model
    context, sizes = CostModel.fit_shape(runner, SIZES, CONTEXT)
    group = getattr(getattr(model, "leader", None), "group", None)
    return {
        "version": CACHE_VERSION,
        **machine_key(model.device, cpuinfo),
        "dtype": dtype_name(model.dtype),
        "attention": model.attention_name,
        "cuda_graphs": runner.graphs is not None,
        "num_ranks": getattr(group, "num_ranks", 1),
        "model": {name: getattr(runner.cfg, name) for name in ARCHITECTURE_FIELDS},
        "weight_storage": weight_storage(model),
        "sizes": sizes,
        "context": context,
    }


def weight_storage(model) -> list[str]:
    """How the model's matrices are stored for the CPU kernel (float32, 16-bit panels, a GGUF's
    block codes), which sets what a pass costs as much as the architecture does: sorted kinds."""
    weights = getattr(model, "w", None) or {}
    return sorted({str(getattr(w.data, "dtype", type(w.data).__name__)) for w in weights.values()
                   if isinstance(w, Panels)})


def describe(model: CostModel) -> str:
    return ", ".join(f"{n}:{t * 1e3:.1f}ms" for n, t in model.points)


def calibrated_cost_model(runner, cache_dir: Path | None = None, report: Callable[[str], None] | None = None,
                          timer=None, cpuinfo: str | None = None) -> CostModel:
    """The LLM's cost model: from `cache_dir` when this machine calibrated this model before, else
    timed now (told to `report` before and after: it takes a while) and cached unless the machine
    stayed busy throughout."""
    tell = report or log.info
    key = calibration_key(runner, cpuinfo)
    entry = read_entry(cache_dir, CACHE_FILE, key)
    try:
        points = [(int(n), float(t)) for n, t in entry["points"]] if entry is not None else None
    except (KeyError, TypeError, ValueError):
        points = None
    if points:
        model = CostModel(points)
        tell(f"LLM cost model calibrated earlier on this machine: {describe(model)}")
        return model
    tell(f"calibrating the LLM cost model for load-aware speculation: passes of {SIZES[0]}-{SIZES[-1]} tokens, "
         f"the fastest of {REPEATS} each (once per model and machine{'' if cache_dir else '; no cache directory'})")
    started = time.perf_counter()
    load = machine_cache.LoadCheck(runner.model.device)
    model = CostModel.calibrate(runner, SIZES, CONTEXT, REPEATS, timer=timer, max_attempts=MAX_ATTEMPTS,
                                max_seconds=MAX_SECONDS)
    model.is_busy = model.is_busy or load.was_loaded()
    busy = "; the machine was busy: not cached, measured again at the next start" if model.is_busy else ""
    tell(f"calibrated in {time.perf_counter() - started:.1f}s: {describe(model)}{busy}")
    if not model.is_busy:
        write_entry(cache_dir, CACHE_FILE, key, {"points": [list(p) for p in model.points]})
    return model
