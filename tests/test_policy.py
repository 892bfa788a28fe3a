"""Load-aware speculation: the cost/acceptance policy, and exactness when shapes change per step."""

from __future__ import annotations

import dataclasses

import itertools

import pytest

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.policy import AcceptanceStats, CostModel, LoadAwarePolicy, expected_accepted, num_nodes
from specinfer.engine.runner import ModelRunner
from specinfer.engine.tree import TokenTree
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack

# An LLM pass that is memory-bound up to 16 tokens, then grows linearly (as measured on CPUs).
BANDWIDTH_BOUND = CostModel([(1, 0.010), (16, 0.011), (64, 0.030), (256, 0.110)])


def test_cost_model_interpolates_and_extrapolates():
    assert BANDWIDTH_BOUND.seconds(1) == pytest.approx(0.010)
    assert BANDWIDTH_BOUND.seconds(40) == pytest.approx(0.011 + 0.019 * 24 / 48)
    assert BANDWIDTH_BOUND.seconds(512) > BANDWIDTH_BOUND.seconds(256)


def test_acceptance_stats_learn_containment():
    stats = AcceptanceStats(max_width=3)
    for _ in range(2000):  # the LLM's token is the SSM's first choice 90% of the time
        stats.observe_node(3, 0)
    for _ in range(222):
        stats.observe_node(3, None)
    assert stats.containment(1) == pytest.approx(0.9, abs=0.02)
    assert stats.containment(2) >= stats.containment(1)
    tree = TokenTree.with_root(0)
    a = tree.add_draft(0, 5)
    tree.add_draft(0, 6)
    before = stats.trials[0]
    stats.observe_step(tree, [0, a])  # root: 2 drafts, first accepted; node a: no children
    assert stats.trials[0] == before + 1 and stats.trials[1] > 0


def test_expected_accepted_and_node_count():
    stats = AcceptanceStats(max_width=2, hits=[0.5, 0.75], trials=[1.0, 1.0])
    assert expected_accepted((1, 1), stats) == pytest.approx(0.5 + 0.25)
    assert expected_accepted((2, 1), stats) == pytest.approx(0.75 + 0.375)
    assert num_nodes((2, 2, 1)) == 1 + 2 + 4 + 4


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_policy(level_seconds: float, containment: float, clock=None) -> LoadAwarePolicy:
    policy = LoadAwarePolicy(BANDWIDTH_BOUND, max_depth=8, max_width=3, level_seconds=level_seconds,
                             clock=clock or FakeClock())
    for _ in range(5000):
        policy.stats.observe_node(3, 0 if (_ % 100) < containment * 100 else None)
    return policy


def test_policy_speculates_deep_when_cheap_and_accurate_at_batch_1():
    widths = make_policy(level_seconds=0.0005, containment=0.85).choose(1)
    assert len(widths) >= 5


