"""Sampled output under logits processors and a grammar has exactly the processed distribution.

As in test_stochastic_exact: on an 8-token vocabulary the joint distribution of the first 3 tokens
is computed exactly from transformers' model, here with the penalties, logit bias, min_p and a
grammar's mask applied by a plain reference written below (each position in its own context),
and compared by a chi-square test with 20,000 seeded speculative samples. With teeth: the same
samples fail against the distribution without the penalties, and against one whose penalties
ignore the tree's paths.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from specinfer.engine.llm_engine import Engine, EngineConfig, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.drafting.speculator import model_free_member
from specinfer.params import Constraint, SamplingParams, TreeBudget, TreeShape
from test_processors import CycleCompiler
from test_stochastic_exact import BATCH, NUM_SAMPLES, NUM_TOKENS, PROMPT, VOCAB, FixedBudget, chi_square_pvalue
from util import perturbed_copy, save_tiny_llama

EOS = 0
# Position 0: four tokens; position 1: forced; position 2: five tokens (EOS is never allowed here).
GRAMMAR = Constraint("choice", "1,2,3,5;4;2,3,5,6,7", choices=("8",))  # the stand-in reads spec and length
SAMPLING = SamplingParams(1.0, frequency_penalty=0.9, presence_penalty=0.4, repetition_penalty=1.6, min_p=0.05,
                          logit_bias=((3, 1.5), (6, -0.8)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("processed")
    llm = save_tiny_llama(root / "llm", vocab=VOCAB, hidden=16, layers=1, heads=2, kv_heads=1,
                          intermediate=32, init_std=0.5, seed=21, eos_token_id=EOS)
    return llm, perturbed_copy(llm, root / "ssm", noise=0.6, seed=22)


def reference_probs(logits: torch.Tensor, output: list[int], params: SamplingParams, allowed) -> torch.Tensor:
    """The processed distribution of one position, written plainly: mask, bias, repetition penalty
    over prompt and output, OpenAI's penalties over the output, temperature, min_p."""
    logits = logits.clone().double()
    if allowed is not None:
        for t in range(VOCAB):
            if t not in allowed:
                logits[t] = float("-inf")
    for t, b in params.logit_bias:
        logits[t] += b
    for t in set(PROMPT + output):
        logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
    for t in set(output):
        logits[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    probs = (logits / params.temperature).softmax(-1)
    probs[probs < params.min_p * probs.max()] = 0
    return probs / probs.sum()


def exact_joint(llm_dir, params: SamplingParams, grammar: Constraint | None) -> dict[tuple[int, ...], float]:
    hf = AutoModelForCausalLM.from_pretrained(llm_dir, dtype=torch.float32).eval()
    seqs = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    with torch.no_grad():
        logits = hf(torch.tensor(seqs)).logits  # (V*V, len+2, V)
    state = CycleCompiler(EOS).new_state(grammar) if grammar else None
    allowed = (lambda i: state.allowed_at(i)) if state else (lambda i: None)
    n = len(PROMPT)
    joint = {}
    p1 = reference_probs(logits[0, n - 1], [], params, allowed(0))
    for i, (a, b) in enumerate(itertools.product(range(VOCAB), range(VOCAB))):
        p2 = reference_probs(logits[i, n], [a], params, allowed(1))
        p3 = reference_probs(logits[i, n + 1], [a, b], params, allowed(2))
        for c in range(VOCAB):
            joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return joint


def make_engine(models, model_free: bool) -> Engine:
    llm, ssm = models
    kv = BATCH * (len(PROMPT) + NUM_TOKENS + 1 + 64 * 3 + 16) + 1024
    members = [model_free_member(name) for name in ("lookup", "suffix")] if model_free else []
    engine = Engine.from_runners(ModelRunner.from_dir(llm, max_kv_tokens=kv, block_size=8),
                                 [ModelRunner.from_dir(ssm, max_kv_tokens=kv, block_size=8)],
                                 EngineConfig(default_shape=TreeShape((2, 2), is_sampled=True)), model_free=members)
    engine.grammars = CycleCompiler(EOS)
    engine.load_policy = FixedBudget(TreeBudget(max_nodes=12, max_depth=3, node_cost=0.01, level_cost=0.01))
    return engine


def sample_counts(engine: Engine, mode: str, params: SamplingParams, grammar: Constraint | None) -> dict:
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for start in range(0, NUM_SAMPLES, BATCH):
        reqs = [engine.start(PROMPT, mode_params(mode, NUM_TOKENS, TreeShape((2, 2), is_sampled=True),
                                                 replace(params, seed=s), constraint=grammar, is_ignore_eos=True))
                for s in range(start, start + BATCH)]
        for r in engine.generate_batch(reqs):
            counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
            accepted += sum(r.accepted_per_step)
    assert accepted > NUM_SAMPLES * 0.2  # drafts were accepted, not only the LLM's own tokens
    return counts


CASES = {
    "penalties-static-tree": ("tree", SAMPLING, None, False),
    "penalties-grammar-dynamic+model-free": ("auto", SAMPLING, GRAMMAR, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_processed_sampling_matches_the_processed_distribution(models, case):
    mode, params, grammar, model_free = CASES[case]
    counts = sample_counts(make_engine(models, model_free), mode, params, grammar)
    assert chi_square_pvalue(counts, exact_joint(models[0], params, grammar)) > 0.001
    if grammar is None:  # teeth: the same samples are far from the unpenalised distribution
        plain = SamplingParams(1.0)
        assert chi_square_pvalue(counts, exact_joint(models[0], plain, None)) < 0.001


def test_penalties_that_ignore_the_path_fail_the_test(models, monkeypatch):
    """Teeth: a tree node penalised only for the committed output (not for its own path) samples
    the wrong distribution, and the test says so."""
    from specinfer.engine.verification import processors

    monkeypatch.setattr(processors.TokenTree, "path_tokens", lambda self, node: [])
    counts = sample_counts(make_engine(models, False), "tree", SAMPLING, None)
    try:
        pvalue = chi_square_pvalue(counts, exact_joint(models[0], SAMPLING, None))
    except AssertionError:  # it even output what the processed distribution never can (min_p cut it)
        pvalue = 0.0
    assert pvalue < 0.001
