"""The speculation guard: measured phases keep whichever arm (policy's trees or plain decoding)
is faster per batch-size bucket, and only ever turn speculation off."""

from __future__ import annotations

import random

from specinfer.engine.scheduling.guard import PLAIN, POLICY, SpeculationGuard

TREE = (2, 1, 1)
choose_tree = lambda: TREE  # noqa: E731 - the policy's choice


def simulate(guard: SpeculationGuard, rate_of, num_steps: int, batch_size: int = 4, seed: int = 0,
             pool_of=lambda i: ()):
    """Steps of `batch_size` interleaved requests; each step's seconds follow its arm's true rate
    (tokens per second, with 10% noise); request i names pool `pool_of(i)`. Returns the arms the
    steps actually used."""
    rng = random.Random(seed)
    pending = [guard.plan(batch_size, choose_tree, pool_of(i)) for i in range(batch_size)]
    used = []
    for i in range(num_steps):
        widths, ticket = pending[i % batch_size]
        arm = POLICY if widths else PLAIN
        tokens = 3 if widths else 1
        guard.observe(ticket, tokens, tokens / rate_of(arm, i) * rng.uniform(0.9, 1.1))
        used.append(arm)
        pending[i % batch_size] = guard.plan(batch_size, choose_tree, pool_of(i % batch_size))
    return used


def throughput(used, rate_of) -> float:
    tokens = sum(3 if a == POLICY else 1 for a in used)
    seconds = sum((3 if a == POLICY else 1) / rate_of(a, i) for i, a in enumerate(used))
    return tokens / seconds


def test_guard_turns_speculation_off_where_plain_decoding_is_faster():
    rate = lambda arm, _i: 100.0 if arm == PLAIN else 68.0  # noqa: E731 - speculation at 0.68x
    guard = SpeculationGuard()
    used = simulate(guard, rate, 4000)
    late = used[1000:]
    assert late.count(POLICY) / len(late) < 0.05  # only the ever rarer retries
    assert throughput(late, rate) > 0.97 * 100.0
    assert guard.rates(4)[PLAIN] > guard.rates(4)[POLICY]


def test_guard_keeps_the_policy_where_it_is_faster():
    rate = lambda arm, _i: 140.0 if arm == POLICY else 100.0  # noqa: E731
    guard = SpeculationGuard()
    late = simulate(guard, rate, 4000)[1000:]
    assert late.count(POLICY) / len(late) > 0.9
    assert throughput(late, rate) > 0.97 * 140.0


def test_each_pool_keeps_its_own_verdict():
    """Requests naming a pool whose drafts lose are kept plain while those of a pool whose drafts
    win keep speculating, in the same batches."""
    pools = [("weak",), ("weak",), (), ()]
    rate = lambda arm, i: 100.0 if arm == PLAIN else (68.0 if i % 4 < 2 else 140.0)  # noqa: E731
    guard = SpeculationGuard()
    used = simulate(guard, rate, 8000, pool_of=lambda i: pools[i])[2000:]
    weak = [a for i, a in enumerate(used) if i % 4 < 2]
    strong = [a for i, a in enumerate(used) if i % 4 >= 2]
    assert weak.count(POLICY) / len(weak) < 0.05 and strong.count(POLICY) / len(strong) > 0.9
    assert guard.rates(4, ("weak",))[PLAIN] > guard.rates(4, ("weak",))[POLICY]
    assert guard.rates(4)[POLICY] > guard.rates(4)[PLAIN]


def test_guard_follows_a_change_of_conditions():
    # speculation pays for the first 3000 steps, then (say, the batch's requests fall out of step) it stops paying
    rate = lambda arm, i: (140.0 if arm == POLICY else 100.0) if i < 3000 else (50.0 if arm == POLICY else 100.0)  # noqa: E731
    used = simulate(SpeculationGuard(), rate, 8000)
    assert used[2000:3000].count(POLICY) > 900
    assert used[5000:].count(POLICY) / 3000 < 0.05  # retries back off to one phase in 32


def test_guard_buckets_batch_sizes_and_ignores_steps_planned_in_an_old_phase():
    guard = SpeculationGuard(phase_seconds=0.0, steps_per_request=2)
    assert [guard.bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    widths, stale = guard.plan(1, choose_tree)
    assert widths == TREE  # the first phase trusts the policy
    for _ in range(2):
        guard.observe(guard.plan(1, choose_tree)[1], 3, 0.01)
    widths, ticket = guard.plan(1, choose_tree)
    assert widths == () and ticket.arm == PLAIN  # the untried arm is measured next
    guard.observe(stale, 100, 0.001)  # planned in the policy's phase: not plain's evidence
    assert guard.rates(1) == {POLICY: 300.0}
    assert guard.rates(8) == {}  # other buckets are untouched
    assert guard.plan(1, lambda: ())[0] == ()  # it never adds speculation the policy did not choose


def test_a_new_bucket_starts_with_the_arm_its_smaller_neighbour_prefers():
    rate = lambda arm, _i: 100.0 if arm == PLAIN else 60.0  # noqa: E731
    guard = SpeculationGuard()
    simulate(guard, rate, 500, batch_size=2)
    assert guard.plan(8, choose_tree)[0] == ()  # batch 5-8 starts plain: speculation already lost at batch 2
    used = simulate(guard, rate, 2000, batch_size=8)
    assert used.count(POLICY) / len(used) < 0.05  # no alternating bootstrap there, only backed-off retries
    assert POLICY in guard.rates(8)  # but the policy was retried
    fresh = SpeculationGuard()
    assert fresh.plan(8, choose_tree)[0] == TREE  # with no evidence, the policy's choice stands


def test_one_odd_phase_cannot_flip_the_choice():
    guard = SpeculationGuard(phase_seconds=0.0, steps_per_request=1)  # batch 1: one step per phase
    # bootstrap alternates policy, plain, ...; plain's first phase is an outlier (say, a stalled neighbour
    # made the policy's steps slow and then left)
    for rate in (140.0, 1000.0, 140.0, 100.0, 140.0, 100.0):
        widths, ticket = guard.plan(1, choose_tree)
        tokens = 3 if widths else 1
        guard.observe(ticket, tokens, tokens / rate)
    assert guard.rates(1) == {POLICY: 140.0, PLAIN: 100.0}
    assert guard.plan(1, choose_tree)[0] == TREE

