"""Admission control: how many requests run at once, derived from measured capacity, with a
brief FIFO queue before a request is refused.

Verification batches every running request into one LLM pass (SpecInfer Section 4), so a step
gets slower as more requests share it. Past the point where the pass is compute-bound, admitting
more requests adds no throughput, only latency. The gateway therefore measures it:

- Every running request reports the time between its verified steps per output token of the
  step (a speculative step brings several tokens in one longer step: per token it compares with a
  plain step), with the number of requests running when the step arrived. `LatencyModel` fits
  `step_s = a + b * num_running` to these by least squares over a sliding window of recent
  samples, so a verdict measured under other load does not stick.
- The limit tends to the largest `num_running` whose predicted time per token stays within
  `latency_factor` times the unloaded one (`a + b`), between `min_running` and `max_running`.
  It drops at once when the fit says so, and rises by one per few new samples while requests
  are waiting and the fit allows more or cannot tell (too few samples, all at one load, or no
  slowdown measured). Each raise is a probe whose samples the next fit uses; at a steady limit
  the load stops varying, so probes recur and the verdict is re-measured.
- KV memory is not modelled here: the verifier is the one place that admits against it, since
  only it knows what a request really costs (its reservation credits the prompt blocks its prefix
  cache already holds). A request whose worst case exceeds the verifier's whole cache
  (Verifier.Info) is refused at once.

A request that does not fit waits in a FIFO queue for at most `queue_timeout_s` (and never past
its deadline); the queue holds at most `max_queued`. Then it is refused with RESOURCE_EXHAUSTED.
Plain Python; the clock is injectable for tests.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from specinfer import limits
from specinfer.errors import CapacityError, UserError


@dataclass(frozen=True)
class AdmissionConfig:
    max_running: int = limits.DEFAULT_MAX_CONCURRENT_REQUESTS  # hard cap on running requests
    min_running: int = limits.DEFAULT_MIN_RUNNING  # the measured limit never goes below this
    latency_factor: float = limits.DEFAULT_ADMISSION_LATENCY_FACTOR  # 0 = a fixed limit of max_running
    max_queued: int = limits.DEFAULT_MAX_QUEUED_REQUESTS  # requests waiting for a slot
    queue_timeout_s: float = limits.DEFAULT_ADMISSION_QUEUE_TIMEOUT_S  # longest wait for a slot

    def __post_init__(self):
        if self.max_running <= 0 or self.min_running <= 0:
            raise UserError(f"max_running and min_running must be > 0, got {self.max_running}, {self.min_running}")
        if self.latency_factor != 0 and self.latency_factor < 1:
            raise UserError(f"admission latency factor must be 0 (fixed limit) or >= 1, got {self.latency_factor}")
        if self.max_queued < 0 or self.queue_timeout_s < 0:
            raise UserError("max_queued and queue_timeout_s must be >= 0")

    @property
    def is_adaptive(self) -> bool:
        return self.latency_factor > 0 and self.min_running < self.max_running


class LatencyModel:
    """Least squares of step time against load over the most recent samples only (a sliding
    window: a verdict from another phase is forgotten completely, not just down-weighted)."""

    def __init__(self, window: int = limits.ADMISSION_SAMPLE_WINDOW):
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.sx = self.sy = self.sxx = self.sxy = 0.0  # running sums over the window

    def add(self, num_running: int, step_s: float) -> None:
        if len(self.samples) == self.samples.maxlen:
            x, y = self.samples[0]
            self.sx, self.sy, self.sxx, self.sxy = self.sx - x, self.sy - y, self.sxx - x * x, self.sxy - x * y
        x = float(num_running)
        self.samples.append((x, step_s))
        self.sx, self.sy, self.sxx, self.sxy = self.sx + x, self.sy + step_s, self.sxx + x * x, self.sxy + x * step_s

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of `step_s = a + b * num_running`, or None while the load has not varied enough."""
        n = len(self.samples)
        if n < limits.ADMISSION_MIN_SAMPLES:
            return None
        mean_x, mean_y = self.sx / n, self.sy / n
        var_x = self.sxx / n - mean_x * mean_x
        if var_x < limits.ADMISSION_MIN_LOAD_VARIANCE:
            return None
        b = (self.sxy / n - mean_x * mean_y) / var_x
        return mean_y - b * mean_x, b


@dataclass
class Ticket:
    """One admitted request's claim on a running slot."""

    is_released: bool = False


