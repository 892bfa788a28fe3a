"""Load-aware speculation: the policy that prices each step's dynamic tree (or none), the
drafting-cost fit, a choice that cannot stick, and exactness when trees change per step."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from specinfer.engine.drafting.dynamic import Calibration, MemberGain
from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.scheduling.policy import CostModel, LoadAwarePolicy, StepStats, batch_bucket
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.params import TreeBudget
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack

# An LLM pass that is memory-bound up to 16 tokens, then grows linearly (as measured on CPUs).
BANDWIDTH_BOUND = CostModel([(1, 0.010), (16, 0.011), (64, 0.030), (256, 0.110)])


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_cost_model_interpolates_and_extrapolates():
    assert BANDWIDTH_BOUND.seconds(1) == pytest.approx(0.010)
    assert BANDWIDTH_BOUND.seconds(40) == pytest.approx(0.011 + 0.019 * 24 / 48)
    assert BANDWIDTH_BOUND.seconds(512) > BANDWIDTH_BOUND.seconds(256)


def learnt(policy: LoadAwarePolicy, accepted: float, nodes: int, levels: int, batch_size: int = 1,
           num_steps: int = 200) -> LoadAwarePolicy:
    for _ in range(num_steps):
        policy.observe_step(round(accepted), nodes, levels, batch_size)
    return policy


def test_step_stats_average_and_know_their_uncertainty():
    stats = StepStats(1.5, 6.0, 3.0)
    for i in range(400):
        stats.observe(4 if i % 2 else 0, 5, 2)
    assert stats.accepted == pytest.approx(2.0, abs=0.1) and stats.nodes == pytest.approx(5.0, abs=0.01)
    assert stats.levels == pytest.approx(2.0, abs=0.01)
    assert stats.accepted < stats.optimistic() < stats.accepted + 1.5  # about two standard errors more


def test_node_cost_grows_with_the_batch_and_level_cost_with_the_ssm():
    """Sequoia's point: the same node costs more where the pass is past its memory-bound regime."""
    policy = LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.001)
    costs = [policy.budget(b).node_cost for b in (1, 4, 16, 64)]
    assert costs == sorted(costs) and costs[-1] > 10 * costs[0], costs
    slow_ssm = LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.004)
    assert slow_ssm.budget(1).level_cost > 2 * policy.budget(1).level_cost


def test_a_flat_stretch_of_the_calibrated_curve_does_not_make_nodes_free():
    """As calibrated on a 2-core CPU: 4 and 8 tokens timed alike, then a steep stretch. Priced at
    the slope at the trees' size alone, a node would be free at 6 nodes (trees grow into the
    steep stretch, then shrink back); priced at the trees' average alone, free for one-node trees
    at a batch of 4. At the larger of the two it is never free, and costs about as much at 6
    nodes as at 10."""
    kinked = CostModel([(1, 0.0063), (2, 0.0071), (4, 0.0081), (8, 0.0081), (16, 0.0119), (32, 0.0212)])
    small, large = (learnt(LoadAwarePolicy(kinked, level_seconds=0.0005), 2, nodes, 0).budget(1).node_cost
                    for nodes in (6, 10))
    base_s = kinked.seconds(1)  # no step overhead or drafting measured yet
    assert small == pytest.approx((kinked.seconds(7) - kinked.seconds(1)) / 6 / base_s, rel=0.05)  # the average
    assert small > 0.02 and 0.5 < small / large < 2.0, (small, large)
    policy = LoadAwarePolicy(kinked, level_seconds=0.0005)
    assert policy.node_seconds(1, 6) * 6 == pytest.approx(kinked.seconds(7) - kinked.seconds(1))
    assert policy.node_seconds(4, 1) == pytest.approx(kinked.seconds(12) - kinked.seconds(8))  # the slope


def test_policy_speculates_where_it_pays_and_decodes_plainly_where_it_does_not():
    assert isinstance(learnt(LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.0005), 3, 8, 3).choose(1), TreeBudget)
    # Trees that are seldom accepted, or an SSM that costs more than it brings: plain decoding.
    assert learnt(LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.0005), 0, 8, 3).choose(1) == ()
    assert learnt(LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.02), 1, 4, 3).choose(1) == ()


