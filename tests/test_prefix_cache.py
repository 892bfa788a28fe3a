"""Automatic prefix caching: hash-addressed KV blocks shared across requests, LRU eviction of
blocks nobody holds, and output identical to a cold run."""

from __future__ import annotations

import random

import pytest

from specinfer.engine.scheduling.blocks import BlockAllocator, SequenceKV, block_hash, cache_root
from specinfer.engine.llm_engine import Engine, EngineConfig, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.scheduling.scheduler import SchedulerConfig
from specinfer.errors import CapacityError
from specinfer.params import SamplingParams, TreeShape

SHAPE = TreeShape((2, 2, 1, 1))
ROOT = cache_root()


def config(is_prefix_caching: bool = True) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(admission_timeout_s=0.0, is_prefix_caching=is_prefix_caching))


def prompt_of(seed: int, length: int, vocab: int = 128) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(length)]


def reads(runner: ModelRunner, monkeypatch) -> list[int]:
    """Tokens each forward pass of `runner` reads."""
    seen: list[int] = []
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda works: seen.append(sum(len(w.token_ids) for w in works)) or run(works))
    return seen


# ---- the allocator --------------------------------------------------------------------------


def committed(allocator: BlockAllocator, tokens: list[int], root=ROOT) -> SequenceKV:
    seq = SequenceKV(allocator, root)
    seq.ensure_capacity(len(tokens) + 1)
    seq.advance(tokens)
    return seq


def test_full_committed_blocks_are_found_by_their_tokens_and_everything_before():
    allocator = BlockAllocator(16, 4)
    seq = committed(allocator, list(range(10)))  # two full blocks, one partial
    assert allocator.num_cached == 2 and len(seq.digests) == 2
    assert allocator.match(ROOT, list(range(12)))[0] == seq.block_table[:2]
    assert allocator.match(ROOT, list(range(7)))[0] == seq.block_table[:1]  # only full blocks
    assert allocator.match(ROOT, [9] + list(range(1, 12)))[0] == []  # the first block differs
    assert allocator.match(cache_root("session:x"), list(range(12)))[0] == []  # another namespace
    # the same four tokens after a different first block are a different block
    assert block_hash(block_hash(ROOT, [0, 1, 2, 3]), [4, 5, 6, 7]) != block_hash(block_hash(ROOT, [9, 1, 2, 3]),
                                                                                [4, 5, 6, 7])


def test_blocks_nobody_holds_stay_cached_until_evicted_least_recently_freed_first():
    allocator = BlockAllocator(6, 4)
    old = committed(allocator, list(range(8)))  # blocks 0, 1 cached
    new = committed(allocator, list(range(100, 108)))  # blocks 3, 4 cached (2 and 5 are their partial tails)
    old_blocks, new_blocks = old.block_table[:2], new.block_table[:2]
    old.free()
    new.free()
    assert allocator.num_free == 6 and allocator.num_cached == 4 and allocator.num_used == 0
    taken = allocator.allocate(3)  # two never-used blocks first, then the least recently freed cached one
    assert allocator.num_evicted == 1 and taken[-1] == old_blocks[1]  # a sequence's last block goes first
    assert allocator.match(ROOT, list(range(8)))[0] == [old_blocks[0]]
    assert allocator.match(ROOT, list(range(100, 108)))[0] == new_blocks
    allocator.free(taken)


def test_a_block_in_use_is_never_evicted():
    allocator = BlockAllocator(4, 4)
    holder = committed(allocator, list(range(8)))  # holds 3 blocks, 2 of them cached
    reader = SequenceKV(allocator, ROOT)
    hits, digests = allocator.match(ROOT, list(range(8)))
    reader.adopt(hits, digests, list(range(8)))
    holder.free()  # the reader still holds the cached two
    assert allocator.num_free == 2
    with pytest.raises(CapacityError):
        allocator.allocate(3)
    allocator.free(allocator.allocate(2))
    assert allocator.match(ROOT, list(range(8)))[0] == hits and allocator.num_evicted == 0
    reader.free()


