"""What a verifier can serve, as measured: time per output token against the requests running.

Verification batches every running request's token tree into one LLM pass (SpecInfer, arXiv
2305.09781, Section 4), so each step slows as more requests share it; past the point where the
pass is compute-bound, another request adds latency and no throughput. A verifier measures it:
every request's time between two verified steps per output token of the step (a speculative
step brings several tokens in one longer step: per token it compares with a plain step), with
the number of requests running as it arrived. `LatencyModel` keeps a sliding window of these
samples, so a verdict measured under other load does not stick, and fits `token_s = a + b * n`
by least squares. The verifier reports its window summed by load (`LoadPoint`s, which carry all
that least squares needs) in `VerifierLoad`, with its batch capacity and free KV; the gateways
admit against it (`services/gateway/admission.py`).

Plain Python: the gateway imports this too.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from specinfer import limits


@dataclass(frozen=True)
class LoadPoint:
    """The samples of one load level: their mean seconds per output token, and how many."""

    num_running: int
    token_s: float
    num_samples: int


@dataclass(frozen=True)
class VerifierLoad:
    """One verifier's report of what it serves now (Verifier.Info); 0 = not reported."""

    max_batch: int = 0  # requests one LLM pass verifies at most
    num_running: int = 0  # requests it runs now, from every gateway
    num_waiting: int = 0  # requests waiting to be admitted (for KV memory)
    kv_capacity_tokens: int = 0
    kv_free_tokens: int = 0  # free now, cached blocks nobody holds included (they are evicted on demand)
    points: tuple[LoadPoint, ...] = ()  # its measured time per token, by load
    is_draining: bool = False  # stopping: it takes no new request

    def fit(self) -> tuple[float, float] | None:
        return fit_points(self.points)


def fit_points(points: tuple[LoadPoint, ...] | list[LoadPoint]) -> tuple[float, float] | None:
    """(a, b) of `token_s = a + b * num_running` by least squares over the samples the points
    sum up; None while there are too few of them or the load has not varied enough. A load with
    fewer than ADMISSION_MIN_POINT_SAMPLES samples is left out: the first steps at a new load
    (prompts read alongside them) would tilt the line."""
    points = [p for p in points if p.num_samples >= limits.ADMISSION_MIN_POINT_SAMPLES]
    n = sum(p.num_samples for p in points)
    if n < limits.ADMISSION_MIN_SAMPLES:
        return None
    sx = sum(p.num_samples * p.num_running for p in points)
    sy = sum(p.num_samples * p.token_s for p in points)
    sxx = sum(p.num_samples * p.num_running * p.num_running for p in points)
    sxy = sum(p.num_samples * p.num_running * p.token_s for p in points)
    mean_x, mean_y = sx / n, sy / n
    var_x = sxx / n - mean_x * mean_x
    if var_x < limits.ADMISSION_MIN_LOAD_VARIANCE:
        return None
    b = (sxy / n - mean_x * mean_y) / var_x
    return mean_y - b * mean_x, b


def latency_cap(fitted: tuple[float, float] | None, latency_factor: float) -> int | None:
    """The most running requests whose predicted time per token stays within `latency_factor`
    times the unloaded one (`a + b`); None while unknown (no fit, or no slowdown measured)."""
    if fitted is None:
        return None
    a, b = fitted
    if b <= 0 or a + b <= 0:
        return None
    return max(1, math.floor((latency_factor * (a + b) - a) / b + 1e-9))


def unloaded_token_s(fitted: tuple[float, float] | None, points: tuple[LoadPoint, ...] | list[LoadPoint]
                     ) -> float | None:
    """Seconds per output token of a request running alone: the fit's at one request, else the
    mean at the lightest load measured; None with no samples."""
    if fitted is not None and fitted[0] + fitted[1] > 0:
        return fitted[0] + fitted[1]
    measured = [p for p in points if p.num_samples]
    return min(measured, key=lambda p: p.num_running).token_s if measured else None


class TokenPace:
    """The present time per output token: the median of the most recent samples, so it follows
    the load as it changes and one slow step (a prompt read alongside) does not move it."""

    def __init__(self, window: int = limits.PACE_WINDOW):
        self.samples: deque[float] = deque(maxlen=window)

    def observe(self, token_s: float) -> None:
        if math.isfinite(token_s) and token_s > 0:
            self.samples.append(token_s)

    @property
    def value(self) -> float | None:
        ordered = sorted(self.samples)
        return ordered[len(ordered) // 2] if ordered else None


class LatencyModel:
    """Least squares of time per token against load over the most recent samples only: a sliding
    window of at most `window` samples, none older than `max_age_s` (a verdict from another phase,
    or from before an idle spell on a shared machine, is forgotten completely, not down-weighted)."""

    def __init__(self, window: int = limits.ADMISSION_SAMPLE_WINDOW, max_age_s: float = limits.ADMISSION_SAMPLE_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.samples: deque[tuple[int, float]] = deque()
        self._times: deque[float] = deque()
        self.window, self.max_age_s, self.clock = window, max_age_s, clock
        self.sx = self.sy = self.sxx = self.sxy = 0.0  # running sums over the window

    def add(self, num_running: int, token_s: float) -> None:
        if num_running <= 0 or not math.isfinite(token_s) or token_s <= 0:
            return
        now = self.clock()
        self._expire(now)
        if len(self.samples) == self.window:
            self._drop_oldest()
        x = int(num_running)
        self.samples.append((x, token_s))
        self._times.append(now)
        self.sx, self.sy, self.sxx, self.sxy = self.sx + x, self.sy + token_s, self.sxx + x * x, self.sxy + x * token_s

    def _drop_oldest(self) -> None:
        x, y = self.samples.popleft()
        self._times.popleft()
        self.sx, self.sy, self.sxx, self.sxy = self.sx - x, self.sy - y, self.sxx - x * x, self.sxy - x * y

    def _expire(self, now: float) -> None:
        while self._times and now - self._times[0] > self.max_age_s:
            self._drop_oldest()

    def points(self) -> tuple[LoadPoint, ...]:
        """The window summed by load, lightest first."""
        self._expire(self.clock())
        sums: dict[int, list[float]] = {}
        for n, y in list(self.samples):
            acc = sums.setdefault(n, [0.0, 0])
            acc[0] += y
            acc[1] += 1
        return tuple(LoadPoint(n, total / count, int(count)) for n, (total, count) in sorted(sums.items()))

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of `token_s = a + b * num_running`, or None while the load has not varied enough."""
        self._expire(self.clock())
        n = len(self.samples)
        if n < limits.ADMISSION_MIN_SAMPLES:
            return None
        mean_x, mean_y = self.sx / n, self.sy / n
        var_x = self.sxx / n - mean_x * mean_x
        if var_x < limits.ADMISSION_MIN_LOAD_VARIANCE:
            return None
        b = (self.sxy / n - mean_x * mean_y) / var_x
        return mean_y - b * mean_x, b
