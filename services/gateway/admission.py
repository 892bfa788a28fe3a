"""Admission control: how many requests run at once, from what the verifiers measure they serve,
and a request that cannot start soon enough refused at once, with a hint of when to retry.

Verification batches every running request into one LLM pass (SpecInfer Section 4), so a step
gets slower as more requests share it. Past the point where the pass is compute-bound, admitting
more requests adds no throughput, only latency. So admission follows measurements:

- Every verifier reports what it serves (`specinfer.serving.capacity.VerifierLoad`, in
  Verifier.Info, which the gateway asks every `VERIFIER_LOAD_POLL_S`): its batch capacity, the
  requests it runs (from every gateway), its free KV, and its time per output token against the
  requests running. From a verifier's fit `token_s = a + b * n`, it serves the largest `n` whose
  predicted time per token stays within `latency_factor` times the unloaded one (`a + b`), and at
  most its batch capacity; less the requests other gateways run there. The limit is the sum over
  the serving verifiers, between `min_running` and `max_running`. Where a verifier cannot tell
  (too few samples, all at one load, no slowdown measured), the gateway's own measurement of the
  same (every running request's time between verified steps, per output token) decides, and
  while neither can, the limit rises by one per few new samples as long as requests are waiting:
  each raise is a probe whose samples the next fit uses, up to what the fit allows. A fit that
  says less lowers it at once. (A fit says nothing past the loads it was measured at, and on a
  shared machine those measurements age fast: the limit rises only by measured steps.)
- A request that does not fit waits in a FIFO queue, but only if it is predicted to start soon
  enough: the requests running each have so many tokens left, at the present time per token, so
  the moment a slot frees for each place in the queue is known. A request whose predicted wait
  exceeds its bound is refused at once (RESOURCE_EXHAUSTED) with that prediction as the time to
  retry after. The bound is the smallest of `queue_timeout_s`, the request's deadline and
  `queue_factor` times its own unloaded run time, so that an admitted request's latency stays
  within (`latency_factor` + `queue_factor`) times its unloaded one. The queue holds at most
  `max_queued`; a wait the prediction missed still ends at its bound.
- KV memory: a request whose worst case exceeds every verifier's whole cache is refused at once;
  one that does not fit the free KV the verifiers report (less what was admitted since) waits as
  for a slot. The verifier admits against its KV itself, crediting what its prefix cache holds.

Plain Python; the clock is injectable for tests.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from specinfer import limits
from specinfer.errors import CapacityError, UnavailableError, UserError
from specinfer.serving.capacity import LatencyModel, TokenPace, VerifierLoad, latency_cap, unloaded_token_s


@dataclass(frozen=True)
class AdmissionConfig:
    max_running: int = limits.DEFAULT_MAX_CONCURRENT_REQUESTS  # hard cap on running requests
    min_running: int = limits.DEFAULT_MIN_RUNNING  # the measured limit never goes below this
    latency_factor: float = limits.DEFAULT_ADMISSION_LATENCY_FACTOR  # 0 = a fixed limit of max_running
    max_queued: int = limits.DEFAULT_MAX_QUEUED_REQUESTS  # requests waiting for a slot
    queue_timeout_s: float = limits.DEFAULT_ADMISSION_QUEUE_TIMEOUT_S  # longest wait for a slot
    queue_factor: float = limits.DEFAULT_ADMISSION_QUEUE_FACTOR  # longest wait, in unloaded run times

    def __post_init__(self):
        if self.max_running <= 0 or self.min_running <= 0:
            raise UserError(f"max_running and min_running must be > 0, got {self.max_running}, {self.min_running}")
        if self.latency_factor != 0 and self.latency_factor < 1:
            raise UserError(f"admission latency factor must be 0 (fixed limit) or >= 1, got {self.latency_factor}")
        if self.max_queued < 0 or self.queue_timeout_s < 0 or self.queue_factor < 0:
            raise UserError("max_queued, queue_timeout_s and queue_factor must be >= 0")

    @property
    def is_adaptive(self) -> bool:
        return self.latency_factor > 0 and self.min_running < self.max_running


@dataclass(frozen=True)
class VerifierView:
    """A serving verifier's last report, and this gateway's calls on it when the report came."""

    load: VerifierLoad
    num_mine: int = 0

    @property
    def num_others(self) -> int:
        """Requests other gateways run on it."""
        return max(0, self.load.num_running - self.num_mine)


@dataclass(eq=False)
class Ticket:
    """One admitted request's claim on a running slot; its run keeps `num_done` current."""

    num_new_tokens: int = 0
    num_kv_tokens: int = 0
    num_samples: int = 1  # n: the sequences it runs at once, each a request to the verifier's batch
    num_done: int = 0
    is_released: bool = False

    @property
    def num_left(self) -> int:
        return max(0, self.num_new_tokens - self.num_done)