def test_forget_evicts_only_what_nobody_holds():
    allocator = BlockAllocator(8, 4)
    a = committed(allocator, list(range(8)))
    digests = list(a.digests)
    b = SequenceKV(allocator, ROOT)
    b.adopt(*allocator.match(ROOT, list(range(4))), list(range(4)))  # b holds the first block
    a.free()
    assert allocator.forget(digests) == 1  # the second block; the first is in use
    assert allocator.match(ROOT, list(range(8)))[0] == b.block_table[:1]
    b.free()


def test_a_sequence_without_a_cache_root_addresses_nothing():
    allocator = BlockAllocator(8, 4)
    seq = SequenceKV(allocator)
    seq.ensure_capacity(9)
    seq.advance(list(range(8)))
    assert allocator.num_cached == 0 and seq.token_ids == []


# ---- through the engine -----------------------------------------------------------------------


@pytest.fixture
def llm(tiny_pair):
    return ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=4096)


@pytest.fixture
def ssm(tiny_pair):
    return ModelRunner.from_dir(tiny_pair.ssms[0], max_kv_tokens=4096)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=5)],
                         ids=["greedy", "sampled"])
def test_a_cache_hit_gives_the_cold_runs_output_and_skips_the_shared_prefix(tiny_pair, llm, ssm, sampling,
                                                                            monkeypatch):
    system = prompt_of(1, 200)
    questions = [prompt_of(10 + i, 9) for i in range(4)]
    params = mode_params("tree", 24, SHAPE, sampling=sampling, is_ignore_eos=True)
    cold_engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=4096),
                                      [ModelRunner.from_dir(tiny_pair.ssms[0])], config(False))
    cold = [cold_engine.generate(system + q, params).output_ids for q in questions]
    engine = Engine.from_runners(llm, [ssm], config(True))
    seen = reads(llm, monkeypatch)
    results, reused = [], []
    for q in questions:
        generation = engine.start(system + q, params)
        reused.append(generation.session.num_reused)
        results.append(engine.generate_batch([generation])[0])
    assert [r.output_ids for r in results] == cold
    shareable = len(system) // llm.allocator.block_size * llm.allocator.block_size
    assert reused[0] == 0 and all(n >= shareable for n in reused[1:])
    assert all(n >= 0.8 * (len(system) + 9) for n in reused[1:])  # at least 80% of each later prompt
    prompt_reads = sum(seen[:1])
    assert prompt_reads >= len(system)  # the first request read the system prompt
    assert llm.allocator.num_used == 0  # every block is free again (and still cached)
    assert engine.scheduler.cache_stats.num_hits == sum(reused)


def test_requests_arriving_together_read_their_common_prefix_once(tiny_pair, llm, ssm, monkeypatch):
    system = prompt_of(2, 160)
    prompts = [system + prompt_of(20 + i, 7) for i in range(4)]
    params = mode_params("tree", 16, SHAPE, is_ignore_eos=True)
    cold_llm = ModelRunner.from_dir(tiny_pair.llm)
    cold = Engine.from_runners(cold_llm, [ModelRunner.from_dir(tiny_pair.ssms[0])], config(False))
    cold_reads = reads(cold_llm, monkeypatch)
    expected = [r.output_ids for r in cold.generate_batch([cold.start(p, params) for p in prompts])]
    engine = Engine.from_runners(llm, [ssm], config(True))
    seen = reads(llm, monkeypatch)
    generations = [engine.start(p, params) for p in prompts]  # admitted together: nothing is cached yet
    assert [g.session.num_reused for g in generations] == [0] * 4
    results = engine.generate_batch(generations)
    assert [r.output_ids for r in results] == expected
    shared = len(system) // llm.allocator.block_size * llm.allocator.block_size
    assert engine.scheduler.cache_stats.num_hits == 3 * shared  # the followers adopted the leader's blocks
    assert sum(cold_reads) - sum(seen) == 3 * shared  # and never read those tokens themselves