def test_policy_shrinks_trees_as_the_batch_grows():
    policy = make_policy(level_seconds=0.0005, containment=0.8)
    sizes = [num_nodes(policy.choose(b)) for b in (1, 4, 16, 64)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_policy_switches_speculation_off_when_it_does_not_pay():
    assert make_policy(level_seconds=0.02, containment=0.3).choose(1) == ()
    assert make_policy(level_seconds=0.0005, containment=0.05).choose(1) == ()


class AlternatingPolicy(LoadAwarePolicy):
    """Speculates every other step, with changing shapes: stresses the catch-up protocol.
    Starting with () makes the speculator streams open mid-request, with the context so far."""

    def __init__(self, first=(2, 1, 1)):
        super().__init__(BANDWIDTH_BOUND)
        self._shapes = itertools.cycle([first, (), (1, 1, 1, 1), (), (), (3,)])

    def choose(self, batch_size, is_greedy=True):
        return next(self._shapes)


@pytest.mark.parametrize("first", [(2, 1, 1), ()])
@pytest.mark.parametrize("sampling", [None, pb.SamplingParams(temperature=0.8, seed=7)])
def test_shapes_changing_per_step_stay_exact(tiny_pair, sampling, first):
    stack = start_stack(tiny_pair.llm, [tiny_pair.ssms[0]], is_load_aware=False)
    servicer = stack.verifier_servicer
    try:
        stub = stack.verifier_stub
        prompt = [9, 8, 7, 6, 5]
        kwargs = dict(prompt_ids=prompt, max_new_tokens=60, speculate=True, ignore_eos=True)
        if sampling is not None:
            kwargs["sampling"] = sampling
        runs = []
        for _ in range(2):  # the same seed and the same shape sequence reproduce the output
            engine = servicer.engine  # every request without widths follows this policy, unguarded
            engine.cfg, engine.guard = dataclasses.replace(engine.cfg, is_load_aware=True), None
            bound = engine.cfg.default_shape
            engine.policies[(len(bound.widths), max(bound.widths), bound.max_nodes)] = AlternatingPolicy(first)
            runs.append([t for r in stub.Generate(pb.VerifierGenerateRequest(**kwargs), timeout=30) for t in r.token_ids])
        assert runs[0] == runs[1] and len(runs[0]) == 60
        if sampling is None:
            engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm))
            plain = mode_params("incremental", 60, is_ignore_eos=True)
            assert runs[0] == engine.generate(prompt, plain).output_ids
    finally:
        stack.stop()


def test_speculation_cost_fit_separates_fixed_and_per_level_time():
    policy = LoadAwarePolicy(BANDWIDTH_BOUND)
    for depth in (1, 2, 3, 4) * 50:
        policy.observe_speculation(depth, 0.004 + 0.0015 * depth)
    assert policy.fixed_seconds == pytest.approx(0.004, rel=1e-3)
    assert policy.level_seconds == pytest.approx(0.0015, rel=1e-3)
    # A large fixed cost per speculated step makes speculation pay off less.
    cheap = make_policy(level_seconds=0.0005, containment=0.8)
    costly = make_policy(level_seconds=0.0005, containment=0.8)
    costly.fixed_seconds = 0.02
    assert num_nodes(costly.choose(8)) <= num_nodes(cheap.choose(8))


def test_cost_model_is_monotone_and_learns_from_measured_passes():
    spiky = CostModel([(1, 0.010), (2, 0.350), (4, 0.011), (8, 0.012)]).monotone()
    assert [t for _, t in spiky.points] == [0.010, 0.011, 0.011, 0.012]  # the outlier cannot inflate
    model = CostModel([(1, 0.010), (16, 0.011), (64, 0.030)])
    for _ in range(200):
        model.observe(16, 0.022)  # the machine turned out twice as slow at 16 tokens
    assert model.seconds(16) == pytest.approx(0.022, rel=0.05)
    assert model.seconds(64) >= model.seconds(16) >= model.seconds(1)


def test_only_steady_trees_count_as_speculation_cost():
    """The first tree of a request opens the streams and prefills the SSMs on the whole context,
    and one after plain steps makes them catch up: neither is a step's speculation cost."""
    from services.verifier.speculators import SpeculationDriver
    from specinfer.params import TreeShape

    class Link:
        is_alive, is_catching_up = True, False

        def offer(self, *args):
            return True

    driver = SpeculationDriver(lambda start: [Link()], [5, 6, 7], TreeShape((2, 1)), 100, True, 1.0)
    driver.ask((2, 1))
    assert not driver.is_steady  # opened the stream
    driver.after_step([8, 9])
    driver.ask((2, 1))
    assert driver.is_steady  # one step's tokens
    driver.after_step([10])  # a plain step: nothing asked
    driver.ask(())
    driver.after_step([11])
    driver.ask((2, 1))
    assert not driver.is_steady  # two steps to catch up on


# ---- a choice that cannot stick ------------------------------------------------------------------


