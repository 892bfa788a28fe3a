"""Load-aware speculation: each step's tree priced by measured costs, or no tree where it does not pay.

SpecInfer's gains shrink as the batch grows (Section 6.2, Figure 10): verifying B trees of N
nodes costs an LLM pass over B*N tokens. Trees are dynamic (`engine.dynamic`): the drafts keep a
node, or run another SSM level, only while that raises the expected rate, given what one node
and one level cost as shares of the step's time (`TreeBudget`). This policy prices them for the
current batch and device, SmartSpec-style, from measured goodput:

    step time T = t_llm(B * (1 + nodes)) + t_step + t_draft,
    t_draft = fixed + t_start * [levels > 0] + t_level * levels,
    node_cost = max((t_llm(B * (1 + n)) - t_llm(B)) / n,  t_llm(B * (2 + n)) - t_llm(B * (1 + n))) / T0,  n = max(1, nodes),
    level_cost = t_level / T0,   ssm_cost = t_start / T0

where t_llm comes from a cost model calibrated at start-up (LLM forward time against tokens in
the pass, refined by every measured pass), t_step is what a step costs beyond its pass
(sampling, bookkeeping, the request's own Python: measured on plain steps of one request, paid
once per step however many tokens it brings), t_draft is the measured drafting time, T0 =
t_llm(B) + t_step + fixed is a step without a tree (the drafts' rate has the form
(1 + accepted) / (1 + node_cost * nodes + level_cost * levels): the shares are of T0, not of
T), and nodes are the tree sizes measured at this load. Node costs charge
the whole batch (one more token in the pass slows every request in it), so trees shrink as the
batch grows, down to none. Plain decoding is the other arm: the policy speculates while

    (1 + accepted) / T  >  1 / (t_llm(B) + t_step)

with accepted, nodes and levels the decayed averages of the last speculative steps at this load
(greedy and sampled apart: they accept at very different rates). The drafts decide per step
whether the SSMs run at all (`dynamic.MemberGain`), so speculation is also priced as the steps
without SSM levels went (the model-free members' drafts alone, `free_stats`, from the same prior
as the others where the pool has model-free members): a pool member whose passes do not pay drops
out of the trees, and must not take the free members' speculation with it by making every
speculative step look as slow as one that runs it (the prior's SSM levels, priced at a costly
SSM's measured level, would otherwise decode a fresh pool plainly until probes told otherwise).

A choice cannot stick. Costs are refitted with weights that halve every `half_life_s` of
(injectable) clock time (the drafting cost's start and level terms leaning on a prior worth a
few observations, so that a handful of steps cannot swing them), and while plain decoding wins,
speculation is probed with two steps every `probe_interval_s` (less often when probes are slow:
at most `PROBE_SHARE` of the time),
unless even an optimistic estimate of it (its acceptance plus its uncertainty, and a drafting
cost that fades with the age of its measurement) could not win: probes are paid only where they
could change the verdict. Plain Python; the one
tensor-touching part, calibration, only times a runner.
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
import time
from dataclasses import dataclass

from specinfer.limits import CALIBRATION_CONTEXT, CALIBRATION_SIZES, DYNAMIC_MAX_DEPTH, DYNAMIC_MAX_NODES
from specinfer.params import TreeBudget
from specinfer.engine.runtime.runner import Work

PRIOR_GREEDY = (1.5, 6.0, 3.0)  # (accepted tokens, nodes, SSM levels) of a speculative step before any evidence
PRIOR_SAMPLED = (0.8, 4.0, 2.0)
PRIOR_WEIGHT = 4.0  # steps behind the prior
STATS_DECAY = 0.98  # a speculative step's weight falls by this per later step
PROBE_INTERVAL_S = 0.5  # speculation not chosen is still measured with a probe this often
PROBE_SHARE = 0.1  # and probes take at most this share of the time
NUM_PROBE_STEPS = 2  # the first step after plain ones also pays the SSMs' catch-up
COST_HALF_LIFE_S = 2.0  # drafting-cost observations this old weigh half
# The drafting-cost fit's start and level terms lean on a prior (no start cost; the initial level
# cost) worth this many observations: a handful of slow steps cannot price a level at half a step,
# which made the policy flip between speculating and declining from run to run.
DRAFT_PRIOR_WEIGHT = 4.0
OUTLIER_FACTOR = 4.0  # a drafting time counts at most this many times what the fit predicts
# A measured LLM pass moves the cost model as if it took at most this many times what the model
# predicts (or at least its inverse): one stalled pass (a preempted thread, a page fault) must not
# raise the price of every pass by a quarter, and so halve the price of a tree's nodes beside it.
PASS_OUTLIER_FACTOR = 1.5
WARM_SIZE_MAX = 16  # calibration times passes of up to this many tokens right after one of their size


BUSY_SPREAD = 1.5  # repeats whose median is this many times their fastest: the machine was busy


def is_busy(samples: dict | list[list[float]]) -> bool:
    """Whether the repeats of any one timed measurement (at least three) spread past BUSY_SPREAD:
    their median over their fastest. A busy neighbour slows some repeats and never speeds one up."""
    cells = samples.values() if isinstance(samples, dict) else samples
    return any(len(s) >= 3 and min(s) > 0 and statistics.median(s) / min(s) > BUSY_SPREAD for s in cells)


def _time_pass(runner, work) -> float:
    start = time.perf_counter()
    runner.run([work])
    return time.perf_counter() - start


@dataclass
class CostModel:
    """LLM forward seconds as a piecewise-linear function of the tokens in the pass."""

    points: list[tuple[int, float]]  # (tokens, seconds), tokens ascending
    is_busy: bool = False  # calibrated while the machine stayed busy

    def seconds(self, num_tokens: float) -> float:
        xs = [p[0] for p in self.points]
        i = bisect.bisect_left(xs, num_tokens)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):  # extrapolate with the last segment's slope
            (x0, y0), (x1, y1) = self.points[-2], self.points[-1]
        else:
            (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / max(1e-9, x1 - x0)

    @classmethod
    def calibrate(cls, runner, sizes=CALIBRATION_SIZES, context: int = CALIBRATION_CONTEXT,
                  repeats: int = 5, timer=None, max_attempts: int = 1, max_seconds: float = math.inf
                  ) -> "CostModel":
        """Times one forward pass per size over a `context`-token prefix. The fastest of several
        repeats: start-up shares the CPU with other processes, and a slow outlier would inflate
        every larger size (costs are made monotone below). A small pass (up to `WARM_SIZE_MAX`
        tokens) is timed right after an untimed one of its size, as decoding runs it: after the
        largest pass of the round it would find the caches cold (a one-token pass timed so cost
        1.2x what it costs in decoding, hiding most of what a second token adds). While the
        repeats of a size spread as on a busy machine (`is_busy`), all sizes are timed again, up
        to `max_attempts` times; `is_busy` on the result says whether the machine stayed busy.
        Past `max_seconds` (a loaded machine) no further round starts once one was timed.
        `timer(runner, work)` returns a timed pass's seconds (default: the wall time of
        `runner.run`)."""
        timer = timer or _time_pass
        context, sizes = cls.fit_shape(runner, sizes, context)
        seq = runner.new_sequence()
        try:
            seq.ensure_capacity(context + max(sizes))
            runner.prefill(seq, [0] * context)
            works = {n: Work(seq, [0] * n, list(range(context, context + n)), list(range(-1, n - 1)), "all")
                     for n in sizes}
            best = {n: float("inf") for n in sizes}
            deadline = time.perf_counter() + max_seconds
            for _ in range(max(1, max_attempts)):
                samples = {n: [] for n in sizes}
                for repeat in range(repeats + 1):  # sizes interleaved, so a busy moment hits them alike
                    for n in sizes:
                        if n <= WARM_SIZE_MAX:  # as in decoding: after a pass like it, not a long one
                            runner.run([works[n]])
                        seconds = timer(runner, works[n])
                        if repeat:  # the first round is a warm-up
                            samples[n].append(seconds)
                            best[n] = min(best[n], seconds)
                    if repeat and time.perf_counter() > deadline:
                        break
                busy = is_busy(samples)
                if not busy or time.perf_counter() > deadline:
                    break
            model = cls([(n, best[n]) for n in sizes]).monotone()
            model.is_busy = busy
            return model
        finally:
            seq.free()

    @staticmethod
    def fit_shape(runner, sizes, context: int) -> tuple[int, list[int]]:
        """(context, sizes) that fit the free KV slots and the model's own context (a small model
        may hold fewer positions than the default prefix plus the largest size)."""
        room = min(runner.allocator.num_free * runner.allocator.block_size, runner.max_context)
        context = max(1, min(context, room // 2))
        return context, [n for n in sizes if context + n <= room] or [1]

    def monotone(self) -> "CostModel":
        """Costs never fall with more tokens: each size costs at most what any larger one does
        (so a slow outlier cannot inflate every larger size)."""
        points = list(self.points)
        for i in range(len(points) - 2, -1, -1):
            points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
        return CostModel(points)

    def observe(self, num_tokens: int, seconds: float, weight: float = 0.05) -> None:
        """Moves the nearest calibration point toward a measured pass (the machine's load and
        the real contexts drift from what start-up saw), by at most `PASS_OUTLIER_FACTOR` of its
        prediction: a load that stays is still followed, within tens of passes."""
        i = min(range(len(self.points)), key=lambda j: abs(math.log(self.points[j][0]) - math.log(max(1, num_tokens))))
        size, old = self.points[i]
        ratio = seconds / max(self.seconds(num_tokens), 1e-9)
        ratio = min(max(ratio, 1 / PASS_OUTLIER_FACTOR), PASS_OUTLIER_FACTOR)
        self.points[i] = (size, old * (1 - weight + weight * ratio))
        self.points = self.monotone().points


@dataclass
class StepStats:
    """Decayed averages of speculative steps at one load: tokens accepted, nodes beyond the
    root, SSM levels; and how many steps they stand for."""

    accepted: float
    nodes: float
    levels: float
    weight: float = PRIOR_WEIGHT
    squares: float = 0.0  # decayed mean of accepted**2 (the uncertainty of `accepted`)

    def __post_init__(self):
        if not self.squares:
            self.squares = self.accepted ** 2 + 1.0

    def observe(self, accepted: int, nodes: int, levels: int, decay: float = STATS_DECAY) -> None:
        w = 1.0 / (self.weight * decay + 1.0)
        self.accepted += w * (accepted - self.accepted)
        self.nodes += w * (nodes - self.nodes)
        self.levels += w * (levels - self.levels)
        self.squares += w * (accepted * accepted - self.squares)
        self.weight = self.weight * decay + 1.0

    def optimistic(self) -> float:
        """Accepted tokens plus two standard errors."""
        variance = max(0.0, self.squares - self.accepted ** 2)
        return self.accepted + 2.0 * math.sqrt(variance / max(1.0, self.weight)) + 0.25


class DecayedLeastSquares:
    """y = b . x fitted by exponentially weighted least squares (a small ridge keeps it defined
    where the features seen so far do not tell their terms apart)."""

    def __init__(self, num_features: int, ridge: float = 1e-6):
        self.n, self.ridge = num_features, ridge
        self.xx = [[0.0] * num_features for _ in range(num_features)]
        self.xy = [0.0] * num_features
        self.weight = 0.0
        self._weight_by_last: dict[float, float] = {}  # decayed weight of the observations by their last feature

    def has_seen(self, last_feature: float) -> bool:
        """Whether observations whose last feature was at least this carry weight still."""
        return sum(w for f, w in self._weight_by_last.items() if f >= last_feature) > 0.5

    def observe(self, x: tuple[float, ...], y: float, decay: float = 0.98) -> None:
        d = decay
        self._weight_by_last = {f: w * d for f, w in self._weight_by_last.items() if w * d > 1e-3}
        self._weight_by_last[x[-1]] = self._weight_by_last.get(x[-1], 0.0) + 1.0
        for i in range(self.n):
            self.xy[i] = d * self.xy[i] + x[i] * y
            for j in range(self.n):
                self.xx[i][j] = d * self.xx[i][j] + x[i] * x[j]
        self.weight = d * self.weight + 1.0

    def coefficients(self, prior: tuple[float | None, ...] | None = None, prior_weight: float = 0.0
                     ) -> list[float] | None:
        """The fit (None before any observation), each term with a value in `prior` pulled towards
        it as if by `prior_weight` observations of that term alone (None: left free), so a term
        that few observations tell apart stays near its prior instead of swinging with them."""
        if self.weight <= 0:
            return None
        a = [row[:] + [self.xy[i]] for i, row in enumerate(self.xx)]
        for i in range(self.n):
            a[i][i] += self.ridge * (1.0 + a[i][i])
            if prior is not None and prior[i] is not None:
                a[i][i] += prior_weight
                a[i][self.n] += prior_weight * prior[i]
        for col in range(self.n):  # Gaussian elimination with partial pivoting
            pivot = max(range(col, self.n), key=lambda r: abs(a[r][col]))
            if abs(a[pivot][col]) < 1e-12:
                return None
            a[col], a[pivot] = a[pivot], a[col]
            for r in range(self.n):
                if r != col:
                    f = a[r][col] / a[col][col]
                    a[r] = [v - f * w for v, w in zip(a[r], a[col])]
        return [a[i][self.n] / a[i][i] for i in range(self.n)]


def batch_bucket(batch_size: int) -> int:
    """1, 2, 3-4, 5-8, ...: batch sizes whose trees are alike."""
    return max(1, batch_size - 1).bit_length() if batch_size > 1 else 0


class LoadAwarePolicy:
    """Thread-safe: request handlers ask for budgets and report outcomes concurrently."""

    def __init__(self, cost: CostModel, max_nodes: int = DYNAMIC_MAX_NODES, max_depth: int = DYNAMIC_MAX_DEPTH,
                 level_seconds: float | None = None, clock=time.monotonic, probe_interval_s: float = PROBE_INTERVAL_S,
                 half_life_s: float = COST_HALF_LIFE_S, free_members: tuple[str, ...] = ()):
        self.cost = cost
        self.free_members = frozenset(free_members)  # the pool's model-free members (their drafts cost no pass)
        self.max_nodes, self.max_depth = max_nodes, max_depth
        # Until measured, an SSM level costs a tenth of a one-token LLM pass.
        self.level_seconds = level_seconds if level_seconds is not None else 0.1 * cost.seconds(1)
        self._level_prior_s = self.level_seconds  # where the fit's level term starts and leans while evidence is thin
        self.fixed_seconds = 0.0
        self.step_overhead_s = 0.0  # a step's time beyond its LLM pass, fitted online from plain steps
        # Drafting time = fixed + ssm_start (when the SSMs run at all: their first pass reads what they
        # have not seen yet, from caches the LLM's pass left cold) + level_seconds * levels.
        self.ssm_start_s = 0.0
        self._draft_fit = DecayedLeastSquares(3)
        self.clock, self.probe_interval_s, self.half_life_s = clock, probe_interval_s, half_life_s
        self._fitted_at: float | None = None
        self._stats: dict[tuple[bool, tuple[str, ...], int], StepStats] = {}
        self._free_stats: dict[tuple[bool, tuple[str, ...], int], StepStats] = {}  # steps without SSM levels
        self._created_at = clock()
        self._speculated_at = self._created_at  # when a speculative step was last chosen
        self._probe_left = 0  # steps left in the running probe
        self._probe_started: float | None = None
        self._probe_seconds = 0.0  # how long the last probe took
        self._lock = threading.Lock()

    def stats(self, batch_size: int, is_greedy: bool = True, pool: tuple[str, ...] = ()) -> StepStats:
        """The speculative steps of this pool (requests name theirs; () is the whole pool) measured at
        this load (else at the nearest smaller one, else the prior)."""
        key = (is_greedy, pool, batch_bucket(batch_size))
        stats = self._stats.get(key)
        if stats is None:
            smaller = [b for g, p, b in self._stats if g == is_greedy and p == pool and b < key[2]]
            prior = self._stats[(is_greedy, pool, max(smaller))] if smaller else None
            accepted, nodes, levels = ((prior.accepted, prior.nodes, prior.levels) if prior is not None
                                       else PRIOR_GREEDY if is_greedy else PRIOR_SAMPLED)
            stats = self._stats[key] = StepStats(accepted, nodes, levels)
        return stats

    def has_free_members(self, pool: tuple[str, ...]) -> bool:
        """Whether this pool (() : the whole pool) has model-free members."""
        return bool(self.free_members & set(pool)) if pool else bool(self.free_members)

    def free_stats(self, batch_size: int, is_greedy: bool = True, pool: tuple[str, ...] = ()) -> StepStats | None:
        """The speculative steps of this pool without SSM levels measured at this load (else at the
        nearest smaller one, else the prior); None for a pool without model-free members (its
        steps without SSM levels have no drafts at all)."""
        if not self.has_free_members(pool):
            return None
        key = (is_greedy, pool, batch_bucket(batch_size))
        stats = self._free_stats.get(key)
        if stats is None:
            loads = [b for g, p, b in self._free_stats if g == is_greedy and p == pool and b < key[2]]
            prior = self._free_stats[(is_greedy, pool, max(loads))] if loads else None
            accepted, nodes, _ = ((prior.accepted, prior.nodes, 0.0) if prior is not None
                                  else PRIOR_GREEDY if is_greedy else PRIOR_SAMPLED)
            stats = self._free_stats[key] = StepStats(accepted, nodes, 0.0)
        return stats

    def _rate(self, batch: int, stats: StepStats, free: StepStats | None, draft_scale: float = 1.0,
              is_optimistic: bool = False) -> float:
        """Tokens per second of speculation: as its steps went, or as those without SSM levels went
        where that is better; `draft_scale` scales the drafting cost, `is_optimistic` adds the
        acceptance's uncertainty."""
        def rate(s: StepStats, levels: float) -> float:
            accepted = s.optimistic() if is_optimistic else s.accepted
            return (1 + accepted) / (self.cost.seconds(batch * (1 + s.nodes)) + self.step_overhead_s
                                     + draft_scale * self._draft_seconds(levels))

        return max(rate(stats, stats.levels), rate(free, 0.0) if free is not None else 0.0)

    def _draft_seconds(self, levels: float) -> float:
        return self.fixed_seconds + self.ssm_start_s * min(1.0, levels) + self.level_seconds * levels

    def budget(self, batch_size: int, is_greedy: bool = True, pool: tuple[str, ...] = ()) -> TreeBudget:
        """What a node and an SSM level cost, as shares of a speculative step at this load."""
        batch = max(1, batch_size)
        with self._lock:
            stats = self.stats(batch, is_greedy, pool)
            return self._budget(batch, stats)

    def _budget(self, batch: int, stats: StepStats) -> TreeBudget:
        # Shares of a step without a tree (its pass over the batch's roots, its own time, drafting's
        # fixed part): the tree's nodes and levels come on top of that.
        base_s = self.cost.seconds(batch) + self.step_overhead_s + self.fixed_seconds
        return TreeBudget(self.max_nodes, self.max_depth, node_cost=self.node_seconds(batch, stats.nodes) / base_s,
                          level_cost=max(0.0, self.level_seconds / base_s),
                          ssm_cost=max(0.0, self.ssm_start_s / base_s))

    def node_seconds(self, batch: int, nodes: float) -> float:
        """What one more node in each of the batch's trees adds to the pass: at least the trees'
        average (the rate charges a tree of k nodes k node costs: the pass's growth from the roots
        alone to trees of the size measured lately, over their nodes; the secant of the cost
        curve), and at least the slope at that size (the tangent). Either alone can be zero where
        two calibrated sizes timed alike, and a free node is the costly mistake: trees grow to
        their cap on nodes that do not pay, then are priced steeply past the flat stretch and
        shrink again. A node priced a little high only makes a tree a little smaller."""
        extra = max(1.0, nodes)
        tokens = batch * (1 + extra)
        secant = (self.cost.seconds(tokens) - self.cost.seconds(batch)) / extra
        tangent = self.cost.seconds(tokens + batch) - self.cost.seconds(tokens)
        return max(0.0, secant, tangent)

    def choose(self, batch_size: int, is_greedy: bool = True, pool: tuple[str, ...] = ()) -> TreeBudget | tuple[()]:
        """This step's budget, or () for plain decoding where speculating does not pay at this load
        for this pool (unless a probe of speculation is due)."""
        batch = max(1, batch_size)
        with self._lock:
            stats = self.stats(batch, is_greedy, pool)
            budget = self._budget(batch, stats)
            if budget.node_cost >= 1.0:  # no node can pay: one brings a token at most, for a step's time
                return ()
            plain_rate = 1.0 / (self.cost.seconds(batch) + self.step_overhead_s)
            free = self.free_stats(batch, is_greedy, pool)
            now = self.clock()
            if self._rate(batch, stats, free) > plain_rate or self._probe_left:
                self._probe_left = max(0, self._probe_left - 1)
                self._speculated_at = now
                return budget
            if self._probe_started is not None:  # the probe is over: what it cost
                self._probe_seconds, self._probe_started = now - self._probe_started, None
            # Probes take at most PROBE_SHARE of the time, however slow their steps are (a loaded
            # machine), and only where speculation could still win.
            interval = max(self.probe_interval_s, self._probe_seconds / PROBE_SHARE)
            if now - self._speculated_at >= interval and self._could_win(batch, stats, free, plain_rate, now):
                self._probe_left, self._probe_started = NUM_PROBE_STEPS - 1, now
                self._speculated_at = now
                return budget
            return ()

    def _could_win(self, batch: int, stats: StepStats, free: StepStats | None, plain_rate: float, now: float
                   ) -> bool:
        """Whether speculation could beat plain decoding on an optimistic estimate: its acceptance
        plus its uncertainty, and a drafting cost that halves every `half_life_s` since it was
        last measured (a cost measured under a neighbour that has left). The LLM's costs need no
        optimism: every pass refreshes them."""
        age = now - (self._fitted_at if self._fitted_at is not None else self._created_at)
        fade = 0.5 ** (max(0.0, age) / self.half_life_s)
        return self._rate(batch, stats, free, draft_scale=fade, is_optimistic=True) > plain_rate

    def observe_step(self, num_accepted: int, num_nodes: int, num_levels: int, batch_size: int = 1,
                     is_greedy: bool = True, pool: tuple[str, ...] = ()) -> None:
        """One verified speculative step: tokens accepted, nodes beyond the root, SSM levels."""
        with self._lock:
            self.stats(max(1, batch_size), is_greedy, pool).observe(num_accepted, num_nodes, num_levels)
            free = self.free_stats(max(1, batch_size), is_greedy, pool) if num_levels == 0 else None
            if free is not None:
                free.observe(num_accepted, num_nodes, 0)

    def observe_plain_step(self, seconds: float, weight: float = 0.05) -> None:
        """The wall time (speculate to record) of a plain step alone in its pass: what it took beyond
        the one-token LLM pass the cost model predicts is the per-step overhead (an exponential average)."""
        with self._lock:
            sample = max(0.0, seconds - self.cost.seconds(1))
            self.step_overhead_s += weight * (sample - self.step_overhead_s)

    def observe_speculation(self, num_levels: int, seconds: float, decay: float = 0.98) -> None:
        """Wall time the verifier waited for a tree of `num_levels` SSM levels (0: the model-free
        members' alone); refits seconds = fixed + ssm_start * [levels > 0] + per_level * levels by
        exponentially weighted least squares (weights also halving every `half_life_s`)."""
        with self._lock:
            now = self.clock()
            if self._fitted_at is not None:  # older evidence fades with time, not only with steps
                decay *= 0.5 ** (max(0.0, now - self._fitted_at) / self.half_life_s)
            self._fitted_at = now
            if self._draft_fit.weight > 0:  # one stalled step (a preempted thread) must not set the price
                predicted = self._draft_seconds(num_levels)
                seconds = min(seconds, OUTLIER_FACTOR * predicted + 0.001)
            self._draft_fit.observe((1.0, float(num_levels > 0), float(num_levels)), seconds, decay)
            fit = self._draft_fit.coefficients((None, 0.0, self._level_prior_s), DRAFT_PRIOR_WEIGHT)
            if fit is None:
                return
            fixed, start, per_level = (max(0.0, b) for b in fit)
            self.fixed_seconds = fixed
            if self._draft_fit.has_seen(2):  # levels beyond the first seen lately: their cost is known apart
                self.ssm_start_s, self.level_seconds = start, per_level
            elif self._draft_fit.has_seen(1):  # one level at most lately: the SSMs' start and one level together
                self.ssm_start_s, self.level_seconds = 0.0, start + per_level
