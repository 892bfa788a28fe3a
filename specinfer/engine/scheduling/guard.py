"""Never slower than plain decoding: a measured check on the load-aware policy's choices.

SpecInfer's gains shrink as the batch grows (Section 6.2, Figure 10), and past some batch size
speculation costs more than it wins. `LoadAwarePolicy` predicts that point from a cost model of
LLM passes and a fitted speculation cost. Some costs stay outside any such model: per-step
Python and RPC work in every request thread, requests falling out of step so that one batch of B
trees becomes several smaller passes, CPU contention between processes, and even in one process a
pass whose time the calibration misjudges, or drafts that accept so little that their margin is
within the model's error. The guard measures what the model cannot see; the verifier's engine
has one (in process, where runs are short, its phases of plain decoding cost more than they save).

For each batch-size bucket (and each pool that requests name) it runs the two arms, "as the policy
chooses" and "plain decoding", in phases, for all requests of that bucket at once (so that a phase
measures the arm in its own conditions, not one request's plain step inside a batch of trees). A
phase lasts several steps of every request and a fixed amount of wall time, so a retry of the worse
arm costs a fixed share of time however slow its steps are. A phase's rate is output tokens per
second of request time. The better arm keeps the bucket; the other is retried now and then, less
often each time it loses again, though plain decoding retries the policy at least every
`max_explore_s` of the bucket's time (its measured step seconds per request: no wall clock), and a
phase older than `max_age_s` no longer counts: a verdict made under other load (a noisy neighbour
that has left) is forgotten, and the retried arm is judged on fresh phases only, so the guard cannot
stick to an arm that stopped winning. A new bucket first alternates the arms for a few phases each,
unless the nearest smaller bucket already prefers plain decoding: speculation pays less as the batch
grows, so it then starts plain and only retries the policy. The guard only ever replaces a tree by
no tree, so it cannot change any output. Plain Python.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

POLICY, PLAIN = "policy", "plain"
log = logging.getLogger(__name__)


@dataclass
class _Bucket:
    arm: str = POLICY
    best: str = POLICY  # the arm measured faster (the one kept between retries)
    phase: int = 0  # id of the running phase; a step planned in an older one is not counted
    recent: dict = field(default_factory=lambda: {POLICY: [], PLAIN: []})  # arm -> its last (time, rate) phases
    num_tokens: int = 0
    seconds: float = 0.0
    num_steps: int = 0
    is_bootstrapping: bool = True
    is_exploring: bool = False
    num_phases_since_explore: int = 0
    explore_interval: int = 0  # phases between retries of the losing arm
    elapsed: float = 0.0  # the bucket's time: measured step seconds per request
    explored_at: float = 0.0  # `elapsed` when the losing arm was last retried


@dataclass(frozen=True)
class Ticket:
    """Which bucket (of which pool), phase and arm one step's widths were planned under."""
    bucket: int
    phase: int
    arm: str
    pool: tuple[str, ...] = ()


