"""Where a model comes from: the one place a model path (`--llm`, `--ssm`, `--model`,
`--model-dir`) is understood.

A model is a Hugging Face checkpoint directory (config.json, safetensors weights, tokenizer
files) or one llama.cpp GGUF file. Everything that reads a model's metadata (its config, its
tokenizer, its chat template, its generation config) reads it from `ModelSource.meta_dir`: the
checkpoint directory itself, or, for a GGUF, a directory of the same files made from the file's
metadata (`specinfer.gguf_metadata`) once, under the cache directory, keyed by the file's
identity (path, size, modification time and a hash of its first bytes). The weights are never
copied there: they are read from the GGUF itself on every load (`engine/models/checkpoint.py`).

Torch-free, so the gateway resolves a model path the same way the verifier does.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from specinfer.errors import UserError
from specinfer.gguf_metadata import SHARD_NAME, GGUFMetadata, is_gguf_file, read_gguf
from specinfer.util import default_cache_dir

log = logging.getLogger(__name__)

METADATA_FORMAT = 1  # bump when what is written for a GGUF changes: files made before are remade
HEAD_BYTES = 1 << 20  # the leading bytes hashed into a GGUF's identity (its header's start)
GGUF_CACHE_NAME = "gguf"
SOURCE_FILE = "source.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model path: where its metadata files are, and its GGUF file, if it is one."""

    path: Path  # as given
    meta_dir: Path  # config.json, tokenizer.json, tokenizer_config.json, generation_config.json
    gguf_file: Path | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def name(self) -> str:
        """The model's name: its directory's, or its file's without `.gguf`."""
        return self.path.stem if self.is_gguf else self.path.name

    @property
    def config_file(self) -> Path:
        return self.meta_dir / "config.json"

    @property
    def tokenizer_file(self) -> Path | None:
        """Its tokenizer.json, or None when it has none."""
        path = self.meta_dir / "tokenizer.json"
        return path if path.is_file() else None

    def read_config(self) -> dict:
        """config.json as a dict; UserError, saying what a model is, when there is none or it is malformed."""
        if not self.config_file.is_file():
            ggufs = sorted(p.name for p in self.path.glob("*.gguf"))
            hint = f"; it holds {', '.join(ggufs[:3])}: give the .gguf file itself" if ggufs else ""
            raise UserError(f"no config.json in model directory {self.path} (a model is a checkpoint directory with "
                            f"config.json, or a .gguf file){hint}")
        try:
            return json.loads(self.config_file.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"malformed config.json in {self.path}: {exc}") from exc

    def no_tokenizer(self) -> UserError:
        if self.is_gguf:
            return UserError(f"{self.path} has no tokenizer this loader can build (no tokenizer.ggml.* metadata, "
                             "or a tokenizer type transformers does not convert)")
        return UserError(f"no tokenizer.json in {self.path}")


_lock = threading.Lock()
_resolved: dict[tuple, ModelSource] = {}


def resolve(path: str | Path | ModelSource, cache_dir: Path | None = None) -> ModelSource:
    """The `ModelSource` of a checkpoint directory or a GGUF file; UserError, saying what is
    supported, for anything else. A GGUF's metadata files are made on first use, under
    `cache_dir` (default: `specinfer.util.default_cache_dir()`), else, where that cannot be
    written, under the temporary directory; a process resolves a file once, so the commands and
    services that have a cache directory flag resolve their models with it first."""
    if isinstance(path, ModelSource):
        return path
    path = Path(path)
    if path.is_dir():  # its config.json is checked where a config is needed (a tokenizer alone serves a gateway)
        return ModelSource(path, path)
    if not path.exists():
        raise UserError(f"model not found: {path} (give a checkpoint directory with config.json, or a .gguf file)")
    _check_model_file(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)  # the first resolution's cache_dir holds
    with _lock:  # one thread makes a file's metadata; the others wait and reuse it
        if key not in _resolved or not _is_complete(_resolved[key].meta_dir):  # made, and not deleted since
            _resolved[key] = ModelSource(path, _gguf_meta_dir(path, cache_dir), path)
        return _resolved[key]


def _check_model_file(path: Path) -> None:
    """A file must be a whole GGUF: say what it is otherwise."""
    if path.suffix == ".safetensors" or path.name == "config.json":
        raise UserError(f"{path} is one file of a checkpoint: give its directory ({path.parent}), or a .gguf file")
    if path.suffix in PICKLE_SUFFIXES:
        raise UserError(f"{path} is a pickle checkpoint, which is never loaded (it could run code); convert it to "
                        "safetensors, or give a .gguf file")
    try:
        is_gguf = is_gguf_file(path)
    except OSError as exc:
        raise UserError(f"cannot read the model file {path}: {exc.strerror or exc}") from None
    if not is_gguf:
        raise UserError(f"{path} is not a GGUF file (no GGUF magic); a model is a checkpoint directory with "
                        "config.json, or a .gguf file")
    shard = SHARD_NAME.search(path.name)
    if shard and int(shard.group(2)) > 1:
        raise UserError(f"{path} is shard {int(shard.group(1))} of {int(shard.group(2))} of a split GGUF; merge "
                        "the shards into one file first (llama.cpp: llama-gguf-split --merge FIRST-SHARD OUT.gguf)")


def identity(path: Path) -> str:
    """A key that changes when the file does: its path, size, modification time, the hash of its
    first bytes, and the versions of what reads it."""
    stat = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
    parts = {"format": METADATA_FORMAT, "path": str(path.resolve()), "size": stat.st_size,
             "mtime_ns": stat.st_mtime_ns, "head": head,
             "versions": [_version(p) for p in ("gguf", "transformers", "tokenizers")]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return ""


def _gguf_meta_dir(path: Path, cache_dir: Path | None) -> Path:
    """The metadata directory of a GGUF: found in the cache, or made there (or, where the cache
    cannot be written, in a private temporary directory)."""
    key = identity(path)
    name = f"{path.stem[:60]}-{key}"
    roots = [Path(cache_dir or default_cache_dir()) / GGUF_CACHE_NAME,
             Path(tempfile.gettempdir()) / f"specinfer-{os.getuid()}" / GGUF_CACHE_NAME]
    for root in roots:
        if _is_complete(root / name):
            return root / name
    meta = read_gguf(path)  # UserError for a file that is not a supported GGUF
    for root in roots:
        try:
            return _materialise(path, meta, root / name)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            log.info("cannot write GGUF metadata under %s (%s); trying the next place", root, exc)
    raise UserError(f"cannot write the metadata of {path} under {roots[0]} nor {roots[1]}: set "
                    "SPECINFER_CACHE_DIR to a writable directory")


def _is_complete(meta_dir: Path) -> bool:
    return (meta_dir / SOURCE_FILE).is_file()


def _materialise(path: Path, meta: GGUFMetadata, final: Path) -> Path:
    """Writes the metadata files into a temporary sibling of `final`, then renames it into
    place; when another process got there first, keeps theirs."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        meta.write_files(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(path.resolve())}, indent=2) + "\n")
        tmp.chmod(0o755)
        try:
            tmp.rename(final)
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("GGUF metadata of %s written to %s", path, final)
    return final
