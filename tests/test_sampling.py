"""The target distribution's warping equals transformers' logits processors, the sampling noise
samples it (fixed by seed and position), and trees are verified against the LLM's own tokens."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from specinfer.errors import UserError
from specinfer.engine.verification.sampling import SamplingNoise, first_max, sample, target_probs, warp_logits
from specinfer.params import SamplingParams
from specinfer.engine.drafting.tree import TokenTree
from specinfer.engine.verification.acceptance import verify_tree


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.5, 10, 0.8), (1.0, 3, 0.5)])
def test_warp_matches_transformers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    ours = warp_logits(logits, SamplingParams(temperature, top_p=top_p, top_k=top_k))
    ref = logits.clone()
    ids = torch.zeros(6, 1, dtype=torch.long)
    if temperature != 1.0:
        ref = TemperatureLogitsWarper(temperature)(ids, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(ids, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(ids, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert torch.allclose(ours[finite], ref[finite])


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


def test_noise_is_fixed_by_seed_and_position_alone():
    a, b = SamplingNoise(7, 50), SamplingNoise(7, 50)
    assert torch.equal(a.row(12), b.row(12)) and torch.equal(a.rows([3, 12]), b.rows([3, 12]))
    assert not torch.equal(a.row(12), a.row(13)) and not torch.equal(a.row(12), SamplingNoise(8, 50).row(12))
    assert torch.isfinite(a.rows(list(range(200)))).all()


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.8), SamplingParams(1.3, top_k=3)])
def test_the_noise_samples_the_warped_distribution(params):
    """Gumbel-max over positions (each its own noise): the sampled tokens follow softmax of the
    warped logits, and tokens the warping filters out never come."""
    from scipy.stats import chisquare

    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    p = target_probs(logits, params)[0]
    noise, n = SamplingNoise(3, 8), 20_000
    tokens = sample(logits.expand(n, 8), params, noise, list(range(n)))
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    assert (counts[p == 0] == 0).all()
    support = p > 0
    assert chisquare(counts[support].numpy(), (p[support] * n).numpy()).pvalue > 0.001


def test_the_same_noise_at_every_position_fails_that_test():
    """The test has teeth: tokens drawn with one position's noise for all are one token, not a sample."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5]])
    tokens = sample(logits.expand(1000, 4), SamplingParams(1.0), SamplingNoise(3, 4), [5] * 1000)
    assert len(set(tokens)) == 1


def test_a_tree_is_verified_against_the_llms_own_tokens():
    tree = TokenTree.with_root(3)
    a = tree.add_draft(0, 1)
    tree.add_draft(0, 2)
    tree.add_draft(a, 4)
    assert verify_tree(tree, [1, 4, 0, 0]) == ([0, a, 3], 0)  # both levels accepted, then the LLM's bonus
    assert verify_tree(tree, [5, 0, 0, 0]) == ([0], 5)  # no child matches: the LLM's own token


def test_target_probs_sum_to_one():
    p = target_probs(torch.randn(3, 20), SamplingParams(0.8, top_p=0.7, top_k=8))
    assert torch.allclose(p.sum(-1), torch.ones(3))


def test_first_max_is_argmax_ties_included():
    """Greedy verification picks each node's token with `first_max`: argmax's first index on ties,
    which decides the token wherever two logits are equal."""
    rows = torch.tensor([[1.0, 5.0, 5.0, 2.0], [7.0, 7.0, 7.0, 7.0], [-1.0, -3.0, -1.0, -9.0]])
    assert first_max(rows) == rows.argmax(dim=-1).tolist() == [1, 0, 0]
    gen = torch.Generator().manual_seed(0)
    many_ties = torch.randint(0, 3, (64, 4096), generator=gen).float()
    assert first_max(many_ties) == many_ties.argmax(dim=-1).tolist()
    assert first_max(many_ties) != (many_ties.flip(-1).argmax(dim=-1) * -1 + 4095).tolist()  # the last index differs
