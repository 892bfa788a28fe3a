"""Model-free pool members (prompt lookup, suffix speculation): what they draft, how their trees
merge with the SSMs', and that speculating with them keeps greedy output the LLM's own."""

from __future__ import annotations

import pytest

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.drafting.lookup import PromptLookup
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.drafting.speculator import Proposal, Speculator, model_free_member
from specinfer.engine.drafting.suffix import SuffixCache, SuffixSpeculator
from specinfer.engine.drafting.tree import TokenTree, graft
from specinfer.engine.scheduling.workers import SpeculatorWorker
from specinfer.errors import UserError
from specinfer.params import SamplingParams, TreeShape

NEW_TOKENS = 48


def paths_of(tree: TokenTree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(n)) for n in range(1, len(tree)) if not tree.children[n]}


# ---- prompt lookup -------------------------------------------------------------------------------


def test_lookup_drafts_what_followed_the_longest_match():
    lookup = PromptLookup(max_ngram=3, max_paths=2)
    # "7 8" occurred twice before; "6 7 8" only once: the 3-gram match wins, its one continuation.
    state = lookup.start([6, 7, 8, 1, 2, 3, 5, 7, 8, 4, 4, 6, 7, 8])
    assert paths_of(lookup.propose(state, max_depth=3, max_nodes=16)) == {(1, 2, 3)}
    lookup.extend(state, [9])  # no earlier 9: nothing to draft
    assert len(lookup.propose(state, max_depth=3, max_nodes=16)) == 1


def test_lookup_takes_distinct_recent_continuations_within_bounds():
    lookup = PromptLookup(max_ngram=2, max_paths=2)
    state = lookup.start([5, 1, 2, 5, 3, 4, 5, 6, 7, 5])
    tree = lookup.propose(state, max_depth=2, max_nodes=16)
    assert tree.tokens[0] == 5
    assert paths_of(tree) == {(6, 7), (3, 4)}  # the two most recent, not (1, 2)
    assert tree.max_depth == 2
    assert len(lookup.propose(state, max_depth=2, max_nodes=3)) == 3


# ---- suffix speculation --------------------------------------------------------------------------


def test_suffix_prefers_frequent_branches_and_prunes_rare_ones():
    spec = SuffixSpeculator(min_prob=0.3, max_pattern=2, depth_per_match=4.0)
    # After "1 2": 3 followed four times, 9 once (0.2 < 0.3: not drafted).
    context = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 9, 0, 1, 2, 3, 0, 1, 2]
    tree = spec.propose(spec.start(context), max_depth=3, max_nodes=16)
    assert tree.children[0] and tree.tokens[tree.children[0][0]] == 3
    assert 9 not in tree.tokens[1:]
    assert tree.path_tokens(len(tree) - 1)[:2] == [3, 0]


def test_suffix_depth_adapts_to_the_match_length():
    spec = SuffixSpeculator(max_pattern=4, depth_per_match=1.0)
    long_match = list(range(10, 30)) + [0] + list(range(10, 14))  # the last 4 tokens matched
    short_match = list(range(10, 30)) + [0, 13]  # only "13" matched
    assert spec.propose(spec.start(long_match), 8, 32).max_depth == 4
    assert spec.propose(spec.start(short_match), 8, 32).max_depth == 1


def test_suffix_cache_shares_outputs_across_requests_and_stays_bounded():
    cache = SuffixCache(max_tokens=12, max_pattern=3)
    spec = SuffixSpeculator(cache, max_pattern=3)
    first = spec.start([50, 51])
    spec.extend(first, [40, 41, 42, 43, 44])
    spec.release(first)  # its output joins the cache
    second = spec.start([60, 61, 40, 41])
    assert paths_of(spec.propose(second, max_depth=3, max_nodes=16)) == {(42, 43, 44)}
    cache.add(list(range(100, 110)))  # over the bound: the oldest output goes
    assert cache.num_tokens <= 12
    assert len(spec.propose(spec.start([60, 61, 40, 41]), max_depth=3, max_nodes=16)) == 1