@pytest.mark.parametrize("free_members", [("lookup", "suffix"), ()])
def test_a_costly_ssm_does_not_take_the_model_free_members_speculation_with_it(free_members):
    """Steps with the SSM's levels do not pay (its level costs as much as the LLM's pass); steps
    without them, the model-free members' drafts alone, do. A pool with model-free members keeps
    speculating: from the start (their prior has no levels) and on what such steps measured. A
    pool without them decodes plainly: its steps without SSM levels have no drafts."""
    fresh = LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.01, free_members=free_members, clock=FakeClock())
    assert isinstance(fresh.choose(1), TreeBudget) == bool(free_members)
    policy = learnt(learnt(LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.01, free_members=free_members,
                                           clock=FakeClock()), 1, 4, 3, num_steps=50), 1, 4, 0, num_steps=20)
    assert policy.stats(1).levels > 0.5  # most steps measured ran the SSM
    assert isinstance(policy.choose(1), TreeBudget) == bool(free_members)
    assert (policy.free_stats(1) is None) == (not free_members)
    # Requests naming their pool: one that names a model-free member has the arm, one of SSMs alone not.
    assert policy.free_stats(1, pool=("ssm-0",)) is None
    assert (policy.free_stats(1, pool=("lookup", "ssm-0")) is not None) == bool(free_members)


def test_loads_are_learnt_apart_and_a_new_load_starts_from_the_nearest_smaller_one():
    policy = learnt(LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.0005), 3, 8, 3, batch_size=1)
    learnt(policy, 0, 2, 1, batch_size=32)  # at batch 32 trees are tiny and seldom accepted
    assert batch_bucket(32) != batch_bucket(1)
    assert isinstance(policy.choose(1), TreeBudget) and policy.choose(32) == ()
    assert policy.stats(2).accepted == pytest.approx(policy.stats(1).accepted)  # a new load: batch 1's


def test_speculation_cost_fit_separates_fixed_and_per_level_time():
    policy = LoadAwarePolicy(BANDWIDTH_BOUND)
    for levels in (0, 1, 2, 3, 4) * 50:
        policy.observe_speculation(levels, 0.004 + 0.0015 * levels)
    # Within 2%: the start and level terms lean on their prior as if by a few observations.
    assert policy.fixed_seconds == pytest.approx(0.004, rel=0.02)
    assert policy.level_seconds == pytest.approx(0.0015, rel=0.02)
    # A large fixed cost per speculated step makes speculation pay off less.
    cheap, costly = (learnt(LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.0005), 1, 4, 2) for _ in range(2))
    costly.fixed_seconds = 0.02
    assert isinstance(cheap.choose(1), TreeBudget) and costly.choose(1) == ()
    assert costly.budget(1).node_cost < cheap.budget(1).node_cost  # a longer step: a node is a smaller share


def test_a_few_ssm_steps_do_not_swing_the_drafting_price(monkeypatch):
    """Mostly model-free steps and a handful with SSM levels: the fit leans on its prior for the
    terms those few tell apart. Three slow steps (a retrial catching up, a busy moment) move the
    price of running the SSMs less than half as far as they would alone, and two ordinary ones do
    not make every level free by putting all their time into the start term."""
    from specinfer.engine.scheduling import policy as module

    weight = module.DRAFT_PRIOR_WEIGHT

    def fitted(prior_weight: float, steps) -> tuple[float, float]:
        monkeypatch.setattr(module, "DRAFT_PRIOR_WEIGHT", prior_weight)
        policy = LoadAwarePolicy(BANDWIDTH_BOUND)
        for levels, seconds in steps:
            policy.observe_speculation(levels, seconds)
        return policy.level_seconds, policy.ssm_start_s

    slow = [(0, 0.001)] * 40 + [(2, 0.041), (3, 0.061), (2, 0.041)]
    with_prior, alone = sum(fitted(weight, slow)), sum(fitted(0.0, slow))
    assert alone > 3 * BANDWIDTH_BOUND.seconds(1) and with_prior < 0.5 * alone
    ordinary = [(0, 0.001)] * 30 + [(1, 0.004), (2, 0.004)]
    assert fitted(0.0, ordinary)[0] < 1e-6  # alone: levels cost nothing, only starting the SSMs does
    level, start = fitted(weight, ordinary)
    assert level > 0.5 * 0.1 * BANDWIDTH_BOUND.seconds(1) and start < level


