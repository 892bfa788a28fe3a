"""A draft that never makes the defaults worse: a pool member (an SSM) whose measured acceptance
cannot pay for its passes drops out of the dynamic trees (`dynamic.MemberGain`), and the
load-aware policy still speculates with the model-free members (`policy.free_stats`).

Time is a simulated clock: a pass of the LLM takes 10 ms plus 0.05 ms a token, one of an SSM
6 ms, everything else nothing, so that what the policy measures is the same on every machine.
The assertions are on tokens per step."""

from __future__ import annotations

import random
import time

import pytest

from specinfer.engine.drafting.speculator import model_free_member
from specinfer.engine.llm_engine import Engine, EngineConfig, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from util import perturbed_copy, save_tiny_llama

LLM_MS, LLM_MS_PER_TOKEN, SSM_MS = 10.0, 0.05, 6.0


class SimulatedClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def costing(self, runner: ModelRunner, ms: float, ms_per_token: float = 0.0) -> ModelRunner:
        """`runner` whose every pass advances the clock as a pass of that cost would."""
        run = runner.run

        def run_timed(works):
            self.now += (ms + ms_per_token * sum(len(w.token_ids) for w in works)) / 1000
            return run(works)

        runner.run = run_timed
        return runner


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An LLM whose greedy text repeats itself now and then (lookup and suffix get some of it
    right), an SSM of random weights (agrees with it by chance only) and a close copy (agrees often)."""
    root = tmp_path_factory.mktemp("dropout")
    shape = dict(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_pos=1024, init_std=0.1)
    llm = save_tiny_llama(root / "llm", seed=1, **shape)
    useless = save_tiny_llama(root / "useless", seed=99, **shape)
    return {"llm": llm, "useless": useless, "good": perturbed_copy(llm, root / "good", noise=0.02, seed=5)}


@pytest.fixture
def clock(monkeypatch):
    clock = SimulatedClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


def defaults_tokens_per_step(models, clock, ssm: str | None) -> tuple[float, Engine]:
    """`generate`'s defaults (dynamic trees, load-aware) over eight prompts, with lookup and suffix
    and, when named, one SSM."""
    llm = clock.costing(ModelRunner.from_dir(models["llm"], max_kv_tokens=4096), LLM_MS, LLM_MS_PER_TOKEN)
    ssms = [clock.costing(ModelRunner.from_dir(models[ssm], max_kv_tokens=4096), SSM_MS)] if ssm else []
    engine = Engine.from_runners(llm, ssms, EngineConfig(),
                                 model_free=[model_free_member("lookup"), model_free_member("suffix", 0)])
    rng = random.Random(0)
    tokens = steps = 0
    for _ in range(8):
        result = engine.generate([rng.randrange(2, 128) for _ in range(16)], mode_params("auto", 64))
        tokens, steps = tokens + len(result.output_ids), steps + result.num_llm_steps
    return tokens / steps, engine


def test_a_useless_ssm_drops_out_and_the_defaults_keep_their_tokens_per_step(models, clock):
    free, _ = defaults_tokens_per_step(models, clock, None)
    with_useless, engine = defaults_tokens_per_step(models, clock, "useless")
    assert free > 1.5  # the model-free members speculate
    assert with_useless >= 0.97 * free, (with_useless, free)
    gain = engine.source.speculator.member_gain[True].summary(0)
    assert gain["dropped"] and gain["accepted_alone"] < 0.2 and 0 < gain["runs"] < 16


def levels_run(gain, budget) -> int:
    """The levels an SSM sure of every token (probability ~1 for token 5) expands in the next
    step it runs, from a fresh calibration (its prior: the SSM's confidence), no model-free drafts."""
    import torch

    from specinfer.engine.drafting.dynamic import Calibration, DynamicBuild
    from specinfer.params import SamplingParams

    calibration = Calibration()
    for _ in range(gain.FORCE_EVERY):
        build = DynamicBuild(1, 16, budget, SamplingParams(), None, calibration, gain, [], {0: None})
        if build.is_expanding:
            break
    else:
        return 0
    while build.is_expanding:
        rows = torch.full((len(build.frontier), 32), -20.0)
        rows[:, 5] = 20.0
        build.grow({0: rows})
    return build.num_levels


def test_a_dropped_ssms_retrials_run_only_a_few_levels():
    """Out of the trees, a member still runs every `FORCE_EVERY` steps, but only
    `RETRIAL_LEVELS` deep: its optimistic prior must not buy a weak draft deep trees at every
    retrial. A member that pays runs as deep as its values say."""
    from specinfer.engine.drafting.dynamic import MemberGain
    from specinfer.params import TreeBudget

    budget = TreeBudget(max_nodes=24, max_depth=6, node_cost=0.02, level_cost=0.1)
    assert levels_run(MemberGain(), budget) == 6  # judged worth it (its prior): as deep as the budget
    dropped = MemberGain()
    for _ in range(64):  # five nodes and three levels a run, for no accepted token
        dropped.observe(0, 0.0, 0, 5, 3)
    assert levels_run(dropped, budget) == MemberGain.RETRIAL_LEVELS == 2


def test_a_good_ssm_stays_in_and_adds_to_the_model_free_members(models, clock):
    free, _ = defaults_tokens_per_step(models, clock, None)
    with_good, engine = defaults_tokens_per_step(models, clock, "good")
    assert with_good > 1.1 * free, (with_good, free)
    gain = engine.source.speculator.member_gain[True].summary(0)
    assert not gain["dropped"] and gain["accepted_alone"] > 0.3


def test_bench_says_which_member_dropped_out_and_why(clock, tmp_path, capsys, monkeypatch):
    import json

    from specinfer.cli.main import main
    from util import add_tokenizer

    corpus = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "for x in range(3):\n    print(x)\n"]
    shape = dict(vocab=320, hidden=64, heads=4, kv_heads=2, intermediate=128, max_pos=1024, init_std=0.1)
    llm = save_tiny_llama(tmp_path / "llm", seed=1, layers=2, **shape)
    useless = save_tiny_llama(tmp_path / "ssm", seed=99, layers=1, **shape)
    for path in (llm, useless):
        add_tokenizer(path, 320, corpus * 30)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(", "import os", "for x in", "x")))
    run = ModelRunner.run

    def run_timed(runner, works):  # the LLM has two layers, the SSM one
        is_llm = runner.cfg.num_layers == 2
        tokens = sum(len(w.token_ids) for w in works)
        clock.now += ((LLM_MS + LLM_MS_PER_TOKEN * tokens) if is_llm else SSM_MS) / 1000
        return run(runner, works)

    monkeypatch.setattr(ModelRunner, "run", run_timed)
    assert main(["bench", "--llm", str(llm), "--ssm", str(useless), "--prompts", str(prompts), "--max-new-tokens", "64",
                 "--no-transformers", "--device", "cpu", "--cache-dir", str(tmp_path / "cache")]) == 0
    out, err = capsys.readouterr()
    line = next(line for line in err.splitlines() if line.startswith("bench: pool member ssm-0"))
    assert f"({useless}) dropped out of the trees" in line and "tokens a step accepted" in line
    assert json.loads(out)["pool_members"]["ssm-0"]["dropped"] is True
