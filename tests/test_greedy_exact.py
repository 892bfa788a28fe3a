"""Greedy output is token-for-token the LLM's own: incremental == transformers == sequence ==
tree == tree with two merged SSMs == dynamic trees (one SSM, or two SSMs and the model-free
members in one budget; alone and in batches), on 20 prompts x 64 new tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specinfer.engine.llm_engine import Engine, EngineConfig, mode_params
from specinfer.engine.scheduling.policy import PRIOR_WEIGHT
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.drafting.speculator import model_free_member
from specinfer.params import TreeBudget, TreeShape
from policies import FixedBudget

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def incremental_outputs(pair_runners, greedy_prompts):
    llm, _ = pair_runners
    engine = Engine.from_runners(llm)
    return [engine.generate(p, mode_params("incremental", NEW_TOKENS)).output_ids for p in greedy_prompts]


def test_incremental_equals_transformers_generate(tiny_pair, greedy_prompts, incremental_outputs):
    hf = AutoModelForCausalLM.from_pretrained(tiny_pair.llm, dtype=torch.float32).eval()
    for prompt, ours in zip(greedy_prompts, incremental_outputs):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == ours


CASES = {
    "sequence": ("sequence", TreeShape((1,) * 6), 1),
    "tree": ("tree", TreeShape((1, 1, 3, 1, 1, 1, 1, 1)), 1),
    "tree-wide": ("tree", TreeShape((3, 2, 2, 1), max_nodes=16), 1),
    "tree-merged-2-ssms": ("tree", TreeShape((2, 2, 1, 1, 1)), 2),
    "tree-dynamic-pruned": ("tree", TreeShape((3, 3, 2, 2, 2, 2), max_nodes=12, min_path_prob=0.05), 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_greedy_equals_incremental(pair_runners, greedy_prompts, incremental_outputs, case):
    llm, ssms = pair_runners
    mode, shape, num_ssms = CASES[case]
    engine = Engine.from_runners(llm, ssms[:num_ssms])
    params = mode_params(mode, NEW_TOKENS, shape)
    accepted, steps, short_steps = 0, 0, 0
    for prompt, expected in zip(greedy_prompts, incremental_outputs):
        r = engine.generate(prompt, params)
        assert r.output_ids == expected
        accepted += sum(r.accepted_per_step)
        steps += r.num_llm_steps
        short_steps += sum(1 for a in r.accepted_per_step if a < len(shape.widths))
    # The comparison only means something if trees were both accepted and rejected.
    assert accepted > steps * 0.3, (accepted, steps)
    assert short_steps > 0
    assert llm.allocator.num_used == 0 and all(s.allocator.num_used == 0 for s in ssms)


def test_batched_greedy_equals_single(pair_runners, greedy_prompts, incremental_outputs):
    """Several requests stepping together (one forward per level / step) change nothing."""
    llm, ssms = pair_runners
    engine = Engine.from_runners(llm, ssms)
    reqs = [engine.start(p, mode_params("tree", NEW_TOKENS - i, TreeShape((2, 1, 2, 1))))
            for i, p in enumerate(greedy_prompts)]
    results = engine.generate_batch(reqs)
    for i, (r, expected) in enumerate(zip(results, incremental_outputs)):
        assert r.output_ids == expected[: NEW_TOKENS - i]
    assert llm.allocator.num_used == 0


def test_half_precision_ssm_keeps_fp32_llm_output(tiny_pair, pair_runners, greedy_prompts, incremental_outputs):
    """The SSM's dtype changes what it proposes, never what comes out."""
    llm, _ = pair_runners
    engine = Engine.from_runners(llm, [ModelRunner.from_dir(tiny_pair.ssms[0], dtype="bfloat16", max_kv_tokens=8192)])
    accepted = 0
    for prompt, expected in zip(greedy_prompts, incremental_outputs):
        r = engine.generate(prompt, mode_params("tree", NEW_TOKENS, TreeShape((2, 1, 1, 1))))
        assert r.output_ids == expected
        accepted += sum(r.accepted_per_step)
    assert accepted > 0


def test_auto_mode_picks_shapes_and_stays_exact(pair_runners, greedy_prompts, incremental_outputs):
    llm, ssms = pair_runners
    engine = Engine.from_runners(llm, ssms[:1], EngineConfig(default_shape=TreeShape((3, 3, 1, 1, 1, 1), max_nodes=32)))
    for prompt, expected in zip(greedy_prompts, incremental_outputs):
        assert engine.generate(prompt, mode_params("auto", NEW_TOKENS)).output_ids == expected
    policy = engine.load_policy
    assert policy.stats(1).weight > PRIOR_WEIGHT + 1  # it learnt from real steps, beyond its prior
    assert engine.source.speculator.calibration[True]._cells  # and so did the drafts' calibration
    # These test SSMs cost as much as the LLM, so the policy should mostly decide not to speculate.
    assert policy.choose(1) == ()


BUDGETS = {
    "cheap-nodes": TreeBudget(max_nodes=32, max_depth=8, node_cost=0.002, level_cost=0.01),
    "pricey-nodes": TreeBudget(max_nodes=8, max_depth=4, node_cost=0.08, level_cost=0.05),
    "shallow": TreeBudget(max_nodes=32, max_depth=2, node_cost=0.01, level_cost=0.01),
}


def dynamic_engine(llm, ssms, budget: TreeBudget, model_free=()) -> Engine:
    engine = Engine.from_runners(llm, ssms, model_free=[model_free_member(n) for n in model_free])
    engine.load_policy = FixedBudget(budget)
    return engine


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("pool", ["one-ssm", "two-ssms-lookup-suffix"])
def test_dynamic_trees_keep_greedy_output(pair_runners, greedy_prompts, incremental_outputs, budget, pool):
    """Trees grown node by node from calibrated estimates, of one SSM or of two SSMs and the
    model-free members competing in one budget, leave the output the LLM's own."""
    llm, ssms = pair_runners
    engine = (dynamic_engine(llm, ssms[:1], BUDGETS[budget]) if pool == "one-ssm"
              else dynamic_engine(llm, ssms, BUDGETS[budget], ("lookup", "suffix")))
    accepted, sizes = 0, set()
    for prompt, expected in zip(greedy_prompts, incremental_outputs):
        r = engine.generate(prompt, mode_params("auto", NEW_TOKENS))
        assert r.output_ids == expected
        accepted += sum(r.accepted_per_step)
        sizes |= set(r.tree_nodes_per_step)
    # Dynamic: trees of many sizes (down to the root alone), and some accepted.
    assert accepted > 0 and len(sizes) >= 3, sizes
    assert max(sizes) - 1 <= BUDGETS[budget].max_nodes
    assert llm.allocator.num_used == 0 and all(s.allocator.num_used == 0 for s in ssms)


def test_batched_dynamic_trees_equal_single(pair_runners, greedy_prompts, incremental_outputs):
    """Requests stepping together, their dynamic trees grown in one SSM pass per level, change nothing."""
    llm, ssms = pair_runners
    engine = dynamic_engine(llm, ssms, BUDGETS["cheap-nodes"], ("lookup", "suffix"))
    reqs = [engine.start(p, mode_params("auto", NEW_TOKENS - i)) for i, p in enumerate(greedy_prompts)]
    for i, (r, expected) in enumerate(zip(engine.generate_batch(reqs), incremental_outputs)):
        assert r.output_ids == expected[: NEW_TOKENS - i]
    assert llm.allocator.num_used == 0 and all(s.allocator.num_used == 0 for s in ssms)
