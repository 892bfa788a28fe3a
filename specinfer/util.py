"""Small helpers shared by the CLI and the SSM pool tooling: where models are cached, files that
appear whole or not at all, and quiet progress reporting.

Torch-free and cheap to import: the CLI reads its cache location from here before any model code
is loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

CACHE_DIR_ENV = "SPECINFER_CACHE_DIR"
# The environment of a child Python started with `-m` (the stack's services, the background draft
# build): started from a source checkout, it would import the checkout's `specinfer` before the
# installed one, since the current directory comes first on its path, and a checkout installed with
# `pip install .` holds no compiled CPU kernel. PYTHONSAFEPATH (Python 3.11 on) keeps the current
# directory off the path; an editable install and PYTHONPATH still resolve as they do.
CHILD_PYTHON_ENV = {"PYTHONSAFEPATH": "1"}


def default_cache_dir(flag: str | Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """Where models are built and cached: `--cache-dir`, else $SPECINFER_CACHE_DIR (of `env`,
    default the process's environment), else ~/.cache/specinfer."""
    if flag:
        return Path(flag)
    value = (os.environ if env is None else env).get(CACHE_DIR_ENV)
    return Path(value) if value else Path.home() / ".cache" / "specinfer"


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Calls `write` on a temporary sibling of `path`, then renames it to `path`: a reader sees
    the old file, or none, or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    """Writes `obj` as indented JSON, atomically (`write_atomic`)."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8"))


@contextlib.contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary sibling of `out_dir` to write into; moved into place, replacing any old
    `out_dir`, when the block succeeds, and deleted either way, so no half-written directory
    ever stands at `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0, leave: bool = False):
    """A tqdm bar on stderr; a silent one when not `enabled`."""
    from tqdm.auto import tqdm  # numpy and more: not at CLI start-up, which imports this module

    return tqdm(total=total, desc=desc, disable=not enabled, leave=leave, dynamic_ncols=True, initial=initial)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silences transformers' progress bars and load reports (e.g. 'Writing model shards'), then
    restores them."""
    from transformers.utils import logging as hf_logging  # transformers: only where it is already in use

    had_bars = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if had_bars:
            hf_logging.enable_progress_bar()