def test_a_later_turn_of_a_conversation_reuses_its_whole_history(tiny_pair, llm, ssm):
    engine = Engine.from_runners(llm, [ssm], config(False))  # sessions share even with caching off
    params = mode_params("tree", 20, SHAPE, is_ignore_eos=True)
    turn1 = prompt_of(3, 40)
    first = engine.generate_batch([engine.start(turn1, params, session_id="chat")])[0]
    turn2 = turn1 + first.output_ids + prompt_of(4, 5)
    second = engine.start(turn2, params, session_id="chat")
    history = len(turn1) + len(first.output_ids) - 1  # the last output token was never committed
    assert second.session.num_reused == history // llm.allocator.block_size * llm.allocator.block_size
    result = engine.generate_batch([second])[0]
    cold = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm), [ModelRunner.from_dir(tiny_pair.ssms[0])],
                               config(False))
    assert result.output_ids == cold.generate(turn2, params).output_ids
    other = engine.start(turn2, params)  # no session, caching off: nothing shared
    assert other.session.num_reused == 0
    engine.finish(other)


def test_under_memory_pressure_outputs_stay_exact_and_nothing_leaks(tiny_pair):
    """A cache of 28 blocks (448 tokens) serves prompts of 6 to 9 blocks from five prefix groups,
    interleaved: cached blocks are evicted and reused all the time."""
    llm = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=28 * 16)
    engine = Engine.from_runners(llm, [ModelRunner.from_dir(tiny_pair.ssms[0])], config(True))
    cold = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm), [ModelRunner.from_dir(tiny_pair.ssms[0])],
                               config(False))
    prefixes = [prompt_of(50 + g, 90 + 15 * g) for g in range(5)]
    params = mode_params("tree", 16, SHAPE, is_ignore_eos=True)
    rng = random.Random(7)
    expected: dict[tuple[int, ...], list[int]] = {}
    hits = 0
    for i in range(30):
        prompts = [prefixes[rng.randrange(5)] + prompt_of(1000 + i, 5)]
        if i % 3 == 0:  # two at once: one of them may hold blocks the other would evict
            prompts.append(prefixes[(i // 3) % 5] + [7, 7, 7])
        generations = [engine.start(p, params) for p in prompts]
        hits += sum(g.session.num_reused > 0 for g in generations)
        for prompt, result in zip(prompts, engine.generate_batch(generations)):
            key = tuple(prompt)
            if key not in expected:
                expected[key] = cold.generate(list(key), params).output_ids
            assert result.output_ids == expected[key]
    assert llm.allocator.num_evicted > 0 and hits > 10
    assert llm.allocator.num_used == 0


def test_a_request_larger_than_the_whole_cache_is_refused_clearly(tiny_pair):
    llm = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=4 * 16)
    engine = Engine.from_runners(llm, [], config(True))
    with pytest.raises(CapacityError, match="the cache holds 64"):
        engine.start(prompt_of(9, 60), mode_params("incremental", 16))
    small = engine.generate(prompt_of(9, 20), mode_params("incremental", 8))  # the engine goes on
    assert len(small.output_ids) > 0 and llm.allocator.num_used == 0


def test_speculative_rows_never_enter_the_cache(tiny_pair, llm, ssm):
    """After every step, exactly the full blocks of the committed prefix are addressable, and
    each one's hash is that of the tokens the request committed (prompt and accepted output)."""
    engine = Engine.from_runners(llm, [ssm], config(True))
    params = mode_params("tree", 40, TreeShape((3, 2, 2, 1)), is_ignore_eos=True)
    prompt = prompt_of(21, 30)
    generation = engine.start(prompt, params)
    seq = generation.session.state.seq
    size = llm.allocator.block_size
    while not generation.is_done:
        engine.step([generation])
        if generation.is_done:
            break
        tokens = prompt + generation.result.output_ids
        assert seq.token_ids == tokens[:seq.num_committed]
        assert len(seq.digests) == seq.num_committed // size
        parent = ROOT
        for b, digest in enumerate(seq.digests):
            parent = block_hash(parent, tokens[b * size:(b + 1) * size])
            assert digest == parent and llm.allocator.lookup(digest) == seq.block_table[b]
    engine.finish(generation)
    assert llm.allocator.num_cached == len(seq.digests) > 0 and llm.allocator.num_used == 0
