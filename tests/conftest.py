from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from util import perturbed_copy, save_tiny_llama


# Tiny models gain nothing from intra-op threads, and on a shared, noisy CI machine OpenMP
# threads that wait on each other make small ops orders of magnitude slower.
torch.set_num_threads(1)


@dataclass(frozen=True)
class TinyPair:
    llm: Path
    ssms: tuple[Path, ...]
    vocab: int


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> TinyPair:
    """A random LLM (GQA) and two SSMs that are noisy copies of it: they agree often, not always."""
    root = tmp_path_factory.mktemp("tiny_pair")
    llm = save_tiny_llama(root / "llm", vocab=128, hidden=64, layers=2, heads=4, kv_heads=2,
                          intermediate=128, max_pos=512, seed=1)
    ssm1 = perturbed_copy(llm, root / "ssm1", noise=0.04, seed=11)
    ssm2 = perturbed_copy(llm, root / "ssm2", noise=0.07, seed=12)
    return TinyPair(llm, (ssm1, ssm2), 128)


@pytest.fixture(scope="session")
def greedy_prompts(tiny_pair) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(2, tiny_pair.vocab) for _ in range(rng.randrange(1, 40))] for _ in range(20)]
