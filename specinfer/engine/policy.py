"""Load-aware speculation: each step's tree priced by measured costs, or no tree where it does not pay.

SpecInfer's gains shrink as the batch grows (Section 6.2, Figure 10): verifying B trees of N
nodes costs an LLM pass over B*N tokens. Trees are dynamic (`engine.dynamic`): the drafts keep a
node, or run another SSM level, only while that raises the expected rate, given what one node
and one level cost as shares of the step's time (`TreeBudget`). This policy prices them for the
current batch and device, SmartSpec-style, from measured goodput:

    step time T = t_llm(B * (1 + nodes)) + t_step + t_draft,   node_cost = B * t_llm'(.) / T,
    level_cost = t_level / T

where t_llm comes from a cost model calibrated at start-up (LLM forward time against tokens in
the pass, refined by every measured pass), t_step is what a step costs beyond its pass
(sampling, bookkeeping, the request's own Python: measured on plain steps of one request, paid
once per step however many tokens it brings), t_draft = fixed + t_level * levels is the
measured drafting time, and nodes are the tree sizes measured at this load. Node costs charge
the whole batch (one more token in the pass slows every request in it), so trees shrink as the
batch grows, down to none. Plain decoding is the other arm: the policy speculates while

    (1 + accepted) / T  >  1 / (t_llm(B) + t_step)

with accepted, nodes and levels the decayed averages of the last speculative steps at this load
(greedy and sampled apart: they accept at very different rates).

A choice cannot stick. Costs are refitted with weights that halve every `half_life_s` of
(injectable) clock time, and while plain decoding wins, speculation is probed with two steps
every `probe_interval_s` (less often when probes are slow: at most `PROBE_SHARE` of the time),
unless even an optimistic estimate of it (its acceptance plus its uncertainty, and a drafting
cost that fades with the age of its measurement) could not win: probes are paid only where they
could change the verdict. Plain Python; the one
tensor-touching part, calibration, only times a runner.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from dataclasses import dataclass

from specinfer.limits import DYNAMIC_MAX_DEPTH, DYNAMIC_MAX_NODES
from specinfer.params import TreeBudget

PRIOR_GREEDY = (1.5, 6.0, 3.0)  # (accepted tokens, nodes, SSM levels) of a speculative step before any evidence
PRIOR_SAMPLED = (0.8, 4.0, 2.0)
PRIOR_WEIGHT = 4.0  # steps behind the prior
STATS_DECAY = 0.98  # a speculative step's weight falls by this per later step
PROBE_INTERVAL_S = 0.5  # speculation not chosen is still measured with a probe this often
PROBE_SHARE = 0.1  # and probes take at most this share of the time
NUM_PROBE_STEPS = 2  # the first step after plain ones also pays the SSMs' catch-up
COST_HALF_LIFE_S = 2.0  # drafting-cost observations this old weigh half


@dataclass
class CostModel:
    """LLM forward seconds as a piecewise-linear function of the tokens in the pass."""

    points: list[tuple[int, float]]  # (tokens, seconds), tokens ascending

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
    def calibrate(cls, runner, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), context: int = 256,
                  repeats: int = 5) -> "CostModel":
        """Times one forward pass per size over a `context`-token prefix. The fastest of several
        repeats: start-up shares the CPU with other processes, and a slow outlier would inflate
        every larger size (costs are made monotone below)."""
        from specinfer.engine.runner import Work

        # Within the free KV slots and the model's own context (a small model may hold fewer
        # positions than the default prefix plus the largest size).
        room = min(runner.allocator.num_free * runner.allocator.block_size, runner.max_context)
        context = max(1, min(context, room // 2))
        sizes = [n for n in sizes if context + n <= room] or [1]
        seq = runner.new_sequence()
        try:
            seq.ensure_capacity(context + max(sizes))
            runner.prefill(seq, [0] * context)
            works = {n: Work(seq, [0] * n, list(range(context, context + n)), list(range(-1, n - 1)), "all")
                     for n in sizes}
            best = {n: float("inf") for n in sizes}
            for repeat in range(repeats + 1):  # sizes interleaved, so a busy moment hits them alike
                for n in sizes:
                    start = time.perf_counter()
                    runner.run([works[n]])
                    if repeat:  # the first round is a warm-up
                        best[n] = min(best[n], time.perf_counter() - start)
            return cls([(n, best[n]) for n in sizes]).monotone()
        finally:
            seq.free()

    def monotone(self) -> "CostModel":
        """Costs never fall with more tokens: each size costs at most what any larger one does
        (so a slow outlier cannot inflate every larger size)."""
        points = list(self.points)
        for i in range(len(points) - 2, -1, -1):
            points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
        return CostModel(points)

    def observe(self, num_tokens: int, seconds: float, weight: float = 0.05) -> None:
        """Moves the nearest calibration point toward a measured pass (the machine's load and
        the real contexts drift from what start-up saw)."""
        i = min(range(len(self.points)), key=lambda j: abs(math.log(self.points[j][0]) - math.log(max(1, num_tokens))))
        size, old = self.points[i]
        predicted = self.seconds(num_tokens)
        self.points[i] = (size, old * (1 - weight + weight * seconds / max(predicted, 1e-9)))
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


def batch_bucket(batch_size: int) -> int:
    """1, 2, 3-4, 5-8, ...: batch sizes whose trees are alike."""
    return max(1, batch_size - 1).bit_length() if batch_size > 1 else 0


class LoadAwarePolicy:
    """Thread-safe: request handlers ask for budgets and report outcomes concurrently."""

    def __init__(self, cost: CostModel, max_nodes: int = DYNAMIC_MAX_NODES, max_depth: int = DYNAMIC_MAX_DEPTH,
                 level_seconds: float | None = None, clock=time.monotonic, probe_interval_s: float = PROBE_INTERVAL_S,
                 half_life_s: float = COST_HALF_LIFE_S):
        self.cost = cost
        self.max_nodes, self.max_depth = max_nodes, max_depth
        # Drafting time per step = fixed_seconds + level_seconds * levels, fitted online; until
        # measured, a level costs a tenth of a one-token LLM pass.
        self.level_seconds = level_seconds if level_seconds is not None else 0.1 * cost.seconds(1)
        self.fixed_seconds = 0.0
        self.step_overhead_s = 0.0  # a step's time beyond its LLM pass, fitted online from plain steps
        self._fit = [0.0] * 5  # decayed sums: n, levels, levels^2, seconds, levels*seconds
        self.clock, self.probe_interval_s, self.half_life_s = clock, probe_interval_s, half_life_s
        self._fitted_at: float | None = None
        self._stats: dict[tuple[bool, int], StepStats] = {}
        self._created_at = clock()
        self._speculated_at = self._created_at  # when a speculative step was last chosen
        self._probe_left = 0  # steps left in the running probe
        self._probe_started: float | None = None
        self._probe_seconds = 0.0  # how long the last probe took
        self._lock = threading.Lock()

    def stats(self, batch_size: int, is_greedy: bool = True) -> StepStats:
        """The speculative steps measured at this load (else at the nearest smaller one, else the prior)."""
        key = (is_greedy, batch_bucket(batch_size))
        stats = self._stats.get(key)
        if stats is None:
            smaller = [b for g, b in self._stats if g == is_greedy and b < key[1]]
            prior = self._stats[(is_greedy, max(smaller))] if smaller else None
            accepted, nodes, levels = ((prior.accepted, prior.nodes, prior.levels) if prior is not None
                                       else PRIOR_GREEDY if is_greedy else PRIOR_SAMPLED)
            stats = self._stats[key] = StepStats(accepted, nodes, levels)
        return stats

    def _step_seconds(self, batch: int, nodes: float, levels: float) -> float:
        return (self.cost.seconds(batch * (1 + nodes)) + self.step_overhead_s + self.fixed_seconds
                + self.level_seconds * levels)

    def budget(self, batch_size: int, is_greedy: bool = True) -> TreeBudget:
        """What a node and an SSM level cost, as shares of a speculative step at this load."""
        batch = max(1, batch_size)
        with self._lock:
            stats = self.stats(batch, is_greedy)
            return self._budget(batch, stats)

    def _budget(self, batch: int, stats: StepStats) -> TreeBudget:
        step_s = self._step_seconds(batch, stats.nodes, stats.levels)
        tokens = batch * (1 + stats.nodes)
        slope = (self.cost.seconds(tokens + batch) - self.cost.seconds(tokens)) / batch  # one more token in the pass
        return TreeBudget(self.max_nodes, self.max_depth, node_cost=max(0.0, batch * slope / step_s),
                          level_cost=max(0.0, self.level_seconds / step_s))

    def choose(self, batch_size: int, is_greedy: bool = True) -> TreeBudget | tuple[()]:
        """This step's budget, or () for plain decoding where speculating does not pay at this load
        (unless a probe of speculation is due)."""
        batch = max(1, batch_size)
        with self._lock:
            stats = self.stats(batch, is_greedy)
            plain_rate = 1.0 / (self.cost.seconds(batch) + self.step_overhead_s)
            step_s = self._step_seconds(batch, stats.nodes, stats.levels)
            now = self.clock()
            if (1 + stats.accepted) / step_s > plain_rate or self._probe_left:
                self._probe_left = max(0, self._probe_left - 1)
                self._speculated_at = now
                return self._budget(batch, stats)
            if self._probe_started is not None:  # the probe is over: what it cost
                self._probe_seconds, self._probe_started = now - self._probe_started, None
            # Probes take at most PROBE_SHARE of the time, however slow their steps are (a loaded
            # machine), and only where speculation could still win.
            interval = max(self.probe_interval_s, self._probe_seconds / PROBE_SHARE)
            if now - self._speculated_at >= interval and self._could_win(batch, stats, plain_rate, now):
                self._probe_left, self._probe_started = NUM_PROBE_STEPS - 1, now
                self._speculated_at = now
                return self._budget(batch, stats)
            return ()

    def _could_win(self, batch: int, stats: StepStats, plain_rate: float, now: float) -> bool:
        """Whether speculation could beat plain decoding on an optimistic estimate: its acceptance
        plus its uncertainty, and a drafting cost that halves every `half_life_s` since it was
        last measured (a cost measured under a neighbour that has left). The LLM's costs need no
        optimism: every pass refreshes them."""
        age = now - (self._fitted_at if self._fitted_at is not None else self._created_at)
        fade = 0.5 ** (max(0.0, age) / self.half_life_s)
        step_s = (self.cost.seconds(batch * (1 + stats.nodes)) + self.step_overhead_s
                  + fade * (self.fixed_seconds + self.level_seconds * stats.levels))
        return (1 + stats.optimistic()) / step_s > plain_rate

    def observe_step(self, num_accepted: int, num_nodes: int, num_levels: int, batch_size: int = 1,
                     is_greedy: bool = True) -> None:
        """One verified speculative step: tokens accepted, nodes beyond the root, SSM levels."""
        with self._lock:
            self.stats(max(1, batch_size), is_greedy).observe(num_accepted, num_nodes, num_levels)

    def observe_plain_step(self, seconds: float, weight: float = 0.05) -> None:
        """The wall time (speculate to record) of a plain step alone in its pass: what it took beyond
        the one-token LLM pass the cost model predicts is the per-step overhead (an exponential average)."""
        with self._lock:
            sample = max(0.0, seconds - self.cost.seconds(1))
            self.step_overhead_s += weight * (sample - self.step_overhead_s)

    def observe_speculation(self, num_levels: int, seconds: float, decay: float = 0.98) -> None:
        """Wall time the verifier waited for a tree of `num_levels` SSM levels (0: the model-free
        members' alone); refits seconds = fixed + per_level * levels by exponentially weighted least squares."""
        with self._lock:
            now = self.clock()
            if self._fitted_at is not None:  # older evidence fades with time, not only with steps
                decay *= 0.5 ** (max(0.0, now - self._fitted_at) / self.half_life_s)
            self._fitted_at = now
            fit = self._fit
            for i, value in enumerate((1.0, num_levels, num_levels * num_levels, seconds, num_levels * seconds)):
                fit[i] = decay * fit[i] + value
            n, sd, sdd, sy, sdy = fit
            det = n * sdd - sd * sd
            if det > 1e-9 * max(1.0, n * sdd):  # several depths seen: both terms identifiable
                per_level = (n * sdy - sd * sy) / det
                fixed = (sy - per_level * sd) / n
                if per_level < 0:
                    per_level, fixed = 0.0, sy / n
                elif fixed < 0:
                    per_level, fixed = sdy / sdd, 0.0
            elif sd > 0:  # one depth so far: charge it all to the levels
                per_level, fixed = sy / sd, 0.0
            else:  # model-free trees only so far
                per_level, fixed = self.level_seconds, sy / n
            self.level_seconds, self.fixed_seconds = per_level, fixed