def test_cost_model_is_monotone_and_learns_from_measured_passes():
    spiky = CostModel([(1, 0.010), (2, 0.350), (4, 0.011), (8, 0.012)]).monotone()
    assert [t for _, t in spiky.points] == [0.010, 0.011, 0.011, 0.012]  # the outlier cannot inflate
    model = CostModel([(1, 0.010), (16, 0.011), (64, 0.030)])
    for _ in range(200):
        model.observe(16, 0.022)  # the machine turned out twice as slow at 16 tokens
    assert model.seconds(16) == pytest.approx(0.022, rel=0.05)
    assert model.seconds(64) >= model.seconds(16) >= model.seconds(1)


def test_a_stalled_pass_barely_moves_the_cost_model_but_a_lasting_load_is_followed():
    """One pass that stalled (ten times its cost) moves the one-token point by at most its clipped
    share: the price of a tree's nodes, the pass's growth over that point, stays where it was. A
    load that lasts (every pass twice as slow) is still followed within tens of passes."""
    model = CostModel([(1, 0.0076), (2, 0.0090), (4, 0.0117), (8, 0.0150)])
    policy = LoadAwarePolicy(model)
    node_before = policy.budget(1).node_cost
    model.observe(1, 10 * model.seconds(1))
    assert model.seconds(1) <= 0.0076 * 1.03  # unclipped, one stall would add 45%
    assert policy.budget(1).node_cost == pytest.approx(node_before, rel=0.1)
    calibrated = {n: t for n, t in model.points}
    for _ in range(60):
        for n, t in calibrated.items():
            model.observe(n, 2 * t)
    assert dict(model.points) == pytest.approx({n: 2 * t for n, t in calibrated.items()}, rel=0.05)


def test_only_steady_trees_count_as_speculation_cost():
    """The first tree of a request opens the streams and prefills the SSMs on the whole context,
    and one after plain steps makes them catch up: neither is a step's speculation cost."""
    from services.verifier.speculators import SpeculationDriver
    from specinfer.params import TreeShape

    class Link:
        is_alive, is_catching_up = True, False

        def offer(self, *args):
            return True

    driver = SpeculationDriver(lambda start: [Link()], [5, 6, 7], TreeShape((2, 1)), 100, 1.0)
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


def run_policy(policy: LoadAwarePolicy, clock: FakeClock, seconds: float, level_seconds: float,
               batch_size: int = 1, llm: CostModel = BANDWIDTH_BOUND, rng=None) -> list:
    """Steps at `batch_size` for `seconds` of fake time. A speculative step's tree has 6 nodes of
    3 SSM levels and 2.4 accepted tokens on average; it costs the LLM pass over the batch's
    trees plus `level_seconds` per level (what the SSM costs under the current load). Returns
    (time, speculated) per step."""
    rng = rng or random.Random(0)
    steps, end, was_speculated = [], clock.now + seconds, False
    while clock.now < end:
        budget = policy.choose(batch_size)
        if budget:
            step_s = llm.seconds(batch_size * 7) + 3 * level_seconds
            if was_speculated:  # a steady step (not a catch-up after plain steps)
                policy.observe_speculation(3, 3 * level_seconds)
            policy.observe_step(rng.choice((1, 2, 3, 4, 2)), 6, 3, batch_size)
        else:
            step_s = llm.seconds(batch_size)
        was_speculated = bool(budget)
        clock.now += step_s
        steps.append((clock.now, bool(budget)))
    return steps


def share_speculated(steps) -> float:
    return sum(1 for _, s in steps if s) / len(steps)


@pytest.mark.parametrize("probe_interval_s", [0.5, float("inf")])
def test_speculation_comes_back_within_seconds_after_a_noisy_phase(probe_interval_s):
    """A noisy neighbour makes the SSM 40x slower for a minute: plain decoding wins. Once it leaves,
    speculation pays again, and the policy finds out within seconds: it keeps re-measuring the arm
    it does not choose and forgets costs measured under the old load. Without probes (inf) the
    verdict of the noisy minute would stand for good."""
    clock = FakeClock()
    policy = LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.0005, clock=clock, probe_interval_s=probe_interval_s)
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


