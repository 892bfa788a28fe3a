"""The target distribution's warping equals transformers' logits processors, and verification
edge cases behave."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from specinfer.errors import UserError
from specinfer.engine.sampling import proposal_probs, target_probs, warp_logits
from specinfer.params import SamplingParams
from specinfer.engine.tree import TokenTree
from specinfer.engine.verify import residual_distribution, verify_stochastic


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


def test_proposal_truncation_is_exactly_sparse():
    q = proposal_probs(torch.randn(2, 30), SamplingParams(1.0), top_k=4)
    assert ((q > 0).sum(dim=-1) == 4).all()
    assert torch.allclose(q.sum(dim=-1), torch.ones(2))


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.6, 0.1, 0.3])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(residual_distribution(p, p), p)  # nothing left: keep p, never NaN


def test_point_mass_draft_accepted_with_target_probability():
    """A deterministic child is accepted with probability p[x], else x is excluded."""
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    probs = torch.cat([probs, torch.full((1, 4), 0.25)])
    gen = torch.Generator().manual_seed(0)
    hits, bonus_counts = 0, torch.zeros(4)
    n = 4000
    for _ in range(n):
        tree = TokenTree.with_root(3)
        tree.add_draft(0, 1, None)
        path, bonus = verify_stochastic(tree, probs, gen)
        if len(path) == 2:
            hits += 1
        else:
            bonus_counts[bonus] += 1
    assert abs(hits / n - 0.75) < 0.03
    assert bonus_counts[1] == 0 and bonus_counts[0] == n - hits  # residual excludes the rejected token


def test_target_probs_sum_to_one():
    p = target_probs(torch.randn(3, 20), SamplingParams(0.8, top_p=0.7, top_k=8))
    assert torch.allclose(p.sum(-1), torch.ones(3))
