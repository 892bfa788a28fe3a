"""The demo models' text: the ``*.py`` sources of Python's own standard library.

Every machine that runs specinfer has them, so the demo models (`specinfer.pool.demo_models`) need
no download. Files are split into training and held-out files by a hash of their relative path,
the same on every machine; benchmark prompts are cut from held-out files only.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from specinfer.pool.demo_budget import DemoBudget

# Directories of the stdlib that are not ordinary library code: test suites, vendored wheels,
# generated tables (codecs) and the pydoc help text (one 700 kB string).
EXCLUDED_DIR_NAMES = frozenset(
    {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages", "ensurepip",
     "encodings", "pydoc_data", "lib-dynload"}
)
EXCLUDED_FILE_PREFIXES = ("_sysconfigdata",)
HELDOUT_MODULUS = 20  # a file is held out when hash(relative path) % 20 == 0: about 5%


@dataclass(frozen=True)
class Corpus:
    """The stdlib split: relative POSIX paths under `stdlib`."""

    stdlib: Path
    train: tuple[str, ...]
    heldout: tuple[str, ...]

    def read(self, rel: str) -> str:
        return (self.stdlib / rel).read_text(encoding="utf-8", errors="replace")


def stdlib_corpus(stdlib: Path | None = None) -> Corpus:
    """Every library `*.py` file of the running Python, split into training and held-out files."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    rels = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if _is_library_file(p.relative_to(root))
    )
    if not rels:
        raise RuntimeError(f"no Python sources found under {root}")
    return Corpus(stdlib=root, train=tuple(r for r in rels if not is_heldout(r)),
                  heldout=tuple(r for r in rels if is_heldout(r)))


def is_heldout(rel: str) -> bool:
    """Fixed, machine-independent choice of held-out files by hashing the relative path."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def _is_library_file(rel: Path) -> bool:
    if set(rel.parts[:-1]) & EXCLUDED_DIR_NAMES:
        return False
    return not rel.name.startswith(EXCLUDED_FILE_PREFIXES)


def eval_texts(heldout_texts: Sequence[str], budget: "DemoBudget") -> list[str]:
    """Enough held-out text for `eval_windows` windows (code is about 3.6 characters per token)."""
    needed = 4 * budget.eval_windows * budget.seq_len
    texts, total = [], 0
    for text in heldout_texts:
        texts.append(text)
        total += len(text)
        if total >= needed:
            break
    return texts


def heldout_prompts(corpus: Corpus, budget: "DemoBudget", seed: int) -> list[str]:
    """`num_prompts` prompts of whole lines, starting at a line start, from the held-out files."""
    rng = random.Random(seed)
    lo, hi = budget.prompt_chars
    files = [io.StringIO(corpus.read(rel)).readlines() for rel in corpus.heldout]  # split at "\n" only
    files = [lines for lines in files if sum(map(len, lines)) >= lo]
    prompts: list[str] = []
    attempts = 0
    while len(prompts) < budget.num_prompts and attempts < 50 * budget.num_prompts:
        lines = files[attempts % len(files)]
        attempts += 1
        prompt = _prompt_from(lines, rng.randrange(len(lines)), rng.randint(lo, (lo + hi) // 2), hi)
        if prompt and prompt not in prompts:
            prompts.append(prompt)
    return prompts


def _prompt_from(lines: Sequence[str], first: int, lo: int, hi: int) -> str | None:
    """Lines from `first` until at least `lo` characters; None if that overshoots `hi`."""
    if not lines[first].strip():
        return None
    text = ""
    for line in lines[first:]:
        text += line
        if len(text) >= lo:
            return text if len(text) <= hi else None
    return None


def write_prompts(path: Path, prompts: Sequence[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