@dataclass
class _Verifiers:
    """What the verifiers' reports say, summed (None: not every serving verifier can tell)."""

    latency_cap: int | None = None  # requests they serve within the latency factor, for this gateway
    batch_cap: int | None = None  # requests their batches hold, for this gateway
    kv_capacity: int = 0  # the largest verifier's whole cache, tokens (0 = unknown)
    kv_free: int | None = None  # the most free KV one reports, tokens
    unloaded_token_s: float | None = None  # the fastest one's, alone
    token_s: float | None = None  # the slowest one's, at its present load
    views: list[VerifierView] = field(default_factory=list)


class Admission:
    def __init__(self, cfg: AdmissionConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.model = LatencyModel(clock=clock)  # this gateway's own measurement (where the verifiers' cannot tell)
        self.pace = TokenPace()  # the present time per token, for predicting waits
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._tickets: set[Ticket] = set()
        self._verifiers = _Verifiers()
        self._kv_capacity_tokens = 0  # 0 = unknown
        self._kv_since_report = 0  # worst-case KV admitted since the verifiers last reported
        self._is_closed = False
        self._num_refused = 0  # refusals since the last admission (their retry hints take turns)
        self._is_demanded = False  # a request was refused since the last raise (a brief wait in the queue is no reason)
        self._demanded_at = self._refused_at = -math.inf  # the first refusal of this run of them, the last one
        self._num_samples = 0
        self._probed_at = -limits.ADMISSION_SAMPLES_PER_PROBE
        self._limit = cfg.max_running if not cfg.is_adaptive else max(cfg.min_running, min(
            cfg.max_running, limits.DEFAULT_INITIAL_RUNNING))

    # -- reading -----------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        with self._cond:
            return self._effective_limit()

    @property
    def num_running(self) -> int:
        with self._cond:
            return self._num_running()

    @property
    def num_queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def token_s(self) -> float | None:
        """Seconds per output token of one request at the present load (None: unknown)."""
        with self._cond:
            return self.pace.value if self.pace.value is not None else self._verifiers.token_s

    def tickets(self) -> list[Ticket]:
        with self._cond:
            return list(self._tickets)

    # -- inputs ------------------------------------------------------------------------------
    def set_kv_capacity(self, num_tokens: int) -> None:
        with self._cond:
            self._kv_capacity_tokens = max(0, int(num_tokens))
            self._cond.notify_all()

    def set_verifiers(self, views: list[VerifierView]) -> None:
        """The serving verifiers' latest reports (every report, and every change of who serves)."""
        factor = self.cfg.latency_factor
        fits = [v.load.fit() for v in views]
        caps = [latency_cap(f, factor) if factor > 0 else None for f in fits]
        batches = [v.load.max_batch for v in views]
        s = _Verifiers(views=list(views))
        if views and all(c is not None for c in caps):
            s.latency_cap = sum(max(0, min(c, b or c) - v.num_others) for c, b, v in zip(caps, batches, views))
        if views and all(batches):
            s.batch_cap = sum(max(0, b - v.num_others) for b, v in zip(batches, views))
        s.kv_capacity = max((v.load.kv_capacity_tokens for v in views), default=0)
        free = [v.load.kv_free_tokens for v in views if v.load.max_batch]  # a report has its batch capacity
        s.kv_free = max(free) if free else None
        alone = [t for t in (unloaded_token_s(f, v.load.points) for f, v in zip(fits, views)) if t]
        s.unloaded_token_s = min(alone, default=None)
        present = [_token_s_at(v.load) for v in views]
        s.token_s = max((t for t in present if t), default=None)
        with self._cond:
            self._verifiers, self._kv_since_report = s, 0
            if self.cfg.is_adaptive and s.latency_cap is not None and s.latency_cap < self._limit:  # down at once
                self._limit = max(self.cfg.min_running, s.latency_cap)
            self._cond.notify_all()

    def observe_step(self, step_s: float, num_running: int) -> None:
        """One request's time between two verified steps per output token, with `num_running`
        requests running through this gateway."""
        if not math.isfinite(step_s) or step_s <= 0 or num_running <= 0:
            return
        with self._cond:
            self.pace.observe(step_s)
            if not self.cfg.is_adaptive:
                return
            self.model.add(num_running, step_s)
            self._num_samples += 1
            cap = self._measured_cap()
            if cap is not None and cap < self._limit:  # too slow: down at once
                self._limit = max(self.cfg.min_running, cap)
            elif cap is None or cap > self._limit:  # up one at a time, each step measured
                self._probe()

    def _measured_cap(self) -> int | None:
        """The most running requests whose predicted time per token is within the latency factor
        of the unloaded one: the verifiers' say, else this gateway's own; None while unknown."""
        if self._verifiers.latency_cap is not None:
            return self._verifiers.latency_cap
        return latency_cap(self.model.fit(), self.cfg.latency_factor)

    def close(self) -> None:
        """Draining: no request is admitted from now on, and those queued leave (UNAVAILABLE)."""
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()

    # -- admitting ---------------------------------------------------------------------------
    def acquire(self, num_kv_tokens: int, timeout_s: float | None = None, num_new_tokens: int = 0,
                num_samples: int = 1) -> Ticket:
        """A slot for a request of `num_new_tokens` at most, with `num_kv_tokens` of worst-case KV;
        waits in FIFO order while it is predicted to start within its bound (see the module doc).
        CapacityError, with a retry hint, when the queue is full or the wait is, or would be, too
        long; at once when the request exceeds the verifiers' whole cache. A request of n > 1
        samples (`num_samples`) needs one free slot and then runs in n (it may go over the limit:
        its samples share one reading of the prompt and are not refused one by one)."""
        ticket = Ticket(num_new_tokens, num_kv_tokens, num_samples)
        with self._cond:
            self._check_open()
            kv = max(self._kv_capacity_tokens, self._verifiers.kv_capacity)
            if kv and num_kv_tokens > kv:
                raise CapacityError(f"the request needs up to {num_kv_tokens} KV tokens; the verifier holds {kv}")
            if not self._queue and self._fits(ticket):
                return self._admit(ticket)
            bound = self._bound(ticket, timeout_s)
            wait = self._predicted_wait(len(self._queue))
            if len(self._queue) >= self.cfg.max_queued:
                raise CapacityError(self._refusal("and its queue is full", wait),
                                    retry_after_s=self._hint(len(self._queue), bound))
            if wait is not None and wait > bound:
                raise CapacityError(self._refusal(f"and a slot is predicted in {wait:.1f} s, past this request's "
                                                  f"{bound:.1f} s bound", wait),
                                    retry_after_s=self._hint(len(self._queue), bound))
            return self._wait_in_queue(ticket, bound)

    def _hint(self, position: int, bound: float) -> float:
        """When a refused request should come back: the predicted wait of its place in line (its
        place in the queue, behind the requests refused since the last admission, so that a burst's
        refusals come back in turns, not all at once); its bound when the pace is unknown."""
        later = self._predicted_wait(position + self._num_refused)
        self._num_refused += 1
        now = self.clock()  # a request was turned away: the limit may probe upward, not within this burst
        if now - self._refused_at > limits.ADMISSION_PROBE_DELAY_S:  # the first refusal after a quiet spell
            self._demanded_at = now
        self._is_demanded, self._refused_at = True, now
        return later if later is not None else max(bound, 1.0)

    def _wait_in_queue(self, ticket: Ticket, bound: float) -> Ticket:
        me = object()
        self._queue.append(me)
        deadline = self.clock() + max(0.0, bound)
        try:
            while not (self._queue[0] is me and self._fits(ticket)):
                self._check_open()
                remaining = deadline - self.clock()
                if remaining <= 0:
                    position = self._queue.index(me)
                    raise CapacityError(self._refusal(f"after queueing for {bound:.1f} s",
                                                      self._predicted_wait(position)),
                                        retry_after_s=self._hint(position, bound))
                self._cond.wait(min(remaining, 0.25))
            return self._admit(ticket)
        finally:
            self._queue.remove(me)
            self._cond.notify_all()

    def release(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket.is_released:
                return
            ticket.is_released = True
            self._tickets.discard(ticket)
            self._cond.notify_all()

    def _num_running(self) -> int:
        """Requests running, a request of n samples counting n."""
        return sum(t.num_samples for t in self._tickets)

    def _check_open(self) -> None:
        if self._is_closed:
            raise UnavailableError("the gateway is stopping; send the request to another gateway")

    def _effective_limit(self) -> int:
        batch_cap = self._verifiers.batch_cap
        limit = self._limit if batch_cap is None else min(self._limit, max(self.cfg.min_running, batch_cap))
        return min(limit, self.cfg.max_running)

    def _fits(self, ticket: Ticket) -> bool:
        if self._num_running() >= self._effective_limit():
            return False
        kv_free = self._verifiers.kv_free
        return kv_free is None or not self._tickets or ticket.num_kv_tokens <= kv_free - self._kv_since_report

    def _admit(self, ticket: Ticket) -> Ticket:
        self._num_refused = 0
        self._tickets.add(ticket)
        self._kv_since_report += ticket.num_kv_tokens
        return ticket

    def _bound(self, ticket: Ticket, timeout_s: float | None) -> float:
        """The longest this request may wait: the queue timeout, its deadline, and `queue_factor`
        times its own unloaded run time (when that is known; at least ADMISSION_MIN_QUEUE_WAIT_S,
        so that a short request does not miss the slot of one that is ending)."""
        bound = self.cfg.queue_timeout_s if timeout_s is None else min(timeout_s, self.cfg.queue_timeout_s)
        alone = self._unloaded_token_s()
        if alone is not None and ticket.num_new_tokens:  # never less than a request's release takes
            bound = min(bound, max(limits.ADMISSION_MIN_QUEUE_WAIT_S,
                                   self.cfg.queue_factor * ticket.num_new_tokens * alone))
        return max(0.0, bound)

    def _unloaded_token_s(self) -> float | None:
        if self._verifiers.unloaded_token_s is not None:
            return self._verifiers.unloaded_token_s
        return unloaded_token_s(self.model.fit(), self.model.points()) if self.model.samples else None

    def _predicted_wait(self, position: int) -> float | None:
        """Seconds until a slot frees for the request at `position` of the queue: the running
        requests' tokens left at the present time per token (later rounds: their mean run time);
        None while the time per token is unknown."""
        token_s = self.pace.value if self.pace.value is not None else self._verifiers.token_s
        if token_s is None:
            return None
        index = position - max(0, self._effective_limit() - self._num_running())
        if index < 0 or not self._tickets:
            return 0.0
        finishes = sorted(t.num_left * token_s for t in self._tickets)
        rounds, i = divmod(index, len(finishes))
        mean_run = token_s * sum(t.num_new_tokens for t in self._tickets) / len(self._tickets)
        return finishes[i] + rounds * mean_run

    def _probe(self) -> None:
        """Demand past the limit raises it by one per few new samples of the requests running, while
        the fit allows more or cannot tell (all samples at one load, or no slowdown): the new load
        level is measured before the next raise, so a transient fit cannot open the gates at once.
        Refusals count as demand only ADMISSION_PROBE_DELAY_S after the first of a run of them: a
        burst gets in only what has been measured to serve it well (its later requests do not take
        a raise its earlier ones caused), while demand that lasts raises the limit at the pace of
        the samples."""
        if not self.cfg.is_adaptive:
            return
        is_refusing = (self._is_demanded and self._num_running() >= self._limit
                       and self.clock() - self._demanded_at >= limits.ADMISSION_PROBE_DELAY_S)
        is_demanded = bool(self._queue) or is_refusing
        cap = self._measured_cap()
        if not is_demanded or self._limit >= self.cfg.max_running or (cap is not None and cap <= self._limit):
            return
        if self._num_samples - self._probed_at >= max(limits.ADMISSION_SAMPLES_PER_PROBE, 2 * self._limit):
            self._limit += 1
            self._probed_at = self._num_samples
            self._is_demanded = False  # the next raise waits for demand the new limit does not meet
            self._cond.notify_all()

    def _refusal(self, how: str, wait_s: float | None) -> str:
        hint = f"; retry in {wait_s:.1f} s" if wait_s else "; retry later"
        return (f"the gateway is at its limit of {self._effective_limit()} running requests "
                f"(at most {self.cfg.max_running}) {how}{hint}")


def _token_s_at(load: VerifierLoad) -> float | None:
    """A verifier's time per token at its present load: measured there, else the nearest load measured."""
    if not load.points:
        return None
    return min(load.points, key=lambda p: abs(p.num_running - max(1, load.num_running))).token_s
