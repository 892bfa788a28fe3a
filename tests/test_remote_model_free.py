"""Dynamic trees through speculator services, the wire's model-free-only asks, and the KV a
request reserves for its pool's trees.

Each step asks every speculator for a dynamic tree within the verifier's budget
(`SpeculateFeedback.budget`); the speculator decides which members draft and reports the SSM
levels it ran (`SpeculateResponse.ssm_levels`). Greedy output stays the LLM's own. A speculator
still answers the model-free-only asks of the wire (root-only where it hosts no model-free member).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.speculator.config import SpeculatorConfig
from services.speculator.server import build as build_speculator
from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.drafting.speculator import Proposal
from specinfer.engine.drafting.tree import TokenTree
from specinfer.limits import MODEL_FREE_MAX_NODES
from specinfer.params import SamplingParams, TreeBudget, TreeShape
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from policies import FixedBudget
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


def spy_steps(monkeypatch, worker) -> list[tuple[bool, int, int]]:
    """Records (budget given, tree nodes, SSM levels) of every tree `worker` (a SpeculatorWorker) builds."""
    calls: list[tuple[bool, int, int]] = []
    step = worker.step

    def recorded(session, feedback, max_depth, shape=None, timeout=None, is_model_free_only=False, budget=None):
        tree, seconds, levels = step(session, feedback, max_depth, shape, timeout, is_model_free_only, budget)
        calls.append((budget is not None, len(tree), levels))
        return tree, seconds, levels

    monkeypatch.setattr(worker, "step", recorded)
    return calls


def generate(stack, ssm_names=()) -> tuple[list[int], pb.GenerationStats]:
    """A greedy, load-aware request (no shape: the server's default, a dynamic tree per step)."""
    request = pb.VerifierGenerateRequest(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, speculate=True,
                                         ignore_eos=True, ssm_names=list(ssm_names))
    tokens, stats = [], None
    for r in stack.verifier_stub.Generate(request, timeout=120):
        tokens += list(r.token_ids)
        if r.HasField("stats"):
            stats = r.stats
    return tokens, stats


def test_dynamic_trees_through_the_services_keep_greedy_output(stack, incremental, monkeypatch):
    """Each speculator grows its dynamic tree within the verifier's budget (its SSM, lookup and
    suffix in one budget; the other its SSM alone), reports the SSM levels it ran, and the
    merged trees leave the output the LLM's own."""
    engine = stack.verifier_servicer.engine
    monkeypatch.setattr(engine, "guard", None)
    monkeypatch.setattr(engine, "load_policy", FixedBudget())
    levels: list[int] = []
    observe = engine.load_policy.observe_speculation
    monkeypatch.setattr(engine.load_policy, "observe_speculation",
                        lambda n, seconds, decay=0.98: (levels.append(n), observe(n, seconds, decay)))
    hosting = spy_steps(monkeypatch, stack.speculators[0][1].worker)
    runs = [generate(stack) for _ in range(2)]  # the second time the suffix cache holds the first output
    for tokens, stats in runs:
        assert tokens == incremental
        assert not stats.fell_back
    assert hosting and all(has_budget for has_budget, _, _ in hosting)
    assert any(nodes > 1 for _, nodes, _ in hosting)  # dynamic trees, really built
    assert any(n > 0 for _, _, n in hosting) and levels and max(levels) > 0  # SSM levels reported
    assert runs[1][1].tokens_per_step > 2  # and their drafts accepted


def test_model_free_only_asks_on_the_wire(stack, plain_speculator):
    """A speculator still serves the wire's model-free-only asks: root-only where it hosts no
    model-free member; the same stream asked with widths gets a tree."""
    stub = pb_grpc.SpeculatorStub(stack.channel(plain_speculator[0].port))
    shape = pb.TreeShape(widths=[2, 2], max_nodes=16)
    messages = [
        pb.SpeculateRequest(start=pb.SpeculateStart(context_ids=PROMPT, shape=shape, max_depth=4,
                                                    model_free_only=True)),
        pb.SpeculateRequest(feedback=pb.SpeculateFeedback(bonus=3, max_depth=4, shape=shape, model_free_only=True)),
        pb.SpeculateRequest(feedback=pb.SpeculateFeedback(bonus=4, max_depth=4, shape=shape)),
        pb.SpeculateRequest(feedback=pb.SpeculateFeedback(bonus=5, max_depth=4, shape=shape, budget=pb.TreeBudget(
            max_nodes=8, max_depth=3, node_cost=0.001, level_cost=0.001))),
        pb.SpeculateRequest(feedback=pb.SpeculateFeedback(done=True)),
    ]
    answers = list(stub.Speculate(iter(messages), timeout=60))
    trees = [r.tree for r in answers]
    assert [list(t.tokens) for t in trees[:2]] == [[PROMPT[-1]], [3]]
    assert len(trees[2].tokens) > 1 and trees[2].tokens[0] == 4 and answers[2].ssm_levels == 2
    assert trees[3].tokens[0] == 5 and len(trees[3].tokens) <= 9 and answers[3].ssm_levels <= 3


def test_each_speculator_reserves_its_trees_kv(stack, tiny_pair):
    source = stack.verifier_servicer.engine.source
    shape = TreeShape((2, 2), max_nodes=16)
    second = tiny_pair.ssms[1].name
    # Each speculator's tree, model-free drafts included, stays within the shape's node bound...
    assert source.max_draft_nodes((), shape) == 2 * (shape.max_nodes - 1)
    assert source.max_draft_nodes((second,), shape) == shape.max_nodes - 1
    # ... or within a dynamic tree's.
    assert source.max_draft_nodes((), shape, 32) == 2 * 32


def test_a_dynamic_tree_reports_its_ssm_levels_and_is_steady_after_the_first():
    """A dynamic tree costs the SSM levels its speculator ran (none when its SSMs sat the step out);
    every tree but the SSMs' first (which reads the prompt) is a steady step: the tokens of steps
    the SSMs sat out are one pass more of the same cost, and a tree without SSM levels costs what
    the model-free members take."""
    from services.verifier.speculators import SpeculationDriver

    sent: list[str] = []
    levels = iter([2, 3, 0, 2, 1])

    class Link:
        name, is_alive, is_catching_up, last_levels = "s", True, False, 0

        def open(self, start):
            sent.append("start" if start.HasField("budget") else "start-static")

        def offer(self, verified, max_depth, step_timeout_s, shape=None, budget=None):
            sent.append("feedback" if budget is not None else "static")
            return True

        def next_tree(self, timeout_s, vocab_size):
            self.last_levels = next(levels)
            return TokenTree.with_root(7)

    def open_links(start):
        link = Link()
        link.open(start)
        return [link]

    budget = TreeBudget(max_nodes=8, max_depth=4)
    driver = SpeculationDriver(open_links, PROMPT, TreeShape((2, 1)), 100, 1.0)
    steady, depths = [], []
    for _ in range(5):
        driver.ask((), 4, budget)
        draft = driver.tree(7)
        steady.append(driver.is_steady)
        depths.append(draft.depth)
        driver.after_step([7])
    assert sent == ["start"] + ["feedback"] * 4
    assert depths == [2, 3, 0, 2, 1]
    assert steady == [False, True, True, True, True]  # the first SSM tree reads the prompt


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
            tree.add_draft(0, token)
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
        tree = source.speculator.propose([Proposal(states, shape, SamplingParams(), None, 4)])[0].tree
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