def test_a_seeded_suffix_member_drafts_a_drafts_answers_and_keeps_them_past_the_shared_cache():
    answers = [[40, 41, 42, 43, 44], [70, 71, 72], [9]]  # a one-token answer teaches nothing
    seed = SuffixCache.of(answers, max_pattern=3)
    assert seed.num_tokens == 8 and SuffixCache.of([[9]]) is None and SuffixCache.of([]) is None
    seeded = SuffixSpeculator(SuffixCache(max_tokens=12, max_pattern=3), max_pattern=3, seed=seed)
    plain = SuffixSpeculator(SuffixCache(max_tokens=12, max_pattern=3), max_pattern=3)
    context = [60, 61, 40, 41]  # "40 41" occurs only in the seed
    assert paths_of(seeded.propose(seeded.start(context), max_depth=3, max_nodes=16)) == {(42, 43, 44)}
    assert len(plain.propose(plain.start(context), max_depth=3, max_nodes=16)) == 1  # nothing to draft
    seeded.cache.clear()  # recent outputs go; the draft's answers stay
    seeded.cache.add(list(range(100, 120)))
    assert paths_of(seeded.propose(seeded.start(context), max_depth=3, max_nodes=16)) == {(42, 43, 44)}
    member = model_free_member("suffix", 16, answers)
    assert member.seed.num_tokens == 8 and model_free_member("suffix").seed is None


# ---- merging with the SSMs' trees ----------------------------------------------------------------


def test_graft_adds_paths_after_the_ssm_drafts_within_the_node_bound():
    ssm = TokenTree.with_root(1)
    a = ssm.add_draft(0, 2)
    ssm.add_draft(a, 3)
    free = TokenTree.with_root(1)
    b = free.add_draft(0, 2)
    free.add_draft(b, 4)
    free.add_draft(0, 5)
    merged = graft(ssm, free, max_nodes=4)
    assert paths_of(merged) == {(2, 3), (2, 4)}  # the fifth node (token 5) is over the bound
    assert [merged.tokens[c] for c in merged.children[a]] == [3, 4]  # the SSM's draft first
    with pytest.raises(ValueError):
        graft(merged, TokenTree.with_root(9), 8)


def test_pool_member_names():
    assert isinstance(model_free_member("lookup"), PromptLookup)
    assert isinstance(model_free_member("suffix"), SuffixSpeculator)
    with pytest.raises(ValueError):
        model_free_member("ngram")


# ---- end to end: exactness and the pool ----------------------------------------------------------


@pytest.fixture(scope="module")
def runners(tiny_pair):
    llm = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=8192)
    ssm = ModelRunner.from_dir(tiny_pair.ssms[0], max_kv_tokens=8192)
    return llm, ssm


@pytest.fixture(scope="module")
def incremental_outputs(runners, greedy_prompts):
    engine = Engine.from_runners(runners[0])
    return [engine.generate(p, mode_params("incremental", NEW_TOKENS)).output_ids for p in greedy_prompts]


POOLS = {
    "lookup-only": (False, ["lookup"]),
    "suffix-only": (False, ["suffix"]),
    "ssm+lookup+suffix": (True, ["lookup", "suffix"]),
}


@pytest.mark.parametrize("pool", list(POOLS))
def test_mixed_trees_keep_greedy_output_exact(runners, greedy_prompts, incremental_outputs, pool):
    llm, ssm = runners
    has_ssm, names = POOLS[pool]
    engine = Engine.from_runners(llm, [ssm] if has_ssm else [], model_free=[model_free_member(n) for n in names])
    params = mode_params("tree", NEW_TOKENS, TreeShape((2, 2, 1)))
    # Twice: the second time the suffix cache holds every output (repeated tasks), so its drafts
    # are accepted deep; lookup drafts (a random LLM seldom repeats itself) are mostly rejected.
    for _ in range(2):
        accepted = steps = nodes = 0
        for prompt, expected in zip(greedy_prompts, incremental_outputs):
            r = engine.generate(prompt, params)
            assert r.output_ids == expected
            accepted += sum(r.accepted_per_step)
            steps += r.num_llm_steps
            nodes += sum(r.tree_nodes_per_step)
        assert accepted > 0 and nodes / steps > 1.5  # trees were drafted and some accepted
    if "suffix" in names:
        assert accepted / steps > 3, accepted / steps


def test_a_pool_without_ssms_still_speculates_deeper_than_the_widths(runners):
    llm, _ = runners
    engine = Engine.from_runners(llm, model_free=[model_free_member("suffix")])
    params = mode_params("tree", 30, TreeShape((1,)))
    first = engine.generate([7, 8, 9], params)
    again = engine.generate([7, 8, 9], params)  # the suffix cache now holds the first output
    assert again.output_ids == first.output_ids
    assert max(again.accepted_per_step) > 1  # model-free drafts go as deep as the request's bound
    assert again.tokens_per_step > 3


