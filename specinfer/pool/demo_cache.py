"""Where the demo models live and how a build becomes visible: directory names, the manifest,
and the move of a finished build into place.

A build writes into a temporary sibling directory (its name carries the building process's id)
and writes ``manifest.json`` last; only then is it renamed into place. A directory without a
valid manifest, or one whose files are missing, is never used, so a crashed or concurrent build
never passes for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

from specinfer.pool.demo_budget import DemoBudget
from specinfer.pool.demo_pretrained import DemoPaths
from specinfer.util import write_json

DEFAULT_DEMO_DIR_NAME = "demo-models-v1"
MANIFEST_NAME = "manifest.json"
PROMPTS_NAME = "prompts.jsonl"
HELDOUT_NAME = "heldout_files.json"
TRAINING_NAME = "training.json"
MANIFEST_FORMAT = 1
PARTIAL_MARK = ".partial-"


def demo_dir_name(budget: DemoBudget, seed: int) -> str:
    """The default build keeps the plain name; any other budget/seed gets its own directory."""
    if budget == DemoBudget.full() and seed == 0:
        return DEFAULT_DEMO_DIR_NAME
    blob = json.dumps({"budget": asdict(budget), "seed": seed, "format": MANIFEST_FORMAT}, sort_keys=True)
    return f"{DEFAULT_DEMO_DIR_NAME}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def load_demo_paths(root: Path, budget: DemoBudget | None = None, seed: int | None = None) -> DemoPaths | None:
    """The paths of a complete build at `root` (of `budget` and `seed`, when given), else None."""
    manifest_path = Path(root) / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != MANIFEST_FORMAT or not manifest.get("complete"):
            return None
        if budget is not None and manifest["budget"] != json.loads(json.dumps(asdict(budget))):
            return None
        if seed is not None and manifest["seed"] != seed:
            return None
        paths = DemoPaths.from_manifest(Path(root), manifest)
        files = [paths.prompts] + [Path(root) / f for f in manifest["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return paths if all(f.is_file() for f in files) else None


def new_partial_dir(cache_dir: Path, name: str) -> Path:
    """A fresh temporary build directory for `name` in `cache_dir`, first deleting those of
    builds whose process is gone."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(cache_dir, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}{PARTIAL_MARK}{os.getpid()}-", dir=cache_dir))
    tmp.chmod(0o755)  # mkdtemp makes it private; the finished cache is an ordinary directory
    return tmp


def write_manifest(out_dir: Path, budget: DemoBudget, seed: int, metrics: dict, minutes: float) -> None:
    files = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    manifest = {
        "format": MANIFEST_FORMAT,
        "complete": True,
        "llm": "llm",
        "ssms": [f"ssm-{i}" for i in range(budget.num_ssms)],
        "prompts": PROMPTS_NAME,
        "heldout_files": HELDOUT_NAME,
        "seed": seed,
        "budget": asdict(budget),
        "python": sys.version.split()[0],
        "torch": version("torch"),
        "metrics": metrics,
        "build_minutes": round(minutes, 3),
        "files": files,
    }
    write_json(out_dir / MANIFEST_NAME, manifest)


def move_into_place(tmp: Path, root: Path, budget: DemoBudget, seed: int, replace_complete: bool) -> DemoPaths:
    """Renames the finished build `tmp` to `root`, replacing an incomplete, stale or forced old one."""
    existing = load_demo_paths(root, budget, seed)
    if existing is not None and not replace_complete:
        return existing  # another process finished first
    if root.exists():
        trash = root.with_name(f".{root.name}{PARTIAL_MARK}{os.getpid()}-old-{time.time_ns()}")
        os.rename(root, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, root)
    except OSError:
        existing = load_demo_paths(root, budget, seed)  # lost a race to a concurrent build
        if existing is None:
            raise
        return existing
    paths = load_demo_paths(root)
    if paths is None:
        raise RuntimeError(f"demo model build at {root} is incomplete")
    return paths


def remove_stale_partials(cache_dir: Path, name: str) -> None:
    """Deletes temporary build dirs of `name` whose building process is gone."""
    prefix = f".{name}{PARTIAL_MARK}"
    for path in cache_dir.glob(prefix + "*"):
        pid_text = path.name[len(prefix):].split("-", 1)[0]
        if not pid_text.isdigit() or not _pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