class SpeculationGuard:
    """Thread-safe: request threads plan and report steps concurrently."""

    def __init__(self, phase_seconds: float = 0.2, steps_per_request: int = 4, min_explore_interval: int = 8,
                 max_explore_interval: int = 32, num_recent: int = 5, num_bootstrap: int = 3,
                 max_explore_s: float = 4.0, max_age_s: float = 8.0):
        self.phase_seconds = phase_seconds  # wall time per phase (request time / batch size)
        self.steps_per_request = steps_per_request  # and at least this many steps per request
        self.min_explore_interval = min_explore_interval  # after a retry that won (and at first)
        self.max_explore_interval = max_explore_interval  # doubling up to this after each lost retry
        self.num_recent = num_recent  # an arm's rate: the median of its last phases (one odd phase cannot flip it)
        self.num_bootstrap = num_bootstrap  # phases of each arm, alternating, before either is preferred
        self.max_explore_s = max_explore_s  # the losing arm is retried at least this often (bucket time)
        self.max_age_s = max_age_s  # a phase older than this is forgotten (measured under other load)
        self._buckets: dict[tuple[tuple[str, ...], int], _Bucket] = {}  # (pool, bucket) -> its arms
        self._lock = threading.Lock()

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        """1, 2, 3-4, 5-8, ...: batch sizes whose step costs are alike."""
        return max(1, batch_size - 1).bit_length() if batch_size > 1 else 0

    @staticmethod
    def batch_of(bucket: int) -> int:
        """The largest batch size in a bucket."""
        return 1 << bucket

    def plan(self, batch_size: int, choose: Callable[[], Any], pool: tuple[str, ...] = ()) -> tuple[Any, Ticket]:
        """The tree to use (`choose()`, the policy's: widths or a budget; or () in a plain phase)
        and the step's ticket. Requests that name a pool of their own (() : the whole pool) are
        measured apart: their drafts speculate at their own rates."""
        key = self.bucket_of(batch_size)
        with self._lock:
            bucket = self._buckets.get((pool, key))
            if bucket is None:
                # Speculation pays less as the batch grows: where a smaller batch already measured plain
                # decoding faster, start plain and only retry the policy (no alternating bootstrap).
                prior = self._prior_arm(pool, key)
                bucket = self._buckets[(pool, key)] = _Bucket(arm=prior, best=prior,
                                                              is_bootstrapping=prior == POLICY,
                                                              explore_interval=self.min_explore_interval)
            ticket = Ticket(key, bucket.phase, bucket.arm, pool)
        return (choose() if ticket.arm == POLICY else ()), ticket

    def _prior_arm(self, pool: tuple[str, ...], key: int) -> str:
        smaller = [k for (p, k), b in self._buckets.items() if p == pool and k < key and not b.is_bootstrapping]
        return self._buckets[(pool, max(smaller))].best if smaller else POLICY

    def _is_measured(self, bucket: _Bucket) -> bool:
        return all(len(bucket.recent[arm]) >= self.num_bootstrap for arm in (POLICY, PLAIN))

    def _rates(self, bucket: _Bucket) -> dict[str, float]:
        """Each arm's median rate over its phases of the last `max_age_s`."""
        rates = {}
        for arm, phases in bucket.recent.items():
            fresh = sorted(r for t, r in phases if bucket.elapsed - t <= self.max_age_s)
            if fresh:
                rates[arm] = fresh[len(fresh) // 2]
        return rates

    def observe(self, ticket: Ticket, num_tokens: int, seconds: float) -> None:
        """One request step planned under `ticket`: tokens it produced and its wall time."""
        with self._lock:
            bucket = self._buckets.get((ticket.pool, ticket.bucket))
            if bucket is None or ticket.phase != bucket.phase or seconds <= 0:
                return  # planned before the current phase began: it measured the previous arm
            batch = self.batch_of(ticket.bucket)
            bucket.num_tokens += num_tokens
            bucket.seconds += seconds
            bucket.num_steps += 1
            bucket.elapsed += seconds / batch
            if bucket.seconds >= self.phase_seconds * batch and bucket.num_steps >= self.steps_per_request * batch:
                self._end_phase(ticket.bucket, bucket)

    def rates(self, batch_size: int, pool: tuple[str, ...] = ()) -> dict[str, float]:
        """Measured rates (tokens/s per request) of the arms at this batch size for this pool."""
        with self._lock:
            bucket = self._buckets.get((pool, self.bucket_of(batch_size)))
            return self._rates(bucket) if bucket else {}

    def _end_phase(self, key: int, bucket: _Bucket) -> None:
        recent = bucket.recent[bucket.arm]
        recent.append((bucket.elapsed, bucket.num_tokens / bucket.seconds))
        del recent[: -self.num_recent]
        other = PLAIN if bucket.arm == POLICY else POLICY
        if bucket.is_bootstrapping and not self._is_measured(bucket):  # the arms alternate
            next_arm = other if len(bucket.recent[other]) < self.num_bootstrap else bucket.arm
        else:
            bucket.is_bootstrapping = False
            rates = self._rates(bucket)
            best = max(rates, key=rates.get)  # an arm not yet measured is not a candidate
            if bucket.is_exploring:  # a lost retry waits twice as long for the next one
                is_won = best == bucket.arm
                bucket.explore_interval = (self.min_explore_interval if is_won
                                           else min(2 * bucket.explore_interval, self.max_explore_interval))
                bucket.is_exploring = False
            bucket.num_phases_since_explore += 1
            if (bucket.num_phases_since_explore >= bucket.explore_interval
                    or (best == PLAIN and bucket.elapsed - bucket.explored_at >= self.max_explore_s)):
                next_arm = PLAIN if best == POLICY else POLICY
                bucket.is_exploring, bucket.num_phases_since_explore = True, 0
                bucket.explored_at = bucket.elapsed
            else:
                next_arm = best
            if best != bucket.best:
                low, high = self.batch_of(key - 1) + 1 if key else 1, self.batch_of(key)
                log.info("speculation guard: %s wins at batch sizes %d-%d (tokens/s per request: %s)", best, low, high,
                         ", ".join(f"{arm} {rate:.1f}" for arm, rate in rates.items()))
                bucket.best = best
        bucket.arm = next_arm
        bucket.phase += 1
        bucket.num_tokens, bucket.seconds, bucket.num_steps = 0, 0.0, 0