def run_policy(policy: LoadAwarePolicy, clock: FakeClock, seconds: float, level_seconds: float) -> list:
    """Steps of one request for `seconds` of fake time; each speculated step costs the LLM pass plus
    `level_seconds` per level (what the SSM costs under the current load). Returns (time, widths)."""
    steps, end, was_speculated = [], clock.now + seconds, False
    while clock.now < end:
        widths = policy.choose(1)
        step_s = BANDWIDTH_BOUND.seconds(num_nodes(widths))
        if widths:
            spec_s = level_seconds * len(widths)
            if was_speculated:  # a steady step (not a catch-up after plain steps)
                policy.observe_speculation(len(widths), spec_s)
            step_s += spec_s
        was_speculated = bool(widths)
        clock.now += step_s
        steps.append((clock.now, widths))
    return steps


def share_speculated(steps) -> float:
    return sum(1 for _, w in steps if w) / len(steps)


@pytest.mark.parametrize("probe_interval_s", [0.5, float("inf")])
def test_speculation_comes_back_within_seconds_after_a_noisy_phase(probe_interval_s):
    """A noisy neighbour makes the SSM 40x slower for a minute: plain decoding wins. Once it leaves,
    speculation pays again, and the policy finds out within seconds: it keeps re-measuring the arm
    it does not choose and forgets costs measured under the old load. Without probes (inf) the
    verdict of the noisy minute would stand for good."""
    clock = FakeClock()
    policy = make_policy(level_seconds=0.0005, containment=0.8, clock=clock)
    policy.probe_interval_s = probe_interval_s
    assert share_speculated(run_policy(policy, clock, 5.0, level_seconds=0.0005)) > 0.9  # pays: speculate
    noisy = run_policy(policy, clock, 60.0, level_seconds=0.02)
    assert share_speculated([s for s in noisy if s[0] > clock.now - 30]) < 0.1  # plain decoding won
    quiet_from = clock.now
    quiet = run_policy(policy, clock, 10.0, level_seconds=0.0005)
    back = next((t for t, _ in quiet if share_speculated([s for s in quiet if t - 1 <= s[0] <= t]) > 0.9), None)
    if probe_interval_s == float("inf"):
        assert back is None  # the mechanism is what brings speculation back
    else:
        assert back is not None and back - quiet_from < 6.0, back
        assert share_speculated([s for s in quiet if s[0] > quiet_from + 5]) > 0.9  # and it stays


# A small, fast LLM (2.5 ms a pass) whose SSM agrees with it 93% of the time but costs 1.7 ms a
# level, and steps that cost 1.2 ms beyond their pass (sampling, bookkeeping): speculation pays
# about 1.5x, though a pass is cheap next to an SSM level.
SMALL_LLM = CostModel([(1, 0.0025), (16, 0.0045), (64, 0.009)])


def run_fresh_policy(is_overhead_seen: bool, seconds: float = 10.0) -> list:
    """A fresh policy deciding for one request; its SSM's drafts are accepted with probability 0.93
    at every level. Returns (time, widths) per step."""
    import random

    rng, clock, level_s, overhead_s = random.Random(0), FakeClock(), 0.0017, 0.0012
    policy = LoadAwarePolicy(SMALL_LLM, max_depth=4, max_width=2, clock=clock)
    policy.observe_speculation(1, 2 * level_s)  # an early probe that paid its catch-up too
    steps, was_speculated = [], False
    while clock.now < seconds:
        widths = policy.choose(1)
        if widths:
            for w in widths:  # the accepted path, level by level, until the LLM disagrees
                is_hit = rng.random() < 0.93
                policy.stats.observe_node(w, 0 if is_hit else None)
                if not is_hit:
                    break
            if was_speculated:
                policy.observe_speculation(len(widths), level_s * len(widths))
            step_s = SMALL_LLM.seconds(num_nodes(widths)) + overhead_s + level_s * len(widths)
        else:
            step_s = SMALL_LLM.seconds(1) + overhead_s
            if is_overhead_seen:
                policy.observe_plain_step(step_s)
        was_speculated = bool(widths)
        clock.now += step_s
        steps.append((clock.now, widths))
    return steps


