from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from util import perturbed_copy, save_text_pair, save_tiny_llama


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (minutes each: the chaos suite's stack-level scenarios)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes long; runs only with --run-slow (scripts/chaos.py runs them all)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Tiny models gain nothing from intra-op threads, and on a shared, noisy CI machine OpenMP
# threads that wait on each other make small ops orders of magnitude slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def hermetic_cache_dir(tmp_path_factory):
    """What the product measures at load time (the SSMs' dtype) is cached under the cache dir:
    the tests, and the processes they start, use a fresh one instead of the user's."""
    import os

    from specinfer.util import CACHE_DIR_ENV

    before = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("specinfer-cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = before


@pytest.fixture(autouse=True)
def unloaded_machine(monkeypatch):
    """A measurement begun while other work keeps every CPU busy is not cached
    (`machine_cache.is_loaded`): in process, the tests see a machine with CPUs to spare, whatever
    else runs beside them (a test of that rule patches it back)."""
    from specinfer.engine.runtime import machine_cache

    real = machine_cache.is_loaded
    monkeypatch.setattr(machine_cache, "is_loaded", lambda *args, **kwargs: False)
    return real


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


@pytest.fixture(scope="module")
def pair_runners(tiny_pair):
    """(LLM runner, [SSM runners]) over the tiny pair, one set per test module (they hold KV)."""
    from specinfer.engine.runtime.runner import ModelRunner

    llm = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=8192)
    ssms = [ModelRunner.from_dir(p, max_kv_tokens=8192) for p in tiny_pair.ssms]
    return llm, ssms


@pytest.fixture(scope="session")
def text_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(llm, ssm) with a BPE tokenizer trained on a little Python and no EOS, for the services
    that take text (the gateway, the whole stack)."""
    corpus = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "for x in range(3):\n    print(x)\n"]
    return save_text_pair(tmp_path_factory.mktemp("text_pair"), 320, corpus * 30, hidden=48, max_pos=512, seed=8,
                          ssm_seed=9, noise=0.04)


@pytest.fixture(scope="session")
def eos_text_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Like `text_pair`, with `</s>` (token 1) as EOS: structured output ends where its grammar does."""
    corpus = ['{"name": "add", "args": 2}\n', "def add(a, b):\n    return a + b\n", "import os\nimport sys\n"]
    return save_text_pair(tmp_path_factory.mktemp("eos_text_pair"), 320, corpus * 30, hidden=48, max_pos=512,
                          seed=5, ssm_seed=6, noise=0.04, eos_token_id=1)


@pytest.fixture(scope="session")
def greedy_prompts(tiny_pair) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(2, tiny_pair.vocab) for _ in range(rng.randrange(1, 40))] for _ in range(20)]


@pytest.fixture
def executor():
    """Threads for calls that block. Submit work here rather than to bare threads: what a call
    raises (an assertion included) comes back through its future, on the test's thread. Exiting
    does not wait, so a call stuck by a bug fails the test through a result timeout instead of
    hanging it."""
    pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="test")
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)
