"""Gateway admission: a limit from measured time per token (the verifiers' reports, else the
gateway's own), the KV budget, and a FIFO queue for what is predicted to start soon enough.

The latency tests drive `Admission` with a simulated verifier whose step time grows with the
number of running requests (`a + b * n`), so the capacity the limit should find is known. The
queue tests use a clock of their own: no test waits on wall-clock time for a verdict.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.gateway.admission import Admission, AdmissionConfig, VerifierView
from specinfer.errors import CapacityError, UnavailableError, UserError
from specinfer.serving.capacity import LatencyModel, LoadPoint, VerifierLoad, fit_points
from util import wait_until


def expected_cap(a: float, b: float, factor: float) -> int:
    return int((factor * (a + b) - a) / b + 1e-9)


def drive(adm: Admission, step_s, num_rounds: int, rng: random.Random, demand: int = 64) -> list[int]:
    """A busy service: `demand` clients keep asking; running requests report steps and end at
    random, a tenth of a second a round (on the admission's clock, when it is a `Clock`).
    Returns the limit after each round."""
    tickets = []
    limits_seen = []
    for _ in range(num_rounds):
        if isinstance(adm.clock, Clock):
            adm.clock.now += 0.1
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
    adm = Admission(AdmissionConfig(max_running=64, min_running=1, latency_factor=factor), Clock())
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
        adm = Admission(AdmissionConfig(max_running=64, min_running=2, latency_factor=3.0), Clock())
        rng = random.Random(seed)
        drive(adm, lambda n: 0.010 + 0.005 * n, 300, rng)
        noisy = drive(adm, lambda n: 0.010 + 0.050 * n, 300, rng)
        assert sorted(noisy[-50:])[25] == expected_cap(0.010, 0.050, 3.0) == 3
        fast = drive(adm, lambda n: 0.002 + 0.001 * n, 800, rng)
        cap = expected_cap(0.002, 0.001, 3.0)
        assert cap - 2 <= sorted(fast[-100:])[50] <= cap + 1, fast[-100:]


def test_no_slowdown_measured_means_the_limit_grows_with_demand():
    adm = Admission(AdmissionConfig(max_running=20, min_running=1, latency_factor=3.0), Clock())
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


def test_points_carry_everything_the_fit_needs():
    """A verifier reports its window summed by load; the gateway's fit of the points is the fit
    of the samples."""
    m, rng = LatencyModel(), random.Random(4)
    for _ in range(200):
        n = rng.randint(1, 6)
        m.add(n, 0.01 + 0.004 * n + rng.uniform(-0.001, 0.001))
    assert fit_points(m.points()) == pytest.approx(m.fit(), rel=1e-9)
    assert [p.num_running for p in m.points()] == sorted({n for n, _ in m.samples})


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def paced(adm: Admission, token_s: float, num_running: int = 1) -> None:
    for _ in range(8):  # the present time per token (its average starts at the first sample)
        adm.pace.observe(token_s)


def test_a_request_predicted_to_start_too_late_is_refused_at_once_with_a_retry_hint():
    """One slot, its request 100 tokens from the end at 20 ms a token: a slot frees in 2 s. A
    request of 40 tokens may wait a quarter of its unloaded run (0.2 s): refused at once, with
    the predicted 2 s as its hint; one of 1,000 tokens (bound 5 s) waits its turn."""
    clock = Clock()
    adm = Admission(AdmissionConfig(max_running=1, latency_factor=0, queue_factor=0.25, queue_timeout_s=30), clock)
    paced(adm, 0.02)
    adm.model.add(1, 0.02)  # the unloaded time per token, as measured
    running = adm.acquire(500, num_new_tokens=100)
    with pytest.raises(CapacityError, match="predicted in 2.0 s") as refused:
        adm.acquire(500, num_new_tokens=40)
    assert refused.value.retry_after_s == pytest.approx(2.0) and refused.value.retry_after_whole_s == 2
    assert adm.num_queued == 0  # it never waited
    running.num_done = 90  # the running request is nearly done: 0.2 s left
    got = []
    waiter = threading.Thread(target=lambda: got.append(adm.acquire(500, num_new_tokens=40)))
    waiter.start()
    assert wait_for(lambda: adm.num_queued == 1)
    adm.release(running)
    waiter.join(5)
    assert got and adm.num_running == 1 and adm.num_queued == 0


def test_the_deadline_bounds_the_wait():
    clock = Clock()
    adm = Admission(AdmissionConfig(max_running=1, latency_factor=0, queue_factor=100, queue_timeout_s=30), clock)
    paced(adm, 0.02)
    adm.acquire(500, num_new_tokens=100)  # a slot frees in 2 s
    with pytest.raises(CapacityError, match="predicted") as refused:
        adm.acquire(500, timeout_s=1.0, num_new_tokens=10)
    assert refused.value.retry_after_s == pytest.approx(2.0)


def test_a_wait_the_prediction_missed_still_ends_at_its_bound():
    """The running request stalls: the queued one leaves when its bound passes (the clock is
    moved past it), refused with a fresh prediction as its hint."""
    clock = Clock()
    adm = Admission(AdmissionConfig(max_running=1, latency_factor=0, queue_factor=100, queue_timeout_s=3), clock)
    paced(adm, 0.01)
    adm.acquire(500, num_new_tokens=100)  # 1 s predicted
    errors = []

    def wait():
        try:
            adm.acquire(500, num_new_tokens=10)
        except CapacityError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert wait_for(lambda: adm.num_queued == 1)
    clock.now = 3.5
    waiter.join(5)
    assert errors and "after queueing for 3.0 s" in str(errors[0]) and errors[0].retry_after_s == pytest.approx(1.0)


def test_unknown_pace_queues_up_to_the_timeout():
    adm = Admission(AdmissionConfig(max_running=1, latency_factor=0, queue_timeout_s=0), Clock())
    adm.acquire(10, num_new_tokens=10)
    with pytest.raises(CapacityError, match="after queueing") as refused:
        adm.acquire(10, num_new_tokens=10)
    assert refused.value.retry_after_s is not None  # a hint even without a prediction


def view(points: list[tuple[int, float, int]], *, max_batch: int = 64, running: int = 0, mine: int = 0,
         kv_free: int = 1 << 20) -> VerifierView:
    return VerifierView(VerifierLoad(max_batch=max_batch, num_running=running, kv_capacity_tokens=1 << 20,
                                     kv_free_tokens=kv_free, points=tuple(LoadPoint(*p) for p in points)), mine)


def curve(a: float, b: float, loads=range(1, 5)) -> list[tuple[int, float, int]]:
    return [(n, a + b * n, 20) for n in loads]


def test_the_limit_is_what_the_verifiers_serve_less_what_other_gateways_run_there():
    """Two verifiers that serve 7 within the latency factor (a = 10 ms, b = 5 ms, factor 3):
    14 running, less the 3 another gateway runs on the first; a batch capacity of 4 caps the
    second. Where this gateway's own samples (flat: a fast verifier) would let it run 20, the
    verifiers' measurements hold it down at once; they never raise it by themselves."""
    adm = Admission(AdmissionConfig(max_running=20, min_running=1, latency_factor=3.0), Clock())
    drive(adm, lambda n: 0.01, 300, random.Random(5))
    assert adm.limit == 20
    measured = curve(0.010, 0.005, range(1, 9))
    adm.set_verifiers([view(measured, running=5, mine=2), view(measured)])
    assert adm.limit == (7 - 3) + 7
    adm.set_verifiers([view(measured, running=5, mine=2), view(measured, max_batch=4)])
    assert adm.limit == (7 - 3) + 4
    fresh = Admission(AdmissionConfig(max_running=64, min_running=1, latency_factor=3.0))
    fresh.set_verifiers([view(measured)])
    assert fresh.limit == 1  # it rises by probing, a measured step at a time


def test_while_a_verifier_cannot_tell_the_limit_probes_upward_one_at_a_time():
    """Refusals are demand, but not within the burst that brought them (a second later); then one
    raise per 32 samples of the requests running."""
    clock = Clock()
    adm = Admission(AdmissionConfig(max_running=64, min_running=1, latency_factor=1.5), clock)
    adm.set_verifiers([view([(1, 0.01, 40)])])  # one load only: no slope
    start = adm.limit
    tickets = [adm.acquire(10, timeout_s=0) for _ in range(start)]
    for _ in range(200):
        adm.observe_step(0.01, adm.num_running)
    assert adm.limit == start  # requests one after another are no demand for more

    def busy(num_steps: int, step_s: float) -> None:
        for _ in range(num_steps):
            try:
                tickets.append(adm.acquire(10, timeout_s=0))  # a client that does not fit: demand
            except CapacityError:
                pass
            adm.observe_step(0.01, adm.num_running)
            clock.now += step_s

    busy(200, 0.0)
    assert adm.limit == start  # one burst: all at the same moment on this clock
    busy(200, 0.01)  # the demand lasts: after a second (100 steps), a raise per 32 samples
    assert start < adm.limit <= start + 1 + 100 // 32
    for t in tickets:
        adm.release(t)


def test_free_kv_reported_by_the_verifiers_holds_a_request_that_does_not_fit():
    adm = Admission(AdmissionConfig(max_running=8, latency_factor=0, queue_timeout_s=0))
    adm.set_verifiers([view([], kv_free=1000)])
    first = adm.acquire(600)
    with pytest.raises(CapacityError):
        adm.acquire(600)  # 600 of the 1,000 free went to the first since the report
    adm.set_verifiers([view([], kv_free=2000)])  # a new report: room again
    adm.acquire(600)
    adm.release(first)


def test_a_request_of_n_samples_needs_one_slot_and_runs_in_n():
    adm = Admission(AdmissionConfig(max_running=2, latency_factor=0, queue_timeout_s=0))
    samples = adm.acquire(10, num_samples=3)  # one free slot admits all three (over the limit)
    assert adm.num_running == 3
    with pytest.raises(CapacityError):
        adm.acquire(10)
    adm.release(samples)
    assert adm.num_running == 0
    single = adm.acquire(10)
    assert adm.acquire(10, num_samples=2) and adm.num_running == 3
    with pytest.raises(CapacityError):
        adm.acquire(10, num_samples=2)
    adm.release(single)


def test_a_draining_gateway_admits_nothing_and_its_queue_leaves():
    adm = Admission(AdmissionConfig(max_running=1, latency_factor=0, queue_timeout_s=30))
    held = adm.acquire(1)
    errors = []

    def wait():
        try:
            adm.acquire(1)
        except UnavailableError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert wait_for(lambda: adm.num_queued == 1)
    adm.close()
    waiter.join(5)
    assert errors and "stopping" in str(errors[0])
    with pytest.raises(UnavailableError):
        adm.acquire(1)
    adm.release(held)


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_the_refusals_of_a_burst_are_told_to_come_back_in_turns():
    """Two slots finishing in 1 s and 2 s (10 ms a token): the refusals after them are told 1 s,
    2 s, then a round later (their mean run, 1.5 s, on top), not all the same moment."""
    adm = Admission(AdmissionConfig(max_running=2, latency_factor=0, queue_factor=0, queue_timeout_s=30), Clock())
    paced(adm, 0.01)
    adm.model.add(1, 0.01)  # the unloaded time per token is known: the bound is 0, nothing queues
    adm.acquire(10, num_new_tokens=100)
    adm.acquire(10, num_new_tokens=200)
    hints = []
    for _ in range(4):
        with pytest.raises(CapacityError) as refused:
            adm.acquire(10, num_new_tokens=10)
        hints.append(refused.value.retry_after_s)
    assert hints == pytest.approx([1.0, 2.0, 2.5, 3.5])


def test_a_few_samples_at_a_new_load_do_not_tilt_the_fit():
    """Three steps at 2 running (prompts still being read) say nothing yet about the slope."""
    assert fit_points([LoadPoint(1, 0.010, 100), LoadPoint(2, 0.050, 3)]) is None
    a, b = fit_points([LoadPoint(1, 0.010, 100), LoadPoint(2, 0.0105, 30)])
    assert a + b == pytest.approx(0.010) and b == pytest.approx(0.0005)


def test_samples_older_than_a_minute_are_forgotten():
    clock = Clock()
    m = LatencyModel(clock=clock)
    for n in range(1, 5):
        for _ in range(10):
            m.add(n, 0.01 * n)
    assert m.fit() is not None
    clock.now = 61.0
    assert m.fit() is None and m.points() == ()


def test_a_short_request_may_wait_for_a_slot_that_is_about_to_free():
    """A quarter of a 10-token request's unloaded run is 2.5 ms; a slot that frees in 50 ms is
    still worth waiting for (ADMISSION_MIN_QUEUE_WAIT_S), one in 1 s is not."""
    clock = Clock()
    adm = Admission(AdmissionConfig(max_running=1, latency_factor=0, queue_timeout_s=30), clock)
    paced(adm, 0.001)
    adm.model.add(1, 0.001)
    running = adm.acquire(10, num_new_tokens=1000)
    with pytest.raises(CapacityError, match="predicted in 1.0 s"):
        adm.acquire(10, num_new_tokens=10)
    running.num_done = 950  # 50 ms left
    got = []
    waiter = threading.Thread(target=lambda: got.append(adm.acquire(10, num_new_tokens=10)))
    waiter.start()
    assert wait_for(lambda: adm.num_queued == 1)
    adm.release(running)
    waiter.join(5)
    assert got and adm.num_running == 1