def test_a_fresh_policy_learns_quickly_that_speculation_pays():
    """From its pessimistic prior, a policy must learn an SSM's worth from the few steps it probes,
    and under the guard it decides only a small share of the steps (its phases), so every second of
    its own time counts. With a step's time beyond its pass modelled (paid once per step, however
    many tokens the step brings) it learns in about 1.5 s of its own time, against 4.5 s without."""

    def learnt_at(steps) -> float:  # when a half-second window was first > 90% speculated
        return next(t for t, _ in steps
                    if t > 0.5 and share_speculated([s for s in steps if t - 0.5 <= s[0] <= t]) > 0.9)

    assert learnt_at(run_fresh_policy(is_overhead_seen=True)) < 2.0
    assert learnt_at(run_fresh_policy(is_overhead_seen=False)) > 4.0


def test_probes_take_a_bounded_share_of_the_time_however_slow_they_are():
    """On a loaded machine a probe's steps can cost ten plain steps: probes then come less often."""
    clock = FakeClock()
    policy = make_policy(level_seconds=0.02, containment=0.3, clock=clock)
    probe_s = total = 0.0
    while clock.now < 600:
        step_s = 3.0 if policy.choose(1) else 0.3
        clock.now += step_s
        total += step_s
        probe_s += step_s if step_s == 3.0 else 0.0
    assert 0 < probe_s / total < 0.12, probe_s / total


def test_model_free_trees_are_an_arm_of_their_own():
    """Where the SSMs do not pay but the pool's model-free drafts (no SSM pass) are accepted, the
    policy chooses model-free-only trees; once they stop being accepted, plain decoding."""
    from specinfer.engine.policy import MODEL_FREE_ONLY

    clock = FakeClock()
    policy = make_policy(level_seconds=0.02, containment=0.3, clock=clock)
    assert policy.choose(1) == ()
    for _ in range(200):
        policy.observe_model_free(num_accepted=4, num_nodes=6)
    assert policy.choose(1, has_model_free=True) == MODEL_FREE_ONLY
    assert policy.choose(1) == ()  # a pool without model-free members never gets it
    for _ in range(400):
        policy.observe_model_free(num_accepted=0, num_nodes=6)
    assert policy.choose(1, has_model_free=True) == ()
    clock.now += 1.0  # unchosen for a while: each arm gets probed, one after the other
    assert {policy.choose(1, has_model_free=True) for _ in range(4)} >= {MODEL_FREE_ONLY}


@pytest.mark.parametrize("is_forgetting", [True, False])
def test_the_guard_returns_to_speculation_within_seconds_after_a_noisy_phase(is_forgetting):
    """The guard measured plain decoding faster for a minute (its bucket time: measured step
    seconds, no wall clock). When speculation is faster again, a retry within `max_explore_s`
    is judged on fresh phases only and wins. Without forgetting (stale phases kept, retries
    backed off to one in 32 phases) it is still plain after 30 seconds."""
    from specinfer.engine.guard import PLAIN, POLICY, SpeculationGuard

    guard = SpeculationGuard() if is_forgetting else SpeculationGuard(max_explore_s=float("inf"),
                                                                      max_age_s=float("inf"))
    elapsed, history = 0.0, []

    def run(seconds: float, rates: dict) -> None:
        nonlocal elapsed
        end = elapsed + seconds
        while elapsed < end:
            widths, ticket = guard.plan(1, lambda: (2, 1, 1))
            arm = POLICY if widths else PLAIN
            tokens = 3 if widths else 1
            guard.observe(ticket, tokens, tokens / rates[arm])
            elapsed += tokens / rates[arm]
            history.append((elapsed, arm))

    run(60.0, {POLICY: 60.0, PLAIN: 100.0})  # noisy: speculation at 0.6x
    assert guard.rates(1)[PLAIN] > guard.rates(1)[POLICY]
    switched = elapsed
    run(30.0, {POLICY: 160.0, PLAIN: 100.0})  # quiet again: speculation at 1.6x
    late = [arm for t, arm in history if t > switched + 6.0]
    if is_forgetting:
        assert late.count(POLICY) / len(late) > 0.9, late.count(POLICY) / len(late)
    else:
        assert late.count(POLICY) / len(late) < 0.5
