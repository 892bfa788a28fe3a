"""Stochastic exactness: speculative sampling follows the LLM's own distribution.

On an 8-token vocabulary, the joint distribution of the first 3 generated tokens is computed
exactly from transformers' model (8^3 cells, with the same warping), and compared by a
chi-square test with 20,000 seeded speculative samples per configuration: static trees, merged
pools, and dynamic trees that mix coupled SSM children (the Gumbel-top-k of the SSM with the
request's noise) with deterministic (model-free and top-k) picks. The test has teeth: with one
noise for every position, or trees verified against the LLM's most likely token, it fails. And
since the noise fixes each token by seed and position, sampled speculation outputs exactly what
sampling alone does (with teeth too).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

import specinfer.engine.verification.verifier
from specinfer.engine.llm_engine import Engine, EngineConfig, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.verification.sampling import SamplingNoise, target_probs, warp_logits
from specinfer.engine.drafting.speculator import model_free_member
from specinfer.params import SamplingParams, TreeBudget, TreeShape
from policies import FixedBudget
from util import perturbed_copy, save_tiny_llama

VOCAB = 8
NUM_TOKENS = 3
NUM_SAMPLES = 20_000
BATCH = 2_000
PROMPT = [3, 5, 2, 7]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stoch")
    llm = save_tiny_llama(root / "llm", vocab=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1,
                          intermediate=32, init_std=0.5, seed=21, eos_token_id=None)
    ssm1 = perturbed_copy(llm, root / "ssm1", noise=0.6, seed=22)
    ssm2 = perturbed_copy(llm, root / "ssm2", noise=0.9, seed=23)
    return llm, ssm1, ssm2


def exact_joint(llm_dir, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) of LLM-only sampling, from transformers' forward passes."""
    hf = AutoModelForCausalLM.from_pretrained(llm_dir, dtype=torch.float32).eval()
    seqs = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    with torch.no_grad():
        logits = hf(torch.tensor(seqs)).logits  # (V*V, len+2, V)
    n = len(PROMPT)
    p1 = target_probs(logits[0, n - 1 : n], params)[0]
    joint = {}
    for i, (a, b) in enumerate(itertools.product(range(VOCAB), range(VOCAB))):
        p2 = target_probs(logits[i, n : n + 1], params)[0]
        p3 = target_probs(logits[i, n + 1 : n + 2], params)[0]
        for c in range(VOCAB):
            joint[(a, b, c)] = (p1[a] * p2[b] * p3[c]).item()
    return joint


def speculative_counts(engine: Engine, params: SamplingParams, shape: TreeShape) -> tuple[dict, float]:
    """Counts of the first tokens; a dynamic-tree engine (`FixedBudget`) runs in auto mode."""
    counts: dict[tuple[int, ...], int] = {}
    accepted = steps = 0
    mode = "auto" if isinstance(engine.load_policy, FixedBudget) else "tree"
    for start in range(0, NUM_SAMPLES, BATCH):
        reqs = [
            engine.start(PROMPT, mode_params(mode, NUM_TOKENS, shape, SamplingParams(
                params.temperature, params.top_p, params.top_k, seed=s)))
            for s in range(start, start + BATCH)
        ]
        for r in engine.generate_batch(reqs):
            key = tuple(r.output_ids)
            counts[key] = counts.get(key, 0) + 1
            accepted += sum(r.accepted_per_step)
            steps += r.num_llm_steps
    return counts, accepted / steps


def chi_square_pvalue(counts: dict, joint: dict) -> float:
    """Pearson chi-square; cells expected to hold < 5 samples are pooled into one."""
    observed, expected = [], []
    pooled_obs = pooled_exp = 0.0
    for cell, prob in joint.items():
        exp = prob * NUM_SAMPLES
        if exp < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += exp
        else:
            observed.append(counts.get(cell, 0))
            expected.append(exp)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    assert sum(observed) == NUM_SAMPLES, "samples outside the joint support"
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