def test_a_fresh_policy_learns_quickly_that_speculation_pays():
    """From its prior, a policy speculates from the first steps where its trees are accepted, and
    keeps at it: a window of half a second is more than 90% speculated within a second."""
    clock = FakeClock()
    policy = LoadAwarePolicy(BANDWIDTH_BOUND, clock=clock)
    steps = run_policy(policy, clock, 5.0, level_seconds=0.0008)
    learnt_at = next(t for t, _ in steps
                     if t > 0.5 and share_speculated([s for s in steps if t - 0.5 <= s[0] <= t]) > 0.9)
    assert learnt_at < 1.0


def test_probes_take_a_bounded_share_of_the_time_however_slow_they_are():
    """On a loaded machine a probe's steps can cost ten plain steps: probes then come less often."""
    clock = FakeClock()
    policy = learnt(LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.02, clock=clock), 1, 4, 3)
    policy.observe_step(4, 4, 3)  # some spread: an optimistic estimate could still win
    probe_s = total = 0.0
    while clock.now < 600:
        step_s = 3.0 if policy.choose(1) else 0.3
        clock.now += step_s
        total += step_s
        probe_s += step_s if step_s == 3.0 else 0.0
    assert 0 < probe_s / total < 0.12, probe_s / total


def test_no_probes_where_even_an_optimistic_estimate_cannot_win():
    """Measuring must cost less than it can lose: at a load where speculation was measured to lose
    by a wide margin (a batch of 32 on a CPU, whose pass grows with every token), the policy pays
    for no probe at all, while it still probes where speculation lost narrowly."""
    clock = FakeClock()
    linear = CostModel([(1, 0.010), (32, 0.030), (256, 0.200)])
    policy = LoadAwarePolicy(linear, level_seconds=0.003, clock=clock)
    learnt(policy, 1, 4, 2, batch_size=32)
    steps = run_policy(policy, clock, 60.0, level_seconds=0.003, batch_size=32, llm=linear)
    assert share_speculated(steps) == 0.0
    narrow = learnt(LoadAwarePolicy(BANDWIDTH_BOUND, level_seconds=0.005, clock=FakeClock()), 1, 6, 3)
    assert narrow.choose(1) == () and not narrow.choose(1)
    narrow.clock.now += 1.0
    assert isinstance(narrow.choose(1), TreeBudget)  # a probe: speculation might still win here


class AlternatingPolicy(LoadAwarePolicy):
    """Speculates every other step, with changing shapes and dynamic budgets: stresses the
    catch-up protocol. Starting with () makes the speculator streams open mid-request, with the
    context so far."""

    def __init__(self, first=(2, 1, 1)):
        super().__init__(BANDWIDTH_BOUND)
        cheap, pricey = TreeBudget(16, 6, 0.005, 0.01), TreeBudget(8, 3, 0.05, 0.05)
        self._shapes = itertools.cycle([first, (), (1, 1, 1, 1), cheap, (), (), (3,), pricey, cheap])

    def choose(self, batch_size, is_greedy=True, pool=()):
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
        for _ in range(2):  # the same seed, shape sequence and pool state reproduce the output
            engine = servicer.engine  # every request without widths follows this policy, unguarded
            engine.cfg, engine.guard = dataclasses.replace(engine.cfg, is_load_aware=True), None
            engine.load_policy = AlternatingPolicy(first)
            for _, speculator in stack.speculators:  # what dynamic trees learnt shapes them too: start afresh
                speculator.worker.speculator.calibration = {True: Calibration(), False: Calibration()}
                speculator.worker.speculator.member_gain = {True: MemberGain(), False: MemberGain()}
            runs.append([t for r in stub.Generate(pb.VerifierGenerateRequest(**kwargs), timeout=30) for t in r.token_ids])
        assert runs[0] == runs[1] and len(runs[0]) == 60
        if sampling is None:
            engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm))
            plain = mode_params("incremental", 60, is_ignore_eos=True)
            assert runs[0] == engine.generate(prompt, plain).output_ids
    finally:
        stack.stop()


@pytest.mark.parametrize("is_forgetting", [True, False])
def test_the_guard_returns_to_speculation_within_seconds_after_a_noisy_phase(is_forgetting):
    """The guard measured plain decoding faster for a minute (its bucket time: measured step
    seconds, no wall clock). When speculation is faster again, a retry within `max_explore_s`
    is judged on fresh phases only and wins. Without forgetting (stale phases kept, retries
    backed off to one in 32 phases) it is still plain after 30 seconds."""
    from specinfer.engine.scheduling.guard import PLAIN, POLICY, SpeculationGuard

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
