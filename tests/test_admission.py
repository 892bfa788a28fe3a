"""Gateway admission: a limit measured from step times, the KV budget, and a brief FIFO queue.

The latency tests drive `Admission` with a simulated verifier whose step time grows with the
number of running requests (`a + b * n`), so the capacity the limit should find is known.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.gateway.admission import Admission, AdmissionConfig, LatencyModel
from specinfer.errors import CapacityError, UserError
from util import wait_until


def expected_cap(a: float, b: float, factor: float) -> int:
    return int((factor * (a + b) - a) / b + 1e-9)


def drive(adm: Admission, step_s, num_rounds: int, rng: random.Random, demand: int = 64) -> list[int]:
    """A busy service: `demand` clients keep asking; running requests report steps and end at
    random. Returns the limit after each round."""
    tickets = []
    limits_seen = []
    for _ in range(num_rounds):
        while len(tickets) < demand:
            try:
                tickets.append(adm.acquire(10, timeout_s=0))
            except CapacityError:
                break
        n = adm.num_running
        for _ in range(n):
            adm.observe_step(step_s(n) * rng.uniform(0.9, 1.1), n)
        for t in [t for t in tickets if rng.random() < 0.2]:
            adm.release(t)
            tickets.remove(t)
        limits_seen.append(adm.limit)
    for t in tickets:
        adm.release(t)
    return limits_seen


def test_latency_model_recovers_a_line_and_needs_varied_load():
    m = LatencyModel()
    for _ in range(100):
        m.add(4, 0.03)  # on the line below
    assert m.fit() is None  # one load only: the slope is unknown
    for n in range(1, 9):
        for _ in range(10):
            m.add(n, 0.01 + 0.005 * n)
    a, b = m.fit()
    assert a == pytest.approx(0.01, abs=1e-3) and b == pytest.approx(0.005, abs=2e-4)


def test_limit_converges_to_the_measured_capacity():
    a, b, factor = 0.010, 0.005, 3.0  # unloaded step 15 ms; 3x = 45 ms at 7 running
    adm = Admission(AdmissionConfig(max_running=64, min_running=1, latency_factor=factor))
    seen = drive(adm, lambda n: a + b * n, 400, random.Random(0))
    cap = expected_cap(a, b, factor)
    assert cap == 7
    tail = seen[-100:]
    assert abs(sorted(tail)[50] - cap) <= 1 and max(tail) <= cap + 3, tail  # probes go a little above


def test_limit_forgets_a_noisy_phase_and_comes_back():
    """A phase where each request slowed the step 10x as much pulls the limit down to that
    phase's capacity; once the verifier is fast again, old samples fade and the limit climbs back
    instead of sticking."""
    for seed in range(3):
        adm = Admission(AdmissionConfig(max_running=64, min_running=2, latency_factor=3.0))
        rng = random.Random(seed)
        drive(adm, lambda n: 0.010 + 0.005 * n, 300, rng)
        noisy = drive(adm, lambda n: 0.010 + 0.050 * n, 300, rng)
        assert sorted(noisy[-50:])[25] == expected_cap(0.010, 0.050, 3.0) == 3
        fast = drive(adm, lambda n: 0.002 + 0.001 * n, 800, rng)
        cap = expected_cap(0.002, 0.001, 3.0)
        assert cap - 2 <= sorted(fast[-100:])[50] <= cap + 1, fast[-100:]


def test_no_slowdown_measured_means_the_limit_grows_with_demand():
    adm = Admission(AdmissionConfig(max_running=20, min_running=1, latency_factor=3.0))
    seen = drive(adm, lambda n: 0.01, 300, random.Random(2))
    assert seen[-1] == 20  # a flat curve (a GPU far from compute-bound): up to the hard cap


def test_fixed_limit_when_the_factor_is_zero():
    adm = Admission(AdmissionConfig(max_running=5, latency_factor=0))
    seen = drive(adm, lambda n: 0.01 + 0.1 * n, 100, random.Random(3))
    assert set(seen) == {5}


def test_kv_memory_is_the_verifiers_to_admit_against_and_only_an_oversize_request_is_refused_here():
    """Requests whose worst cases add up past the verifier's cache still run together here: the
    verifier admits them against its KV (crediting what its prefix cache holds)."""
    adm = Admission(AdmissionConfig(max_running=10, latency_factor=0, queue_timeout_s=0))
    adm.set_kv_capacity(100)
    first, second = adm.acquire(60), adm.acquire(60)
    with pytest.raises(CapacityError, match="needs up to 200 KV tokens"):
        adm.acquire(200)
    adm.release(first)
    adm.release(first)  # releasing twice is harmless
    adm.release(second)
    assert adm.num_running == 0


def test_queue_is_fifo_and_bounded():
    adm = Admission(AdmissionConfig(max_running=1, latency_factor=0, max_queued=2, queue_timeout_s=5))
    held = adm.acquire(1)
    order = []

    def wait(name: str) -> None:
        ticket = adm.acquire(1)
        order.append(name)
        time.sleep(0.01)
        adm.release(ticket)

    threads = []
    for name in ("first", "second"):
        t = threading.Thread(target=wait, args=(name,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 2
        while adm.num_queued < len(threads) and time.monotonic() < deadline:
            time.sleep(0.005)
    assert adm.num_queued == 2
    with pytest.raises(CapacityError, match="queue is full"):
        adm.acquire(1)
    adm.release(held)
    for t in threads:
        t.join(5)
    assert order == ["first", "second"] and adm.num_running == 0 and adm.num_queued == 0


class CountingClock:
    """A clock the test sets, counting its readings: a waiter that read it twice since the clock was
    set went around its wait once and decided with that time."""

    def __init__(self):
        self.now, self.num_reads = 0.0, 0
        self._cond = threading.Condition()

    def __call__(self) -> float:
        with self._cond:
            self.num_reads += 1
            self._cond.notify_all()
            return self.now

    def wait_reads(self, num: int) -> bool:
        with self._cond:
            target = self.num_reads + num
            return self._cond.wait_for(lambda: self.num_reads >= target, 10)


def test_a_queued_request_waits_until_its_queue_timeout_then_is_refused():
    clock = CountingClock()
    adm = Admission(AdmissionConfig(max_running=1, latency_factor=0, max_queued=1, queue_timeout_s=5), clock=clock)
    held = adm.acquire(1)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(adm.acquire, 1)
        try:
            assert wait_until(lambda: adm.num_queued == 1, 10)
            clock.now = 4.9  # just inside its wait
            adm.set_kv_capacity(0)  # wakes the waiter, which reads the clock again
            assert clock.wait_reads(2) and not queued.done()
            clock.now = 5.0
            with pytest.raises(CapacityError, match="after queueing for 5.0 s"):
                queued.result(timeout=10)
            assert adm.num_queued == 0 and adm.num_running == 1
        finally:
            adm.release(held)  # lets in a waiter that was not refused (the pool waits for it)


def test_config_is_checked():
    with pytest.raises(UserError):
        AdmissionConfig(latency_factor=0.5)
    with pytest.raises(UserError):
        AdmissionConfig(max_running=0)