CONFIGS = {
    "t1-sampled-tree": (SamplingParams(1.0), TreeShape((2, 2), is_sampled=True), 1),
    "t1-topk-tree": (SamplingParams(1.0), TreeShape((2, 2), is_sampled=False), 1),
    "t0.7-p0.9-sampled-tree": (SamplingParams(0.7, top_p=0.9),
                               TreeShape((3, 2), is_sampled=True), 1),
    "t0.7-p0.9-topk-tree": (SamplingParams(0.7, top_p=0.9), TreeShape((2, 2), is_sampled=False), 1),
    "t1-merged-2-ssms": (SamplingParams(1.0), TreeShape((2, 1), is_sampled=True), 2),
    "t1-pruned-sampled-tree": (SamplingParams(1.0), TreeShape((3, 3), max_nodes=5, min_path_prob=0.2), 1),
    # Coupled SSM children and deterministic model-free children in one tree.
    "t1-sampled-ssm+model-free": (SamplingParams(1.0), TreeShape((2, 2), is_sampled=True), (1, "lookup", "suffix")),
    # Dynamic trees: coupled children as many as each node's value pays for, then model-free ones.
    "t1-dynamic-sampled+model-free": (SamplingParams(1.0), TreeShape((1,), is_sampled=True), (1, "lookup", "suffix"),
                                      TreeBudget(max_nodes=12, max_depth=3, node_cost=0.01, level_cost=0.01)),
    "t0.7-p0.9-dynamic-sampled-2-ssms": (SamplingParams(0.7, top_p=0.9), TreeShape((1,)), 2,
                                         TreeBudget(max_nodes=12, max_depth=3, node_cost=0.02, level_cost=0.01)),
    "t1-dynamic-topk+model-free": (SamplingParams(1.0), TreeShape((1,), is_sampled=False), (1, "lookup", "suffix"),
                                   TreeBudget(max_nodes=12, max_depth=3, node_cost=0.01, level_cost=0.01)),
}


def make_engine(models, num_ssms: int | tuple, shape: TreeShape | None = None, budget: TreeBudget | None = None
                ) -> Engine:
    """`num_ssms`: how many SSMs, or (how many, model-free member names...); with a `budget`,
    dynamic trees with `shape`'s sampling settings."""
    num_ssms, *model_free = num_ssms if isinstance(num_ssms, tuple) else (num_ssms,)
    llm, *ssms = models
    # All BATCH requests are admitted at once, each with its worst case reserved: its prompt, its
    # new tokens and one tree per SSM (a TreeShape's max_nodes by default).
    kv = BATCH * (len(PROMPT) + NUM_TOKENS + 1 + TreeShape().max_nodes * max(1, num_ssms + len(model_free))) + 1024
    members = [model_free_member(name) for name in model_free]
    for member in members:
        if member.name == "suffix":  # earlier outputs: from the first step on, several deterministic branches
            for output in [[7, 1, 0]] * 3 + [[7, 5, 4]] * 3 + [[7, 4, 4], [7, 2, 6]] * 2:
                member.cache.add(output)
    cfg = EngineConfig(default_shape=shape) if shape is not None else EngineConfig()
    engine = Engine.from_runners(ModelRunner.from_dir(llm, max_kv_tokens=kv, block_size=8),
                                 [ModelRunner.from_dir(s, max_kv_tokens=kv, block_size=8) for s in ssms[:num_ssms]],
                                 cfg, model_free=members)
    if budget is not None:
        engine.load_policy = FixedBudget(budget)
    return engine


def configured(models, name: str) -> tuple[Engine, SamplingParams, TreeShape]:
    params, shape, pool, *budget = CONFIGS[name]
    return make_engine(models, pool, shape, budget[0] if budget else None), params, shape


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_sampling_matches_llm_distribution(models, name):
    engine, params, shape = configured(models, name)
    counts, mean_accepted = speculative_counts(engine, params, shape)
    pvalue = chi_square_pvalue(counts, exact_joint(models[0], params))
    assert 0.2 < mean_accepted, mean_accepted  # trees were really accepted, not only rejected
    assert pvalue > 0.001, (name, pvalue)


