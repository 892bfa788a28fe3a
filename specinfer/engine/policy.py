"""Load-aware speculation: choose each step's tree shape from measured costs and acceptance.

SpecInfer's gains shrink as the batch grows (Section 6.2, Figure 10: wide trees pay at batch 1-2,
widths 2-3 at batch >= 4), because verifying B trees of N nodes costs an LLM pass over B*N
tokens. The policy maximises expected throughput

    B * (1 + E[accepted | w]) / (t_llm(B * N(w)) + t_step + t_ssm * depth(w))

over a family of width vectors w, where t_llm comes from a cost model calibrated at start-up
(LLM forward time against tokens in the pass), t_step is what a step costs beyond its pass
(sampling, bookkeeping, the request's own Python: measured on plain steps of one request, and
paid once per step however many tokens it brings), t_ssm is the measured time per speculation level,
and E[accepted | w] follows from the measured top-k containment c(k) of the SSMs (the chance that
the LLM's token is among a node's first k drafts): E = sum_i prod_{j<=i} c(w_j). Depth 0 (plain
decoding) is a candidate, so speculation switches off when it would not pay; so is a tree of the
pool's model-free members alone (`MODEL_FREE_ONLY`: no SSM pass, its acceptance and size learnt
from its own steps).

A choice cannot stick. Speculation costs are refitted with weights that halve every
`half_life_s` of (injectable) clock time, and an arm the policy stopped choosing is probed with
two steps every `probe_interval_s` (less often when probes are slow: they take at most
`PROBE_SHARE` of the time): a cost measured under a noisy neighbour is re-measured and
forgotten once the neighbour leaves, instead of keeping speculation off for good. Plain Python;
the one tensor-touching part, calibration, only times a runner.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from dataclasses import dataclass, field

from specinfer.engine.tree import TokenTree

# A choice of widths that asks the pool's model-free members alone (no SSM pass: it costs ~0).
MODEL_FREE_ONLY: tuple[int, ...] = (0,)
PRIOR_CONTAINMENT = (0.6, 0.7, 0.76, 0.8, 0.83, 0.85, 0.87, 0.88)  # c(1..8) before any evidence
PRIOR_WEIGHT = 20.0  # pseudo-observations behind the prior
PROBE_INTERVAL_S = 0.5  # an arm not chosen is still measured with one step this often
PROBE_SHARE = 0.1  # and probes take at most this share of the time
COST_HALF_LIFE_S = 2.0  # speculation-cost observations this old weigh half
PRIOR_MODEL_FREE = (0.3, 3.0)  # (accepted tokens, nodes) of a model-free-only step before any evidence
SSM, MODEL_FREE = "ssm", "model_free"  # the arms that get probed (plain decoding needs no probe)


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
class AcceptanceStats:
    """Top-k containment of the speculated drafts, learnt from verified steps."""

    max_width: int = 8
    hits: list[float] = field(default_factory=list)  # hits[k-1]: accepted within the first k drafts
    trials: list[float] = field(default_factory=list)  # nodes that had >= k drafts

    def __post_init__(self):
        if not self.hits:
            self.hits = [PRIOR_WEIGHT * c for c in PRIOR_CONTAINMENT[: self.max_width]]
            self.trials = [PRIOR_WEIGHT] * self.max_width

    def observe_node(self, num_drafts: int, accepted_rank: int | None) -> None:
        """One visited node: how many drafts it had, and which one (0-based) was accepted."""
        for k in range(1, min(num_drafts, self.max_width) + 1):
            self.trials[k - 1] += 1
            if accepted_rank is not None and accepted_rank < k:
                self.hits[k - 1] += 1

    def observe_step(self, tree: TokenTree, path: list[int]) -> None:
        """Feeds the nodes a verification walked through (greedy or sampled trees alike)."""
        for i, node in enumerate(path):
            children = tree.children[node]
            if not children:
                continue
            nxt = path[i + 1] if i + 1 < len(path) else None
            self.observe_node(len(children), children.index(nxt) if nxt is not None else None)

    def containment(self, k: int) -> float:
        k = max(1, min(k, self.max_width))
        values = [h / t for h, t in zip(self.hits, self.trials)]
        return max(values[:k])  # c(k) never decreases with k


def candidate_widths(max_depth: int, max_width: int) -> list[tuple[int, ...]]:
    """The shapes the policy considers: up to two branching levels, then a chain."""
    out = {()}
    for depth in range(1, max_depth + 1):
        for w1, w2 in itertools.product(range(1, max_width + 1), range(1, max_width + 1)):
            if depth == 1 and w2 > 1:
                continue
            widths = (w1,) + ((w2,) if depth > 1 else ()) + (1,) * (depth - 2)
            out.add(widths)
    return sorted(out, key=lambda w: (len(w), w))


def expected_accepted(widths: tuple[int, ...], stats: AcceptanceStats) -> float:
    total, reach = 0.0, 1.0
    for w in widths:
        reach *= stats.containment(w)
        total += reach
    return total


def num_nodes(widths: tuple[int, ...]) -> int:
    total, level = 1, 1
    for w in widths:
        level *= w
        total += level
    return total


class LoadAwarePolicy:
    """Thread-safe: request handlers ask for shapes and report outcomes concurrently."""

    def __init__(self, cost: CostModel, max_depth: int = 8, max_width: int = 3, max_nodes: int = 64,
                 level_seconds: float | None = None, clock=time.monotonic, probe_interval_s: float = PROBE_INTERVAL_S,
                 half_life_s: float = COST_HALF_LIFE_S):
        self.cost = cost
        # Greedy and sampled verification accept at very different rates: learnt apart.
        self.stats = AcceptanceStats(max_width=max(max_width, 1))
        self.sampled_stats = AcceptanceStats(max_width=max(max_width, 1))
        self.candidates = [w for w in candidate_widths(max_depth, max_width) if num_nodes(w) <= max_nodes]
        # Speculation time per step = fixed_seconds (round trip, catch-up) + level_seconds * depth,
        # fitted online; until measured, a level costs a tenth of a one-token LLM pass.
        self.level_seconds = level_seconds if level_seconds is not None else 0.1 * cost.seconds(1)
        self.fixed_seconds = 0.0
        self.step_overhead_s = 0.0  # a step's time beyond its LLM pass, fitted online from plain steps
        self._fit = [0.0] * 5  # decayed sums: n, depth, depth^2, seconds, depth*seconds
        self.clock, self.probe_interval_s, self.half_life_s = clock, probe_interval_s, half_life_s
        self._fitted_at: float | None = None
        self._measured_at: dict[str, float] = {}  # arm -> when a step of it was last chosen (else: created)
        self._created_at = clock()
        # A probe lasts two steps: the first after plain steps includes the SSMs' catch-up, so only
        # the second measures a steady step's speculation cost.
        self._probe: tuple[tuple[int, ...], int] = ((), 0)
        self.num_probe_steps = 2
        self._probe_started: float | None = None
        self._probe_seconds = 0.0  # how long the last probe took
        # Model-free-only steps, greedy and sampled apart: decayed sums of (steps, accepted, nodes).
        self._model_free = {g: [PRIOR_WEIGHT / 4, PRIOR_WEIGHT / 4 * PRIOR_MODEL_FREE[0],
                                PRIOR_WEIGHT / 4 * PRIOR_MODEL_FREE[1]] for g in (True, False)}
        self._lock = threading.Lock()

    def choose(self, batch_size: int, is_greedy: bool = True, has_model_free: bool = False) -> tuple[int, ...]:
        """The width vector with the best expected throughput; () means do not speculate, and
        `MODEL_FREE_ONLY` (offered when the request's pool `has_model_free`) a model-free tree.
        An arm not chosen for `probe_interval_s` gets this step instead (one probe per interval)."""
        batch = max(1, batch_size)
        stats = self.stats if is_greedy else self.sampled_stats
        with self._lock:
            overhead = self.step_overhead_s
            plain_rate = batch / (self.cost.seconds(batch) + overhead)
            best_ssm, ssm_rate = (), 0.0
            for widths in self.candidates:
                if not widths:
                    continue
                step_s = (self.cost.seconds(batch * num_nodes(widths)) + overhead + self.fixed_seconds
                          + self.level_seconds * len(widths))
                rate = batch * (1 + expected_accepted(widths, stats)) / step_s
                if rate > ssm_rate:
                    best_ssm, ssm_rate = widths, rate
            arms = {(): plain_rate, best_ssm: ssm_rate} if best_ssm else {(): plain_rate}
            if has_model_free:
                steps, accepted, nodes = self._model_free[is_greedy]
                arms[MODEL_FREE_ONLY] = batch * (1 + accepted / steps) / (self.cost.seconds(batch * nodes / steps)
                                                                           + overhead)
            best = max(arms, key=arms.get)
            now = self.clock()
            probe, num_left = self._probe
            if num_left and probe in arms:
                best, self._probe = probe, (probe, num_left - 1)
            elif self._probe_started is not None:  # the probe is over: what it cost
                self._probe_seconds, self._probe_started = now - self._probe_started, None
            # Probes take at most PROBE_SHARE of the time, however slow their steps are (a loaded machine).
            interval = max(self.probe_interval_s, self._probe_seconds / PROBE_SHARE)
            for widths in arms:  # continuous re-measurement: an arm left out too long gets probed
                arm = self._arm(widths)
                last = self._measured_at.get(arm, self._created_at)
                if arm is not None and widths != best and now - last >= interval and not num_left:
                    best, self._probe = widths, (widths, self.num_probe_steps - 1)
                    self._probe_started = now
                    break
            arm = self._arm(best)
            if arm is not None:
                self._measured_at[arm] = now
            return best

    @staticmethod
    def _arm(widths: tuple[int, ...]) -> str | None:
        return None if not widths else (MODEL_FREE if widths == MODEL_FREE_ONLY else SSM)

    def observe_model_free(self, num_accepted: int, num_nodes: int, is_greedy: bool = True,
                           decay: float = 0.98) -> None:
        """One verified model-free-only step: tokens accepted from its tree and the tree's nodes."""
        with self._lock:
            sums = self._model_free[is_greedy]
            for i, value in enumerate((1.0, num_accepted, num_nodes)):
                sums[i] = decay * sums[i] + value

    def observe_plain_step(self, seconds: float, weight: float = 0.05) -> None:
        """The wall time (speculate to record) of a plain step alone in its pass: what it took beyond
        the one-token LLM pass the cost model predicts is the per-step overhead (an exponential average)."""
        with self._lock:
            sample = max(0.0, seconds - self.cost.seconds(1))
            self.step_overhead_s += weight * (sample - self.step_overhead_s)

    def observe_step(self, tree: TokenTree, path: list[int], is_greedy: bool = True) -> None:
        if len(tree) > 1:
            with self._lock:
                (self.stats if is_greedy else self.sampled_stats).observe_step(tree, path)

    def observe_speculation(self, depth: int, seconds: float, decay: float = 0.98) -> None:
        """Wall time the verifier waited for a tree of `depth` levels; refits
        seconds = fixed + per_level * depth by exponentially weighted least squares."""
        if depth <= 0:
            return
        with self._lock:
            now = self.clock()
            if self._fitted_at is not None:  # older evidence fades with time, not only with steps
                decay *= 0.5 ** (max(0.0, now - self._fitted_at) / self.half_life_s)
            self._fitted_at = now
            fit = self._fit
            for i, value in enumerate((1.0, depth, depth * depth, seconds, depth * seconds)):
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
            else:  # one depth so far: charge it all to the levels
                per_level, fixed = sy / sd, 0.0
            self.level_seconds, self.fixed_seconds = per_level, fixed
