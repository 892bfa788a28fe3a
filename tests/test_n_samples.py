"""n > 1: the samples of one prompt share its KV (the prompt is read once) and each sample is
exactly the request it would be alone with its own seed (`sample_seed(seed, i)`). With prefix
caching off, the samples of one request still share within their group's own cache namespace."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from specinfer.engine.scheduling.blocks import BlockAllocator, SequenceKV, cache_root
from specinfer.engine.llm_engine import Engine, EngineConfig, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.scheduling.scheduler import SchedulerConfig
from specinfer.errors import UserError
from specinfer.params import GenerationParams, SampleProgress, SamplingParams, TreeShape, sample_params, sample_seed

NUM_SAMPLES = 3
NEW_TOKENS = 20
SHAPE = TreeShape((1, 2, 1, 1))
NO_PREFIX_CACHING = EngineConfig(scheduler=SchedulerConfig(admission_timeout_s=0.0, is_prefix_caching=False))


@pytest.fixture(scope="module")
def runners(tiny_pair):
    return ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=8192), ModelRunner.from_dir(tiny_pair.ssms[0])


@pytest.fixture(scope="module")
def long_prompt(tiny_pair):
    rng = random.Random(99)
    return [rng.randrange(2, tiny_pair.vocab) for _ in range(77)]


def counting(llm, monkeypatch) -> list[int]:
    """Tokens each forward pass of `llm` reads."""
    seen: list[int] = []
    run = llm.run
    monkeypatch.setattr(llm, "run", lambda works: seen.append(sum(len(w.token_ids) for w in works)) or run(works))
    return seen


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11)],
                         ids=["greedy", "sampled"])
def test_samples_share_the_prompt_and_equal_independent_requests(runners, long_prompt, sampling, monkeypatch):
    llm, ssm = runners
    engine = Engine.from_runners(llm, [ssm], NO_PREFIX_CACHING)  # the independent runs share nothing
    seeds = [sample_seed(sampling.seed or 0, i) for i in range(NUM_SAMPLES)]
    params = [mode_params("tree", NEW_TOKENS, SHAPE, sampling=SamplingParams(
        sampling.temperature, sampling.top_p, seed=s), is_ignore_eos=True) for s in seeds]
    seen = counting(llm, monkeypatch)
    alone = [engine.generate(long_prompt, p) for p in params]
    tokens_alone = sum(seen)
    seen.clear()
    group = "req-greedy" if sampling.is_greedy else "req-sampled"  # a namespace of its own
    grouped = [engine.start(long_prompt, p, prefix_group=group) for p in params]
    reused = []
    while any(not g.is_done for g in grouped):
        engine.step(grouped)
        reused = reused or [g.session.num_reused for g in grouped]
    for g in grouped:
        engine.finish(g)
    assert [g.result.output_ids for g in grouped] == [r.output_ids for r in alone]
    block = llm.allocator.block_size
    shared = (len(long_prompt) - 1) // block * block
    assert shared > 0 and reused == [0] + [shared] * (NUM_SAMPLES - 1)
    assert tokens_alone - sum(seen) == shared * (NUM_SAMPLES - 1)  # the shared prompt was read once
    assert llm.allocator.num_used == 0  # every holder freed its blocks
    if not sampling.is_greedy:  # distinct seeds: the samples differ
        assert len({tuple(g.result.output_ids) for g in grouped}) > 1


def test_a_member_whose_leader_is_gone_reads_the_prompt_itself(runners, long_prompt):
    llm, ssm = runners
    engine = Engine.from_runners(llm, [ssm], NO_PREFIX_CACHING)
    params = mode_params("tree", 8, SHAPE, is_ignore_eos=True)
    leader = engine.start(long_prompt, params, prefix_group="gone")
    engine.finish(leader)
    member = engine.start(long_prompt, params, prefix_group="gone")
    result = engine.generate_batch([member])[0]
    assert result.output_ids == engine.generate(long_prompt, params).output_ids
    assert llm.allocator.num_used == 0


def test_shared_blocks_are_freed_by_their_last_holder():
    allocator = BlockAllocator(8, 4)
    root = cache_root("group:g")
    a, b = SequenceKV(allocator, root), SequenceKV(allocator, root)
    a.ensure_capacity(12)
    a.advance(list(range(9)))
    b.ensure_capacity(12)
    hits, digests = allocator.match(root, list(range(9)))
    assert hits == a.block_table[:2]
    b.adopt(hits, digests, list(range(9)))
    assert b.block_table[:2] == a.block_table[:2] and b.num_committed == 8 and allocator.num_used == 4
    a.free()
    assert allocator.num_used == 3  # b still holds the two shared blocks and its own third
    b.free()
    assert allocator.num_used == 0 and allocator.num_cached == 2  # free, and still addressable
    with pytest.raises(ValueError):
        allocator.free([0])


def test_sample_seeds_are_distinct_and_keep_sample_zero():
    seeds = [sample_seed(5, i) for i in range(16)]
    assert seeds[0] == 5 and len(set(seeds)) == 16 and all(0 <= s < 1 << 63 for s in seeds)


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_a_user_error(n):
    with pytest.raises(UserError, match="n: must be"):
        GenerationParams(num_samples=n)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11)],
                         ids=["greedy", "sampled"])
def test_start_samples_seeds_each_with_sample_seed_and_reads_the_prompt_once(runners, long_prompt, sampling,
                                                                              monkeypatch):
    llm, ssm = runners
    engine = Engine.from_runners(llm, [ssm], NO_PREFIX_CACHING)
    params = mode_params("tree", NEW_TOKENS, SHAPE, sampling=sampling, is_ignore_eos=True, num_samples=NUM_SAMPLES)
    seen = counting(llm, monkeypatch)
    alone = [engine.generate(long_prompt, sample_params(params, i)).output_ids for i in range(NUM_SAMPLES)]
    tokens_alone = sum(seen)
    seen.clear()
    samples = engine.start_samples(long_prompt, params, "req")
    results = engine.generate_batch([g for _, g in samples])
    assert [i for i, _ in samples] == list(range(NUM_SAMPLES))
    assert [r.output_ids for r in results] == alone
    shared = (len(long_prompt) - 1) // llm.allocator.block_size * llm.allocator.block_size
    assert shared > 0 and tokens_alone - sum(seen) == shared * (NUM_SAMPLES - 1)  # the prompt was read once
    assert llm.allocator.num_used == 0
    if not sampling.is_greedy:  # sample_seed's distinct seeds: the samples differ
        assert len({tuple(ids) for ids in alone}) > 1
        assert alone[1] == engine.generate(long_prompt, replace(params, num_samples=1, sampling=replace(
            sampling, seed=sample_seed(sampling.seed, 1)))).output_ids


def test_start_samples_continues_listed_samples_from_their_tokens(runners, long_prompt):
    """A call continuing an n > 1 request part way: each listed sample goes on from its tokens
    so far and ends as it would have uninterrupted; the samples not listed do not run."""
    llm, ssm = runners
    engine = Engine.from_runners(llm, [ssm], NO_PREFIX_CACHING)
    params = mode_params("tree", NEW_TOKENS, SHAPE, sampling=SamplingParams(temperature=0.8, seed=3),
                         is_ignore_eos=True, num_samples=4)
    whole = [r.output_ids for r in engine.generate_batch([g for _, g in engine.start_samples(long_prompt, params)])]
    progress = (SampleProgress(1, tuple(whole[1][:5])), SampleProgress(3, tuple(whole[3][:11])))
    samples = engine.start_samples(long_prompt, params, progress=progress)
    rest = engine.generate_batch([g for _, g in samples])
    assert [i for i, _ in samples] == [1, 3]
    assert list(whole[1][:5]) + rest[0].output_ids == whole[1]
    assert list(whole[3][:11]) + rest[1].output_ids == whole[3]
    for bad in [(SampleProgress(4),), (SampleProgress(1), SampleProgress(1)),
                (SampleProgress(0, tuple(whole[0])),)]:
        with pytest.raises(UserError, match="samples:"):
            engine.start_samples(long_prompt, params, progress=bad)
    assert llm.allocator.num_used == 0
