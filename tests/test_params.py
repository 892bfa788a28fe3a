"""The shared request vocabulary: validation on construction, and the stored JSON form."""

from __future__ import annotations

import pytest

from specinfer.errors import UserError
from specinfer.limits import MAX_TREE_DEPTH, RequestLimits
from specinfer.params import GenerationParams, SamplingParams, TreeShape
from specinfer.stats import GenerationStats


def test_round_trip_through_json():
    params = GenerationParams(40, SamplingParams(0.7, 0.9, 5, seed=3), TreeShape((2, 1), max_nodes=12, policy="mixed"),
                              ssm_names=("a",), stop=("\n\n",), is_ignore_eos=True)
    assert GenerationParams.from_json(params.to_json()) == params


def test_reads_requests_stored_by_an_earlier_gateway():
    earlier = {"max_tokens": 32, "sampling": {"temperature": 0.5, "top_p": 1.0, "top_k": 0, "seed": 7},
               "stop": ["x"], "is_speculative": False, "is_ignore_eos": True,
               "tree": {"widths": [2, 2], "max_nodes": 0, "is_sampled": True, "proposal_top_k": 0, "policy": 2,
                        "min_path_prob": 0.0, "ssm_names": ["ssm-1"]}}
    params = GenerationParams.from_json(earlier)
    assert params == GenerationParams(32, SamplingParams(0.5, seed=7), TreeShape((2, 2), is_sampled=True, policy="mixed"),
                                      is_speculative=False, ssm_names=("ssm-1",), stop=("x",), is_ignore_eos=True)
    assert GenerationParams.from_json({**earlier, "tree": {"widths": []}}).shape.is_default
    # A shape stored with a field since removed (the ignored proposal_top_k) reads without it.
    stored = GenerationParams(8, SamplingParams(0.5, seed=7), TreeShape((2, 2), max_nodes=9)).to_json()
    stored["shape"]["proposal_top_k"] = 32
    assert GenerationParams.from_json(stored).shape == TreeShape((2, 2), max_nodes=9)


@pytest.mark.parametrize("make, field", [
    (lambda: SamplingParams(temperature=-1), "sampling.temperature"),
    (lambda: SamplingParams(top_p=0), "sampling.top_p"),
    (lambda: TreeShape((0, 1)), "shape.widths"),
    (lambda: TreeShape((1,) * (MAX_TREE_DEPTH + 1)), "shape.widths"),
    (lambda: TreeShape((1,), max_nodes=0), "shape.max_nodes"),
    (lambda: TreeShape((1,), policy="other"), "shape.policy"),
    (lambda: GenerationParams(-1), "max_tokens"),
    (lambda: GenerationParams(ssm_names=("",)), "ssm_names"),
    (lambda: GenerationParams(600).checked(RequestLimits()), "max_tokens"),
    (lambda: GenerationParams(shape=TreeShape((1,) * 9)).checked(RequestLimits(max_tree_depth=8)), "shape.widths"),
])
def test_bad_values_name_their_field(make, field):
    with pytest.raises(UserError, match=f"^{field}"):
        make()


def test_checked_fills_in_the_default_length():
    assert GenerationParams().checked(RequestLimits(default_max_new_tokens=20)).max_new_tokens == 20


def test_stats_stored_by_an_earlier_gateway_keep_their_figures():
    earlier = {"prompt_tokens": 5, "output_tokens": 12, "llm_steps": 4, "tokens_per_step": 3.0, "mean_accepted": 2.0,
               "mean_tree_nodes": 5.0, "acceptance_rate": 0.5, "latency_s": 0.1, "fell_back": False}
    stats = GenerationStats.from_json(earlier)
    assert (stats.mean_accepted, stats.mean_tree_nodes, stats.acceptance_rate) == (2.0, 5.0, 0.5)
    assert GenerationStats.from_json(stats.to_json()) == stats
    assert GenerationStats.from_json({"llm_steps": 3, "output_tokens": 3}).acceptance_rate is None
