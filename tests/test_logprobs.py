"""Logprobs are transformers' own: each generated token's logprob and its top alternatives equal
`log_softmax` of `LlamaForCausalLM`'s logits on the same tiny model (fp32, 1e-4), greedy (raw
logits) and sampled (logits warped by transformers' own temperature, top-k and top-p warpers),
incremental and speculative (tree) alike, with no extra forward pass."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.errors import UserError
from specinfer.params import GenerationParams, SamplingParams, TreeShape

NEW_TOKENS = 24
NUM_TOP = 5
TOL = 1e-4
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7)


@pytest.fixture(scope="module")
def hf(tiny_pair):
    return LlamaForCausalLM.from_pretrained(tiny_pair.llm, dtype=torch.float32).eval()


def reference_logprobs(hf, prompt: list[int], output: list[int], sampling: SamplingParams) -> torch.Tensor:
    """transformers' log-distribution at each output position: (len(output), V)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(output)].float()
    if not sampling.is_greedy:
        for warper in (TemperatureLogitsWarper(sampling.temperature), TopKLogitsWarper(sampling.top_k),
                       TopPLogitsWarper(sampling.top_p)):
            logits = warper(ids, logits)
    return torch.log_softmax(logits, dim=-1)


def check_against_transformers(hf, prompt, result, sampling) -> None:
    assert len(result.output_logprobs) == len(result.output_ids) > 0
    ref = reference_logprobs(hf, prompt, result.output_ids, sampling)
    for i, (token, lp) in enumerate(zip(result.output_ids, result.output_logprobs)):
        assert lp.token_id == token
        assert abs(lp.logprob - ref[i, token].item()) < TOL, (i, lp.logprob, ref[i, token].item())
        finite = int(torch.isfinite(ref[i]).sum())
        assert len(lp.top) == min(NUM_TOP, finite)
        expected = torch.topk(ref[i], len(lp.top)).values
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), expected, atol=TOL)
        for t, v in lp.top:  # each listed alternative is that token's own logprob
            assert abs(v - ref[i, t].item()) < TOL


@pytest.mark.parametrize("mode", ["incremental", "tree"])
def test_greedy_logprobs_are_transformers_log_softmax(pair_runners, hf, greedy_prompts, mode):
    llm, ssms = pair_runners
    engine = Engine.from_runners(llm, ssms[:1])
    params = mode_params(mode, NEW_TOKENS, TreeShape((1, 1, 3, 1, 1)), num_logprobs=NUM_TOP)
    accepted = 0
    for prompt in greedy_prompts[:6]:
        result = engine.generate(prompt, params)
        check_against_transformers(hf, prompt, result, params.sampling)
        accepted += sum(result.accepted_per_step)
    if mode == "tree":  # accepted tree tokens, not only bonus tokens, were checked
        assert accepted > 0


@pytest.mark.parametrize("mode", ["incremental", "tree"])
def test_sampled_logprobs_are_of_the_warped_distribution(pair_runners, hf, greedy_prompts, mode):
    llm, ssms = pair_runners
    engine = Engine.from_runners(llm, ssms[:1])
    params = mode_params(mode, NEW_TOKENS, TreeShape((2, 2, 1, 1)), sampling=SAMPLED, num_logprobs=NUM_TOP)
    accepted = 0
    for prompt in greedy_prompts[:6]:
        result = engine.generate(prompt, params)
        check_against_transformers(hf, prompt, result, SAMPLED)
        assert all(lp.logprob > float("-inf") for lp in result.output_logprobs)  # drawn from the support
        accepted += sum(result.accepted_per_step)
    if mode == "tree":
        assert accepted > 0


def test_logprobs_change_nothing_else_and_cost_no_forward_pass(pair_runners, greedy_prompts, monkeypatch):
    llm, ssms = pair_runners
    engine = Engine.from_runners(llm, ssms[:1])
    calls = []
    run = llm.run
    monkeypatch.setattr(llm, "run", lambda works: calls.append(len(works)) or run(works))
    for sampling in (SamplingParams(), SAMPLED):
        plain = mode_params("tree", NEW_TOKENS, TreeShape((1, 1, 3, 1)), sampling=sampling)
        with_lp = mode_params("tree", NEW_TOKENS, TreeShape((1, 1, 3, 1)), sampling=sampling, num_logprobs=NUM_TOP)
        calls.clear()
        a = engine.generate(greedy_prompts[0], plain)
        num_plain = len(calls)
        calls.clear()
        b = engine.generate(greedy_prompts[0], with_lp)
        assert a.output_ids == b.output_ids
        assert len(calls) == num_plain
        assert a.output_logprobs == [] and len(b.output_logprobs) == len(b.output_ids)


def test_zero_alternatives_still_gives_each_tokens_logprob(pair_runners, hf, greedy_prompts):
    llm, _ = pair_runners
    result = Engine.from_runners(llm).generate(greedy_prompts[1], mode_params("incremental", 8, num_logprobs=0))
    assert [lp.top for lp in result.output_logprobs] == [()] * 8
    ref = reference_logprobs(hf, greedy_prompts[1], result.output_ids, SamplingParams())
    assert all(abs(lp.logprob - ref[i, lp.token_id].item()) < TOL for i, lp in enumerate(result.output_logprobs))


@pytest.mark.parametrize("num", [-1, 21])
def test_logprobs_out_of_range_is_a_user_error(num):
    with pytest.raises(UserError, match="logprobs"):
        GenerationParams(num_logprobs=num)
