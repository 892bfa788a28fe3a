"""The load-aware policy's model-free-only arm through speculator services, and the KV a request
reserves for its pool's trees.

A step of a request whose pool has a model-free member may ask for those members' drafts alone
(`SpeculateStart.model_free_only`, `SpeculateFeedback.model_free_only`): no SSM pass. Greedy
output stays the LLM's own; a speculator that hosts no model-free member answers root-only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.speculator.config import SpeculatorConfig
from services.speculator.server import build as build_speculator
from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.policy import MODEL_FREE_ONLY
from specinfer.engine.runner import ModelRunner
from specinfer.engine.speculator import Proposal
from specinfer.engine.tree import TokenTree
from specinfer.limits import MODEL_FREE_MAX_NODES
from specinfer.params import GenerationParams, SamplingParams, TreeShape
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from util import start_stack

PROMPT = [9, 8, 7, 6, 5, 9, 8, 7]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def plain_speculator(tiny_pair):
    """A speculator with an SSM and no model-free member."""
    server, servicer = build_speculator(SpeculatorConfig((tiny_pair.ssms[1],), port=0, device="cpu", grace_s=0))
    yield server, servicer
    server.stop(0)


@pytest.fixture(scope="module")
def stack(tiny_pair, plain_speculator):
    """A verifier with two speculators: one hosts an SSM, lookup and suffix; one an SSM alone."""
    plain = f"127.0.0.1:{plain_speculator[0].port}"
    with start_stack(tiny_pair.llm, [tiny_pair.ssms[0]], speculator={"model_free": ("lookup", "suffix")},
                     speculator_addrs=[plain]) as running:
        yield running


@pytest.fixture(scope="module")
def incremental(tiny_pair) -> list[int]:
    engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm))
    return engine.generate(PROMPT, mode_params("incremental", NEW_TOKENS, is_ignore_eos=True)).output_ids


def spy_steps(monkeypatch, worker) -> list[tuple[bool, int]]:
    """Records (model-free-only, tree nodes) of every tree `worker` (a SpeculatorWorker) builds."""
    calls: list[tuple[bool, int]] = []
    step = worker.step

    def recorded(session, feedback, max_depth, shape=None, timeout=None, is_model_free_only=False):
        tree, seconds = step(session, feedback, max_depth, shape, timeout, is_model_free_only)
        calls.append((is_model_free_only, len(tree)))
        return tree, seconds

    monkeypatch.setattr(worker, "step", recorded)
    return calls


def force_model_free_only(monkeypatch, engine) -> list[int]:
    """The policy picks MODEL_FREE_ONLY whenever the request's drafts offer it (plain decoding
    otherwise), unguarded; returns the depths the policy was told speculation cost."""
    policy = engine.policy(engine.cfg.default_shape)
    monkeypatch.setattr(engine, "guard", None)
    monkeypatch.setattr(policy, "choose", lambda batch, is_greedy=True, has_model_free=False:
                        MODEL_FREE_ONLY if has_model_free else ())
    observed: list[int] = []
    monkeypatch.setattr(policy, "observe_speculation", lambda depth, seconds, decay=0.98: observed.append(depth))
    return observed


def generate(stack, ssm_names=()) -> tuple[list[int], pb.GenerationStats]:
    """A greedy, load-aware request (no shape: the server's default, widths chosen per step)."""
    request = pb.VerifierGenerateRequest(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, speculate=True,
                                         ignore_eos=True, ssm_names=list(ssm_names))
    tokens, stats = [], None
    for r in stack.verifier_stub.Generate(request, timeout=120):
        tokens += list(r.token_ids)
        if r.HasField("stats"):
            stats = r.stats
    return tokens, stats


def test_model_free_only_steps_through_the_services_keep_greedy_output(stack, incremental, monkeypatch):
    engine = stack.verifier_servicer.engine
    observed = force_model_free_only(monkeypatch, engine)
    worker = stack.speculators[0][1].worker
    hosting = spy_steps(monkeypatch, worker)
    ssm = worker.speculator.runners[0]
    ssm_passes: list[int] = []
    run = ssm.run

    def counted(works, *args, **kwargs):
        ssm_passes.append(len(works))
        return run(works, *args, **kwargs)

    monkeypatch.setattr(ssm, "run", counted)
    runs = [generate(stack) for _ in range(2)]  # the second time the suffix cache holds the first output
    for tokens, stats in runs:
        assert tokens == incremental
        assert not stats.fell_back
    assert hosting and all(is_model_free_only for is_model_free_only, _ in hosting)
    assert any(nodes > 1 for _, nodes in hosting)  # model-free trees, really built
    assert not ssm_passes  # and not one SSM pass
    assert runs[1][1].tokens_per_step > 2  # and their drafts accepted
    assert not observed  # a model-free-only step teaches the policy no SSM level cost


def test_a_speculator_without_model_free_members_answers_root_only(stack, plain_speculator, incremental,
                                                                    monkeypatch):
    engine = stack.verifier_servicer.engine
    force_model_free_only(monkeypatch, engine)
    plain = spy_steps(monkeypatch, plain_speculator[1].worker)
    tokens, stats = generate(stack)
    assert tokens == incremental and not stats.fell_back  # its root-only trees did not drop it
    assert plain and all(is_model_free_only and nodes == 1 for is_model_free_only, nodes in plain)

    # On the wire: model-free-only asks get the root; the same stream asked with widths gets a tree.
    stub = pb_grpc.SpeculatorStub(stack.channel(plain_speculator[0].port))
    shape = pb.TreeShape(widths=[2, 2], max_nodes=16)
    messages = [
        pb.SpeculateRequest(start=pb.SpeculateStart(context_ids=PROMPT, shape=shape, max_depth=4,
                                                    model_free_only=True)),
        pb.SpeculateRequest(feedback=pb.SpeculateFeedback(bonus=3, max_depth=4, shape=shape, model_free_only=True)),
        pb.SpeculateRequest(feedback=pb.SpeculateFeedback(bonus=4, max_depth=4, shape=shape)),
        pb.SpeculateRequest(feedback=pb.SpeculateFeedback(done=True)),
    ]
    trees = [r.tree for r in stub.Speculate(iter(messages), timeout=60)]
    assert [list(t.tokens) for t in trees[:2]] == [[PROMPT[-1]], [3]]
    assert len(trees[2].tokens) > 1 and trees[2].tokens[0] == 4


def test_the_driver_offers_model_free_only_when_the_pool_has_a_model_free_member(stack, tiny_pair):
    source = stack.verifier_servicer.engine.source
    shape = TreeShape((2, 2), max_nodes=16)

    def has_model_free(ssm_names: tuple[str, ...]) -> bool:
        drafts = source.drafts("r", PROMPT, GenerationParams(max_new_tokens=8, ssm_names=ssm_names), shape, 10.0)
        try:
            return drafts.has_model_free
        finally:
            drafts.close()

    first, second = tiny_pair.ssms[0].name, tiny_pair.ssms[1].name
    assert has_model_free(()) and has_model_free(("lookup",)) and has_model_free((second, "suffix"))
    assert not has_model_free((first,)) and not has_model_free((second,))
    # Each speculator's tree, model-free drafts included, stays within the shape's node bound.
    assert source.max_draft_nodes((), shape) == 2 * (shape.max_nodes - 1)
    assert source.max_draft_nodes((second,), shape) == shape.max_nodes - 1


def test_a_model_free_only_step_is_no_ssm_cost_and_unsteadies_the_next_ssm_tree():
    """Model-free drafts cost no SSM pass: their tree reports no SSM levels, and the SSM tree after
    one catches up on its tokens first (the first, on the whole prompt): not a steady step."""
    from services.verifier.speculators import SpeculationDriver

    sent: list[tuple[str, bool]] = []

    class Link:
        name, is_alive, is_catching_up = "s", True, False

        def open(self, start):
            sent.append(("start", start.model_free_only))

        def offer(self, verified, max_depth, step_timeout_s, shape=None, is_model_free_only=False):
            sent.append(("feedback", is_model_free_only))
            return True

        def next_tree(self, timeout_s, vocab_size, is_greedy):
            return TokenTree.with_root(7)

    def open_links(start):
        link = Link()
        link.open(start)
        return [link]

    without = SpeculationDriver(open_links, PROMPT, TreeShape((2, 1)), 100, True, 1.0)
    without.ask((), 4)  # no model-free member: nothing to ask
    assert not sent and without.tree(7).depth == 0

    driver = SpeculationDriver(open_links, PROMPT, TreeShape((2, 1)), 100, True, 1.0, has_model_free=True)
    driver.ask((), 4)
    assert sent == [("start", True)] and not driver.is_steady and driver.tree(7).depth == 0
    driver.after_step([7])
    driver.ask((2, 1), 4)
    assert sent[-1] == ("feedback", False) and not driver.is_steady  # the SSMs read the prompt first
    assert driver.tree(7).depth == 2
    driver.after_step([7])
    driver.ask((2, 1), 4)
    assert driver.is_steady
    driver.tree(7)
    driver.after_step([7])
    driver.ask((), 4)
    assert sent[-1] == ("feedback", True) and not driver.is_steady
    driver.tree(7)
    driver.after_step([7])
    driver.ask((2, 1), 4)
    assert not driver.is_steady  # the SSMs catch up on the model-free step's tokens first


# ---- the KV a request reserves for its trees -------------------------------------------------------


class Greedy:
    """A model-free member that drafts every token it can below the root, whatever it is allowed:
    only `Speculator.merge`'s bound stops it."""

    def __init__(self, name: str, vocab: int):
        self.name, self.vocab = name, vocab

    def start(self, context_ids: list[int]) -> SimpleNamespace:
        return SimpleNamespace(tokens=list(context_ids))

    def extend(self, state: SimpleNamespace, tokens: list[int]) -> None:
        state.tokens.extend(tokens)

    def propose(self, state: SimpleNamespace, max_depth: int, max_nodes: int) -> TokenTree:
        tree = TokenTree.with_root(state.tokens[-1])
        for token in range(self.vocab):
            tree.add_draft(0, token, None)
        return tree

    def release(self, state: SimpleNamespace) -> None:
        pass


@pytest.mark.parametrize("max_nodes", [32, 8])
@pytest.mark.parametrize("has_ssm", [True, False])
def test_the_largest_tree_fills_the_reservation_exactly(pair_runners, tiny_pair, has_ssm, max_nodes):
    llm, ssms = pair_runners
    members = [Greedy("a", tiny_pair.vocab), Greedy("b", tiny_pair.vocab)]
    engine = Engine.from_runners(llm, ssms[:1] if has_ssm else [], model_free=members)
    shape = TreeShape((8, 8), max_nodes=max_nodes)
    source = engine.source
    expected = (max_nodes - 1 if has_ssm else 0) + 2 * min(max_nodes, MODEL_FREE_MAX_NODES)
    assert source.max_draft_nodes((), shape) == expected
    assert source.max_draft_nodes(("a",), shape) == min(max_nodes, MODEL_FREE_MAX_NODES)

    states = source.speculator.start(PROMPT, source.pool(()))
    try:
        tree, _ = source.speculator.propose([Proposal(states, shape, SamplingParams(), None, 4)])[0]
    finally:
        source.speculator.release(states)
    assert len(tree) - 1 == source.max_draft_nodes((), shape)  # the bound the tree hit is the one reserved

    # Through the engine: every step's tree is the largest, and each fits the KV reserved at admission.
    params = mode_params("tree", 24, shape, is_ignore_eos=True)
    generation = engine.start(PROMPT, params)
    seq = generation.session.state.seq
    reserved, block_size = seq.capacity, seq.allocator.block_size
    result = engine.generate_batch([generation])[0]
    assert len(result.output_ids) == 24
    assert max(result.tree_nodes_per_step) == expected + 1
    assert 0 <= reserved - (len(PROMPT) + 24 + 1 + expected) < block_size  # nothing beyond it but rounding