class Admission:
    def __init__(self, cfg: AdmissionConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.model = LatencyModel()
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._num_running = 0
        self._kv_capacity_tokens = 0  # 0 = unknown
        self._num_samples = 0
        self._probed_at = -limits.ADMISSION_SAMPLES_PER_PROBE
        self._limit = cfg.max_running if not cfg.is_adaptive else max(cfg.min_running, min(
            cfg.max_running, limits.DEFAULT_INITIAL_RUNNING))

    # -- reading -----------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        with self._cond:
            return self._limit

    @property
    def num_running(self) -> int:
        with self._cond:
            return self._num_running

    @property
    def num_queued(self) -> int:
        with self._cond:
            return len(self._queue)

    # -- inputs ------------------------------------------------------------------------------
    def set_kv_capacity(self, num_tokens: int) -> None:
        with self._cond:
            self._kv_capacity_tokens = max(0, int(num_tokens))
            self._cond.notify_all()

    def observe_step(self, step_s: float, num_running: int) -> None:
        """One request's time between two verified steps, with `num_running` requests running."""
        if not self.cfg.is_adaptive or not math.isfinite(step_s) or step_s <= 0 or num_running <= 0:
            return
        with self._cond:
            self.model.add(num_running, step_s)
            self._num_samples += 1
            cap = self._measured_cap()
            if cap is not None and cap < self._limit:  # too slow: down at once
                self._limit = max(self.cfg.min_running, cap)
            elif cap is None or cap > self._limit:  # up one at a time, each step measured
                self._probe()

    def _measured_cap(self) -> int | None:
        """The most running requests whose predicted step time is within the latency factor of
        the unloaded one; None while unknown (too few samples, one load only, or no slowdown)."""
        fitted = self.model.fit()
        if fitted is None:
            return None
        a, b = fitted
        if b <= 0 or a + b <= 0:
            return None
        return math.floor((self.cfg.latency_factor * (a + b) - a) / b + 1e-9)

    # -- admitting ---------------------------------------------------------------------------
    def acquire(self, num_kv_tokens: int, timeout_s: float | None = None) -> Ticket:
        """Waits in FIFO order for a slot; CapacityError when the queue is full or the wait ends,
        or at once when `num_kv_tokens` (the request's worst case) exceeds the verifier's cache."""
        wait_s = self.cfg.queue_timeout_s if timeout_s is None else min(timeout_s, self.cfg.queue_timeout_s)
        deadline = self.clock() + max(0.0, wait_s)
        with self._cond:
            kv = self._kv_capacity_tokens
            if kv and num_kv_tokens > kv:
                raise CapacityError(f"the request needs up to {num_kv_tokens} KV tokens; the verifier holds {kv}")
            if not self._queue and self._fits():
                return self._admit()
            if len(self._queue) >= self.cfg.max_queued:
                raise CapacityError(self._refusal("and its queue is full"))
            me = object()
            self._queue.append(me)
            cap = self._measured_cap() if self.cfg.is_adaptive else 0
            if cap is None or cap > self._limit:
                self._probe()
            try:
                while not (self._queue[0] is me and self._fits()):
                    remaining = deadline - self.clock()
                    if remaining <= 0:
                        raise CapacityError(self._refusal(f"after queueing for {wait_s:.1f} s"))
                    self._cond.wait(min(remaining, 0.25))
                return self._admit()
            finally:
                self._queue.remove(me)
                self._cond.notify_all()

    def release(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket.is_released:
                return
            ticket.is_released = True
            self._num_running -= 1
            self._cond.notify_all()

    def _fits(self) -> bool:
        return self._num_running < self._limit

    def _admit(self) -> Ticket:
        self._num_running += 1
        return Ticket()

    def _probe(self) -> None:
        """Demand at the limit raises it by one per few new samples, while the fit allows more or
        cannot tell (all samples at one load, or no slowdown): the new load level is measured
        before the next raise, so a transient fit cannot open the gates at once."""
        is_demanded = bool(self._queue) or self._num_running >= self._limit
        if not is_demanded or self._limit >= self.cfg.max_running:
            return
        if self._num_samples - self._probed_at >= max(limits.ADMISSION_SAMPLES_PER_PROBE, 2 * self._limit):
            self._limit += 1
            self._probed_at = self._num_samples
            self._cond.notify_all()

    def _refusal(self, how: str) -> str:
        return (f"the gateway is at its limit of {self._limit} running requests "
                f"(at most {self.cfg.max_running}) {how}; retry later")