def test_requests_pick_pool_members_by_name(runners):
    llm, ssm = runners
    engine = Engine.from_runners(llm, [ssm], model_free=[model_free_member("lookup"), model_free_member("suffix")])
    assert engine.source.names == ["ssm-0", "lookup", "suffix"]
    assert engine.source.pool(("suffix",)) == [2]
    with pytest.raises(UserError, match="no SSM named"):
        engine.start([1, 2, 3], mode_params("tree", 4, TreeShape((2,)), ssm_names=("ngram",)))


def test_the_speculator_worker_serves_model_free_members_next_to_ssms(runners):
    _, ssm = runners
    worker = SpeculatorWorker(Speculator([ssm], [PromptLookup()]), is_threaded=False)
    worker.worker.is_inline = True
    context = [3, 4, 5, 6, 3, 4]
    shape = TreeShape((1,), max_nodes=6)
    session = worker.open(context, SamplingParams(), shape)
    tree, _, _ = worker.step(session, None, 3)  # SSM widths (1,), lookup three deep
    assert (5, 6, 3) in {tuple(tree.path_tokens(n)) for n in range(len(tree))}
    assert len(tree) <= shape.max_nodes  # one speculator's tree stays within the request's shape
    lookup_only = worker.open(context, SamplingParams(), shape, [1])
    tree, _, _ = worker.step(lookup_only, None, 3)
    assert paths_of(tree) == {(5, 6, 3)}
    worker.close(session)
    worker.close(lookup_only)
    assert ssm.allocator.num_used == 0


def test_model_free_only_proposals_skip_the_ssms(runners):
    _, ssm = runners
    speculator = Speculator([ssm], [PromptLookup()])
    states = speculator.start([3, 4, 5, 6, 3, 4])
    tree, ssm_trees, _, _ = speculator.propose([Proposal(states, TreeShape(()), SamplingParams(), None, 2,
                                                         is_model_free_only=True)])[0]
    assert ssm_trees == [None] and paths_of(tree) == {(5, 6)}
    assert states[0].pending == [3, 4, 5, 6, 3, 4]  # the SSM did not even catch up
    speculator.release(states)


def test_an_ssm_tree_after_a_model_free_only_step_is_not_steady(runners):
    """The SSMs sat the model-free-only step out, so the next SSM tree includes their catch-up:
    the policy must not learn a steady step's speculation cost from it."""
    llm, ssm = runners
    engine = Engine.from_runners(llm, [ssm], model_free=[PromptLookup()])
    drafts = engine.source.drafts("r", [3, 4, 5, 6, 3, 4], mode_params("tree", 8, TreeShape((1,))), TreeShape((1,)),
                                  None)
    steady = []
    for widths, depth in [((1,), 1), ((1,), 1), ((), 2), ((1,), 1), ((1,), 1)]:
        drafts.ask(widths, depth)
        steady.append(drafts.is_steady)
        root = drafts.tree(4).tree.tokens[0]
        drafts.after_step([root + 1])  # any verified token will do: the bookkeeping is what is tested
    drafts.close()
    assert steady == [False, True, True, False, True]


def test_the_speculator_service_hosts_model_free_members_next_to_its_ssm(tiny_pair):
    from specinfer.v1 import specinfer_pb2 as pb
    from util import start_stack

    stack = start_stack(tiny_pair.llm, [tiny_pair.ssms[0]], speculator={"model_free": ("lookup", "suffix")})
    try:
        names = list(stack.verifier_stub.Info(pb.InfoRequest(), timeout=10).ssm_names)
        assert names == [tiny_pair.ssms[0].name, "lookup", "suffix"]
        request = pb.VerifierGenerateRequest(prompt_ids=[5, 6, 7], max_new_tokens=40, speculate=True, ignore_eos=True,
                                             shape=pb.TreeShape(widths=[1, 1], max_nodes=8))
        runs = []
        for _ in range(2):  # the second time the speculator's suffix cache holds the first output
            responses = list(stack.verifier_stub.Generate(request, timeout=60))
            runs.append(([t for r in responses for t in r.token_ids], responses[-1].stats))
        assert runs[0][0] == runs[1][0]
        assert not runs[1][1].fell_back  # the merged tree stayed within the request's node bound
        assert runs[1][1].tokens_per_step > 3  # drafts deeper than the SSM's two levels were accepted
        engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm))
        assert runs[0][0] == engine.generate([5, 6, 7], mode_params("incremental", 40, is_ignore_eos=True)).output_ids
    finally:
        stack.stop()
