"""Pipelined speculation: trees drafted ahead stand or are rolled back, and outputs never change."""

from __future__ import annotations

import pytest
import torch

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.drafting.pipeline import build_ahead, predicted_path, settle
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.verification.sampling import SamplingNoise
from specinfer.engine.drafting.speculator import Proposal, Speculator
from specinfer.params import SamplingParams, TreeShape
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack

WIDTHS = (2, 2, 1, 1)
SHAPE = TreeShape(WIDTHS)


@pytest.fixture(scope="module")
def runners(tiny_pair):
    return ([ModelRunner.from_dir(p, max_kv_tokens=8192) for p in tiny_pair.ssms[:1]],
            [ModelRunner.from_dir(p, max_kv_tokens=8192) for p in tiny_pair.ssms[:1]])


def _cache(speculator: Speculator, state) -> torch.Tensor:
    """The SSM's committed keys and values of one request (what every later tree reads)."""
    runner = speculator.runners[0]
    slots = torch.tensor(state.seq.slots(0, state.seq.num_committed))
    return torch.stack([runner.kv.k[:, slots], runner.kv.v[:, slots]]).float()


def _other_verdicts(path: list[int], bonus: int, vocab: int) -> list[tuple[list[int], int]]:
    """Verdicts other than (path, bonus): another bonus, a shorter accepted prefix, nothing accepted."""
    other = next(t for t in range(2, vocab) if t not in path and t != bonus)
    return [(path, other), (path[:1], other), ([], other)]


def test_a_tree_drafted_ahead_equals_the_tree_drafted_after_the_verdict(runners, greedy_prompts, tiny_pair):
    """Both outcomes of a prediction leave each SSM exactly where ordinary drafting would: the
    same committed cache and the same next tree (the assumed verdict stands: its tree is the
    one that would be built; another verdict: the cache is rolled back and re-read)."""
    (ssm_a,), (ssm_b,) = runners
    ahead_spec, plain_spec = Speculator([ssm_a]), Speculator([ssm_b])
    params = SamplingParams()
    checked = {"stood": 0, "dropped": 0}
    for prompt in greedy_prompts[:6]:
        for case in range(4):  # 0: the assumed verdict; 1-3: others
            a, b = ahead_spec.start(prompt), plain_spec.start(prompt)
            pa, pb_ = Proposal(a, SHAPE, params, None), Proposal(b, SHAPE, params, None)
            (tree_a, trees_a, _, _), = ahead_spec.propose([pa])
            built_b, = plain_spec.propose([pb_])
            tree_b = built_b.tree
            assert tree_a.tokens == tree_b.tokens
            path = predicted_path(trees_a)
            ahead, = build_ahead(ahead_spec, [(pa, trees_a)], max_context=512)
            assert ahead is not None and ahead.path == path
            verdict = (ahead.path, ahead.bonus) if case == 0 else _other_verdicts(path, ahead.bonus, tiny_pair.vocab)[case - 1]
            plain_spec.feedback(b, built_b, *verdict)
            next_b = plain_spec.propose([Proposal(b, SHAPE, params, None)])[0].tree
            stood = settle(ahead_spec, a, ahead, *verdict, WIDTHS)
            if stood is not None:
                next_a = ahead_spec.merge(Proposal(a, SHAPE, params, None), stood)
                checked["stood"] += 1
            else:
                next_a = ahead_spec.propose([Proposal(a, SHAPE, params, None)])[0].tree
                checked["dropped"] += 1
            assert (stood is not None) == (case == 0)
            assert next_a.tokens == next_b.tokens and next_a.parents == next_b.parents
            assert a[0].seq.num_committed == b[0].seq.num_committed
            assert torch.allclose(_cache(ahead_spec, a[0]), _cache(plain_spec, b[0]), atol=1e-5)
            ahead_spec.release(a)
            plain_spec.release(b)
    assert checked["stood"] == 6 and checked["dropped"] == 18


def test_sampled_requests_never_draft_ahead(runners, greedy_prompts):
    (ssm_a,), _ = runners
    spec = Speculator([ssm_a])
    states = spec.start(greedy_prompts[0])
    p = Proposal(states, TreeShape(WIDTHS, policy="merge"), SamplingParams(temperature=1.0, seed=3),
                 SamplingNoise(3, ssm_a.cfg.vocab_size))
    trees = spec.propose([p])[0].ssm_trees
    assert build_ahead(spec, [(p, trees)], max_context=512) == [None]
    spec.release(states)


def _generate(stub, prompt, max_new, **kwargs):
    """The tokens, asserting that no speculator was dropped (a wrong tree would be)."""
    out, last = [], None
    for r in stub.Generate(pb.VerifierGenerateRequest(prompt_ids=prompt, max_new_tokens=max_new, speculate=True,
                                                      **kwargs), timeout=60):
        out += list(r.token_ids)
        last = r
    assert not last.stats.fell_back
    return out


@pytest.mark.parametrize("ssm_index", [0, 1])
def test_pipelined_speculators_keep_greedy_output_identical(tiny_pair, greedy_prompts, ssm_index):
    """Through the services, with pipelining on: the LLM's own greedy tokens, and trees drafted
    ahead both stood and were dropped (the noisier SSM mispredicts more)."""
    llm = ModelRunner.from_dir(tiny_pair.llm)
    engine = Engine.from_runners(llm)
    with start_stack(tiny_pair.llm, [tiny_pair.ssms[ssm_index]], tree_width=WIDTHS, is_load_aware=False,
                     speculator={"is_pipelined": True}) as stack:
        for prompt in greedy_prompts[:5]:
            expected = engine.generate(prompt, mode_params("incremental", 40)).output_ids
            assert _generate(stack.verifier_stub, prompt, 40) == expected
        counts = stack.speculators[0][1].worker.num_ahead
    assert counts["stood"] > 0 and counts["dropped"] > 0, counts


def test_pipelining_off_drafts_nothing_ahead(tiny_pair, greedy_prompts):
    with start_stack(tiny_pair.llm, [tiny_pair.ssms[0]], tree_width=WIDTHS, is_load_aware=False,
                     speculator={"is_pipelined": False}) as stack:
        _generate(stack.verifier_stub, greedy_prompts[0], 24)
        assert stack.speculators[0][1].worker.num_ahead == {"stood": 0, "dropped": 0}


def test_pipelining_is_on_where_the_ssms_have_their_own_device(tiny_pair, greedy_prompts):
    """auto (the default) drafts ahead only off the CPU; on, off and bad values are read as such."""
    from services.speculator.config import parse_config
    from specinfer.errors import UserError

    ssm = str(tiny_pair.ssms[0])
    assert parse_config(["--ssm", ssm]).is_pipelined is None
    assert parse_config(["--ssm", ssm, "--pipeline", "on"]).is_pipelined is True
    assert parse_config(["--ssm", ssm], env={"SPECINFER_PIPELINE": "off"}).is_pipelined is False
    with pytest.raises(UserError, match="pipeline"):
        parse_config(["--ssm", ssm], env={"SPECINFER_PIPELINE": "sometimes"})
    with pytest.raises(SystemExit) as exited:
        parse_config(["--ssm", ssm, "--pipeline", "sometimes"])
    assert exited.value.code == 2
    with start_stack(tiny_pair.llm, [tiny_pair.ssms[0]], tree_width=WIDTHS, is_load_aware=False) as stack:
        assert stack.speculators[0][1].worker.is_pipelined is False  # this host's SSMs run on its CPU