def test_one_noise_for_every_position_fails_the_test(models, monkeypatch):
    """The test has teeth: with every position drawn from the same noise, tokens are no longer
    independent samples, and the test says so."""
    row = SamplingNoise.row
    monkeypatch.setattr(SamplingNoise, "row", lambda self, position: row(self, 0))
    engine, params, shape = configured(models, "t1-sampled-tree")
    counts, _ = speculative_counts(engine, params, shape)
    assert chi_square_pvalue(counts, exact_joint(models[0], params)) < 0.001


def test_a_tree_verified_against_the_warped_argmax_fails_the_test(models, monkeypatch):
    """Sampled trees must be verified against the LLM's sample, not its most likely token."""
    monkeypatch.setattr(specinfer.engine.verification.verifier, "sample",
                        lambda logits, params, noise, positions: warp_logits(logits, params).argmax(-1).tolist())
    engine, params, shape = configured(models, "t0.7-p0.9-topk-tree")
    counts, _ = speculative_counts(engine, params, shape)
    assert chi_square_pvalue(counts, exact_joint(models[0], params)) < 0.001


@pytest.mark.parametrize("name", ["t1-sampled-tree", "t1-merged-2-ssms", "t1-dynamic-sampled+model-free",
                                  "t0.7-p0.9-dynamic-sampled-2-ssms"])
def test_sampled_speculation_outputs_exactly_what_sampling_alone_does(models, name):
    """The noise fixes every sampled token by seed and position: speculative output, whatever the
    tree and in a batch, is token for token the LLM's own sampled output for that seed."""
    engine, params, shape = configured(models, name)
    seeds = range(40)
    plain = Engine.from_runners(ModelRunner.from_dir(models[0]))
    mode = "auto" if isinstance(engine.load_policy, FixedBudget) else "tree"
    expected = [plain.generate(PROMPT, mode_params("incremental", 12, sampling=SamplingParams(
        params.temperature, params.top_p, params.top_k, seed=s))).output_ids for s in seeds]
    reqs = [engine.start(PROMPT, mode_params(mode, 12, shape, SamplingParams(
        params.temperature, params.top_p, params.top_k, seed=s))) for s in seeds]
    results = engine.generate_batch(reqs)
    assert [r.output_ids for r in results] == expected
    assert sum(sum(r.accepted_per_step) for r in results) > 40  # trees were accepted, not only the LLM's tokens


def test_accepting_a_draft_the_llm_did_not_sample_breaks_the_equality(models, monkeypatch):
    """The equality has teeth: a verifier that also accepted the LLM's second most likely token
    would output something else."""
    original = specinfer.engine.verification.verifier.verify_tree

    def lenient(tree, llm_tokens):
        llm_tokens = list(llm_tokens)
        for node in range(len(tree)):  # take the first child whatever the LLM sampled
            if tree.children[node]:
                llm_tokens[node] = tree.tokens[tree.children[node][0]]
        return original(tree, llm_tokens)

    monkeypatch.setattr(specinfer.engine.verification.verifier, "verify_tree", lenient)
    with pytest.raises(AssertionError):
        test_sampled_speculation_outputs_exactly_what_sampling_alone_does(models, "t1-sampled-tree")


def test_seeded_runs_are_reproducible(models):
    engine = make_engine(models, 2)
    shape = TreeShape((2, 2, 1))
    outs = [engine.generate(PROMPT, mode_params("tree", 24, shape, SamplingParams(0.9, top_k=6, seed=99))).output_ids
            for _ in range(2)]
    other = engine.generate(PROMPT, mode_params("tree", 24, shape, SamplingParams(0.9, top_k=6, seed=100))).output_ids
    assert outs[0] == outs[1]
    assert outs[0] != other
