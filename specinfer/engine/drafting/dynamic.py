"""Dynamic token trees: each step's tree grown node by node from each candidate's chance of acceptance.

SpecInfer (Section 3.1) expands a static width vector <k1, ..., km> every step. The best tree
differs from step to step: an SSM that is sure of its next tokens is worth following deep, one
that hesitates is not worth a second level, and a model-free member that matched a long stretch
of the context is worth more than the SSM's guess. So trees here are grown as in EAGLE-2 (arXiv
2406.16858): every candidate node is valued by the chance that verification accepts it, the
product along its path of calibrated conditional acceptances; the SSMs expand the most valuable
nodes of each level, one batched pass per level; and the tree keeps the most valuable
candidates. They are sized as in Sequoia (arXiv 2402.12374), for the batch and the device: a
node is kept, and another SSM level is run, only while that raises the step's expected rate

    (1 + sum of the kept nodes' values) / (1 + node_cost * nodes + level_cost * SSM levels)

where the costs (`params.TreeBudget`) are what the verifier's cost model says one more node in
the LLM's pass, and one more SSM pass, add to the step's time at the current load.

A candidate's conditional acceptance is its drafter's confidence (the SSM's probability of the
token; a model-free member's empirical probability of the branch, with how much of the context
it matched), calibrated online against measured acceptance by drafter, depth and confidence
(`Calibration`). SSM and model-free candidates compete in one budget (SpecInfer's merge,
Section 3.2, by value instead of union): a path several drafters propose is one node, valued by
the best estimate. Each SSM is calibrated on its own (a useless one among good ones is valued as
useless), and before its first pass it runs only if the tokens its drafts alone got accepted on
recent steps with model-free candidates as good as this step's pay for its passes (`MemberGain`):
a member whose measured acceptance cannot pay for its cost drops out of the tree, and per step
speculation goes down to the model-free members alone, or to no tree at all.

Exactness (Section 4.3). Verification keeps exactly the LLM's own tokens (its argmax, or its
sample with the request's noise: `sampling.SamplingNoise`), so any tree is exact, and the
drafts may be chosen, pruned and merged freely. For sampled requests an SSM's children are the
Gumbel-top-k of its own distribution with the same noise (coupled drafts), valued by their rank
there. Plain Python around one softmax and top-k per expanded level.
"""

from __future__ import annotations

import bisect
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from specinfer.engine.verification.sampling import SamplingNoise, perturbed, warp_logits
from specinfer.engine.drafting.tree import ScoredTree, TokenTree
from specinfer.limits import DYNAMIC_EXPAND_TOP_K, DYNAMIC_EXPAND_WIDTH
from specinfer.params import SamplingParams, TreeBudget

# The SSMs' candidates are calibrated by SSM and by their rank among their siblings: "ssm0#r" (the
# r-th most likely child of the pool's first SSM) for greedy requests, "ssm0~r" (the r-th of the
# coupled Gumbel-top-k) for sampled ones. Model-free members' candidates go by the member's name
# and match length.
SSM = "ssm"
_SSM_SOURCE = re.compile(r"^ssm(\d+)([#~])(\d+)$")
REACH = "reach"  # the calibration of whole values (see Calibration.reach)
CONFIDENCE_EDGES = (0.01, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97)
MAX_DEPTH_BUCKET = 4  # depths 4 and deeper share their statistics
PRIOR_WEIGHT = 4.0  # observations behind a cell's prior (the drafter's confidence)
CELL_WINDOW = 512.0  # observations a cell remembers (older ones fade: acceptance drifts with the text)
PRIOR_COUPLED = (0.5, 0.15, 0.05)  # a coupled draft's acceptance by rank, before its confidence
PRIOR_EXPAND = 0.6  # the best child's conditional acceptance at an expanded node, before any evidence
MIN_RATE = 1e-3  # candidates less likely than this are not even kept as candidates
DROPPED_SHARE = 0.9  # a member judged not worth its passes on this share of recent steps is out of the trees

Feature = tuple[str, int, float]  # (drafter, depth, confidence): what a candidate's estimate is read from


def ssm_source(member: int, is_greedy: bool, rank: int) -> str:
    """The drafter name SSM `member`'s rank-`rank` candidates are calibrated under."""
    return f"{SSM}{member}{'#' if is_greedy else '~'}{min(rank, len(PRIOR_COUPLED))}"


def ssm_member(source: str) -> int | None:
    """The SSM a candidate's drafter name belongs to; None for a model-free member's."""
    match = _SSM_SOURCE.match(source)
    return int(match.group(1)) if match else None


def _prior(source: str, conf: float) -> float:
    """A cell's estimate before evidence: an SSM's probability at its word; a model-free member's
    branch probability, trusted more the longer its match (its name is suffixed with the match)."""
    match = _SSM_SOURCE.match(source)
    if source == REACH or (match and match.group(2) == "#"):
        return conf
    if match:  # coupled: the rank-r Gumbel-max draft of the SSM's distribution
        base = PRIOR_COUPLED[int(match.group(3)) - 1]
        return base + (1 - base) * conf
    num_matched = int(source.rsplit(":", 1)[-1]) if ":" in source else 1
    return conf * min(0.9, 0.3 + 0.2 * num_matched)


def model_free_source(name: str, num_matched: int) -> str:
    """The drafter name a model-free member's candidates are calibrated under (by match length)."""
    return f"{name}:{min(num_matched, MAX_DEPTH_BUCKET)}"


class Calibration:
    """P(a candidate is accepted | its parent was reached), by drafter, depth and confidence bin,
    learnt from verified steps; each cell starts from PRIOR_WEIGHT observations at the drafter's
    own confidence. Thread-safe (the requests of a pool learn together)."""

    def __init__(self):
        self._cells: dict[tuple[str, int, int], list[float]] = {}
        self._lock = threading.Lock()
        self.expand_rate = PRIOR_EXPAND  # the best child's conditional acceptance at expanded nodes (an average)

    @staticmethod
    def _key(source: str, depth: int, conf: float) -> tuple[str, int, int]:
        return source, min(depth, MAX_DEPTH_BUCKET), bisect.bisect(CONFIDENCE_EDGES, conf)

    def rate(self, source: str, depth: int, conf: float) -> float:
        prior = _prior(source, conf)
        cell = self._cells.get(self._key(source, depth, conf))
        if cell is None:
            return prior
        return (cell[0] + PRIOR_WEIGHT * prior) / (cell[1] + PRIOR_WEIGHT)

    def observe(self, samples: list[tuple[Feature, bool]]) -> None:
        with self._lock:
            for (source, depth, conf), is_accepted in samples:
                cell = self._cells.setdefault(self._key(source, depth, conf), [0.0, 0.0])
                if cell[1] >= CELL_WINDOW:
                    cell[0] *= 1 - 1 / CELL_WINDOW
                    cell[1] *= 1 - 1 / CELL_WINDOW
                cell[0] += is_accepted
                cell[1] += 1.0

    def reach(self, value: float, depth: int = 0) -> float:
        """The measured chance that a kept node of this value (its estimated chance, the product
        along its path) is accepted: the estimates' errors compound along paths, and the most
        valuable of many estimates is an overestimate (the winner's curse)."""
        return self.rate(REACH, depth, value)

    def observe_expansion(self, best_rate: float, weight: float = 0.02) -> None:
        self.expand_rate += weight * (best_rate - self.expand_rate)


class MemberGain:
    """What each pool member that runs passes (an SSM) added to recent steps it ran in: the tokens
    verification accepted that only its drafts proposed (none of the model-free members' did),
    the nodes only it proposed, and the levels it ran, by how much the model-free candidates
    already offered (expected accepted tokens, bucketed). A member runs while that pays for its
    share of the start and level costs (`max_levels`), so one whose measured acceptance cannot pay
    for its cost drops out of the tree; left out of a bucket for `FORCE_EVERY` steps it runs
    anyway, so a verdict cannot stick, but only `RETRIAL_LEVELS` deep: a retrial measures what
    the member's first levels bring, and a weak draft valued by its optimistic prior would
    otherwise be followed many levels deep at every retrial. Means over a window of recent runs,
    from an optimistic prior worth `PRIOR_WEIGHT` runs (a member is tried before it is judged)."""

    BUCKETS = (0.3, 1.0, 2.0)
    FORCE_EVERY = 32
    RETRIAL_LEVELS = 2  # the most levels a member runs in a retrial
    PRIOR = (1.5, 6.0, 3.0)  # accepted tokens, nodes, levels
    PRIOR_WEIGHT = 2.0
    WINDOW = 64.0  # runs a mean remembers

    SKIP_WEIGHT = 0.05  # of the latest decision in a member's share of steps it sits out

    def __init__(self):
        self._sums: dict[tuple[int, int], list[float]] = {}  # (member, bucket) -> [tokens, nodes, levels, runs]
        self._skipped: dict[tuple[int, int], int] = {}
        self._skip_share: dict[int, float] = {}  # member -> recent share of steps it sat out
        self._lock = threading.Lock()

    def _bucket(self, model_free_value: float) -> int:
        return bisect.bisect(self.BUCKETS, model_free_value)

    def mean(self, member: int, model_free_value: float) -> tuple[float, float, float, float]:
        """(accepted tokens, nodes, levels, runs measured) of `member` at this model-free value."""
        sums = self._sums.get((member, self._bucket(model_free_value)), [0.0, 0.0, 0.0, 0.0])
        weight = sums[3] + self.PRIOR_WEIGHT
        return (*((s + self.PRIOR_WEIGHT * p) / weight for s, p in zip(sums, self.PRIOR)), sums[3])

    def max_levels(self, member: int, model_free_value: float, model_free_nodes: int, budget: TreeBudget,
                   num_running: int = 1) -> int:
        """How many levels `member` runs this step, one of `num_running` members sharing the start
        cost: 0 (it sits out), `RETRIAL_LEVELS` (a retrial) or the budget's depth."""
        key = (member, self._bucket(model_free_value))
        with self._lock:
            gain, extra_nodes, levels, _ = self.mean(member, model_free_value)
            base = 1 + budget.node_cost * model_free_nodes
            cost = budget.node_cost * extra_nodes + (budget.ssm_cost + budget.level_cost * levels) / max(1, num_running)
            skipped = self._skipped.get(key, 0)
            is_worth = (1 + model_free_value + gain) / (base + cost) > (1 + model_free_value) / base
            share = self._skip_share.get(member, 0.0)
            self._skip_share[member] = share + self.SKIP_WEIGHT * ((not is_worth) - share)
            if is_worth or skipped + 1 >= self.FORCE_EVERY:
                self._skipped[key] = 0
                return budget.max_depth if is_worth else min(budget.max_depth, self.RETRIAL_LEVELS)
            self._skipped[key] = skipped + 1
            return 0

    def observe(self, member: int, model_free_value: float, accepted: int, nodes: int, levels: int) -> None:
        """One verified step `member` ran in: what only its drafts got accepted and added."""
        with self._lock:
            sums = self._sums.setdefault((member, self._bucket(model_free_value)), [0.0, 0.0, 0.0, 0.0])
            if sums[3] >= self.WINDOW:
                for i in range(4):
                    sums[i] *= 1 - 1 / self.WINDOW
            for i, value in enumerate((accepted, nodes, levels, 1)):
                sums[i] += value

    def summary(self, member: int) -> dict:
        """What `member` did over its measured runs (every bucket): runs, and per run the tokens
        accepted that only its drafts proposed, the nodes only it added and its levels; and
        whether it sits out steps now (`is_dropped`)."""
        with self._lock:
            sums = [sum(v[i] for k, v in self._sums.items() if k[0] == member) for i in range(4)]
        runs = sums[3]
        per_run = [round(x / runs, 3) if runs else 0.0 for x in sums[:3]]
        return {"runs": round(runs, 1), "accepted_alone": per_run[0], "nodes_alone": per_run[1], "levels": per_run[2],
                "dropped": self.is_dropped(member)}

    def is_dropped(self, member: int) -> bool:
        """Whether `member` is out of the trees now: judged not worth its cost on nearly every
        recent step, whatever the model-free members offered (the runs that retry it aside; a
        member that pays where the model-free drafts are weak sits out only the other steps)."""
        with self._lock:
            return self._skip_share.get(member, 0.0) > DROPPED_SHARE


class Candidates:
    """One request's candidate nodes for one step: a token tree (structure only; node 0 the root)
    whose nodes carry their drafters, their conditional acceptance (the best drafter's) and
    their value (the product along the path)."""

    def __init__(self, root: int):
        self.tree = TokenTree.with_root(root)
        self.cond = [1.0]
        self.value = [1.0]
        self.features: list[list[Feature]] = [[]]

    def __len__(self) -> int:
        return len(self.tree)

    def add(self, parent: int, token: int, feature: Feature, rate: float) -> int:
        tree = self.tree
        child = tree.child_with_token(parent, token)
        if child is None:
            child = tree._append(token, parent, tree.depths[parent] + 1)
            tree.children[parent].append(child)
            self.cond.append(rate)
            self.value.append(self.value[parent] * rate)
            self.features.append([feature])
            return child
        self.features[child].append(feature)
        if rate > self.cond[child]:
            self.cond[child] = rate
            self._revalue(child)
        return child

    def _revalue(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            self.value[n] = self.value[self.tree.parents[n]] * self.cond[n]
            stack.extend(self.tree.children[n])

    def select(self, budget: TreeBudget, num_levels: int, reach=lambda value: value) -> tuple[list[int], float]:
        """The step's nodes (root first) and their expected accepted tokens: the most valuable
        candidates while each raises the expected rate (a prefix of the value order is a tree: a
        child is never worth more than its parent, and ties go to the shallower). `reach` maps a
        value to the measured chance that a node of that value is accepted."""
        order = sorted(range(1, len(self)), key=lambda n: (-self.value[n], self.tree.depths[n], n))
        base = 1 + budget.level_cost * num_levels
        best_rate, best_k, best_total, total = 1 / base, 0, 0.0, 0.0
        for k, n in enumerate(order[:max(0, budget.max_nodes)], 1):
            total += reach(self.value[n], self.tree.depths[n])
            rate = (1 + total) / (base + budget.node_cost * k)
            if rate > best_rate:
                best_rate, best_k, best_total = rate, k, total
        return [0] + order[:best_k], best_total

    def build(self, chosen: list[int]) -> tuple[TokenTree, list[int]]:
        """The step's tree of the chosen nodes, level by level, each node's children the most
        valuable first; and each tree node's candidate."""
        cand = self.tree
        order = sorted(chosen[1:], key=lambda n: (cand.depths[n], -self.value[n], n))
        tree = TokenTree.with_root(cand.tokens[0])
        index, of = {0: 0}, [0]
        for n in order:
            index[n] = tree.add_draft(index[cand.parents[n]], cand.tokens[n])
            of.append(n)
        return tree, of


@dataclass
class BuiltTree:
    """What a step's dynamic tree was built from: verification's outcome on it calibrates the
    drafters, and tells each SSM that ran what its drafts alone brought (`MemberGain`)."""

    candidates: Candidates
    of: list[int]  # the step's tree node -> its candidate
    is_greedy: bool  # which calibration it feeds
    model_free_value: float = 0.0  # what the model-free candidates offered (expected accepted tokens)
    members: tuple[int, ...] = ()  # the SSMs that ran
    num_levels: int = 0


def learn(calibration: Calibration, built: BuiltTree, accepted: list[int], bonus: int,
          gain: MemberGain | None = None) -> None:
    """Feeds a verified step to the calibration: every candidate whose parent verification
    reached, kept in the tree or not, was accepted exactly when its token is the LLM's there (its
    argmax, or its sample: the noise fixes it whatever the tree); and to `gain`, per SSM that
    ran, the accepted tokens and kept nodes that only its drafts (no model-free member's) proposed."""
    cands = built.candidates
    tree = cands.tree
    path = tree.find_path(accepted)
    samples: list[tuple[Feature, bool]] = []
    for i, node in enumerate(path):
        llm_token = accepted[i] if i < len(accepted) else bonus
        for c in tree.children[node]:
            samples.extend((f, tree.tokens[c] == llm_token) for f in cands.features[c])
    on_path = set(path)
    samples.extend(((REACH, tree.depths[n], cands.value[n]), n in on_path) for n in built.of[1:])
    calibration.observe(samples)
    if gain is None:
        return
    for m in built.members:
        def alone(n: int) -> bool:
            members = [ssm_member(f[0]) for f in cands.features[n]]
            return m in members and None not in members

        gain.observe(m, built.model_free_value, sum(map(alone, path[1:])), sum(map(alone, built.of[1:])),
                     built.num_levels)


@dataclass
class FedNodes:
    """One SSM's scratch for this step's candidates: which candidate each scratch row holds."""

    scratch_of: list[int]  # candidate -> scratch index (-1: not fed)
    scratch_parents: list[int] = field(default_factory=list)


class DynamicBuild:
    """One request's dynamic tree for one step. The model-free candidates come first (they cost
    nothing); then, when worth it, the SSMs (`ssm_seqs`: runner index -> the request's SSM cache,
    caught up by the caller) expand the most valuable nodes level by level, each `grow` reading
    every SSM's logits at the last level's expanded nodes; `finish` keeps the best tree.
    `root_position` is the root's position in the request (a sampled request's noise is by position)."""

    def __init__(self, root: int, root_position: int, budget: TreeBudget, params: SamplingParams,
                 noise: SamplingNoise | None, calibration: Calibration, gain: MemberGain,
                 scored: list[tuple[str, ScoredTree]], ssm_seqs: dict[int, Any], is_sampled: bool = True):
        self.budget, self.params, self.noise = budget, params, noise
        self.root_position = root_position
        self.calibration, self.gain = calibration, gain
        self.is_greedy = params.is_greedy
        # Sampled requests: the SSMs' Gumbel-top-k with the request's noise (coupled), else their top-k.
        self.is_coupled = is_sampled and not params.is_greedy and noise is not None
        self.cands = Candidates(root)
        self.num_levels = 0
        for name, (tree, confidence, num_matched) in scored:
            self._add_model_free(tree, confidence, model_free_source(name, num_matched))
        chosen, self.model_free_value = self.cands.select(budget, 0, calibration.reach)
        self.num_model_free_nodes = len(chosen) - 1
        ssm_seqs = ssm_seqs if budget.max_depth > 0 else {}
        levels = {m: gain.max_levels(m, self.model_free_value, self.num_model_free_nodes, budget, len(ssm_seqs))
                  for m in ssm_seqs}
        self.ssm_seqs = {m: seq for m, seq in ssm_seqs.items() if levels[m] > 0}
        # The SSMs expand no deeper than the deepest of them may (a retrial alone: its few levels).
        self.max_levels = max(levels.values(), default=0)
        self.fed = {m: FedNodes([-1]) for m in self.ssm_seqs}
        self.frontier = [0] if self.ssm_seqs else []

    @property
    def is_expanding(self) -> bool:
        return bool(self.frontier)

    def _add_model_free(self, tree: TokenTree, confidence: list[float], source: str) -> None:
        mapped = [0] * len(tree)
        for node in range(1, len(tree)):
            depth = tree.depths[node]
            if depth > self.budget.max_depth:
                continue
            rate = self.calibration.rate(source, depth, confidence[node])
            mapped[node] = self.cands.add(mapped[tree.parents[node]], tree.tokens[node],
                                          (source, depth, confidence[node]), rate)

    def _price(self) -> tuple[float, int, float]:
        """The value a node must add to pay for itself now; the nodes and value of the best tree so far."""
        chosen, total = self.cands.select(self.budget, self.num_levels, self.calibration.reach)
        base = 1 + self.budget.level_cost * self.num_levels + self.budget.node_cost * (len(chosen) - 1)
        return self.budget.node_cost * (1 + total) / base, len(chosen) - 1, total

    def grow(self, logits: dict[int, torch.Tensor]) -> None:
        """Adds the SSMs' children of the frontier (each SSM's logits: one row per frontier node),
        then picks the next frontier, or ends the expansion."""
        depth = self.num_levels + 1
        self.num_levels = depth
        best_rates = []
        for m, rows in logits.items():
            if self.is_greedy:
                probs = torch.softmax(rows.float(), dim=-1)
                top = torch.topk(probs, min(DYNAMIC_EXPAND_TOP_K, probs.shape[-1]), dim=-1)
                confs, tokens = top.values.tolist(), top.indices.tolist()
            else:
                warped = warp_logits(rows, self.params)
                probs = torch.softmax(warped, dim=-1)
                order = (perturbed(warped, self.noise, [self.root_position + depth] * len(self.frontier))
                         if self.is_coupled else warped)
                tokens = torch.topk(order, min(DYNAMIC_EXPAND_TOP_K, probs.shape[-1]), dim=-1).indices
                confs, tokens = probs.gather(-1, tokens).tolist(), tokens.tolist()
            for node, node_confs, node_tokens in zip(self.frontier, confs, tokens):
                sources = [ssm_source(m, self.is_greedy, r) for r in range(1, len(node_tokens) + 1)]
                rates = [self.calibration.rate(src, depth, c) for src, c in zip(sources, node_confs)]
                best_rates.append(max(rates))
                for src, conf, token, rate in zip(sources, node_confs, node_tokens, rates):
                    if self.cands.value[node] * rate >= MIN_RATE and conf > 0:
                        self.cands.add(node, token, (src, depth, conf), rate)
        for rate in best_rates:
            self.calibration.observe_expansion(rate)
        self.frontier = self._next_frontier(depth)

    def _next_frontier(self, depth: int) -> list[int]:
        """The next level's nodes to expand: children of this level's, the most valuable that
        could still pay for a child, as long as a level pays for itself."""
        if depth >= min(self.budget.max_depth, self.max_levels):
            return []
        price, num_nodes, total = self._price()
        if num_nodes >= self.budget.max_nodes:
            return []
        expand = self.calibration.expand_rate
        children = [c for f in self.frontier for c in self.cands.tree.children[f]]
        worth = sorted((c for c in children if self.cands.value[c] * expand >= price),
                       key=lambda c: -self.cands.value[c])[:DYNAMIC_EXPAND_WIDTH]
        if not worth:
            return []
        gain = expand * sum(self.cands.value[c] for c in worth)
        b = self.budget
        base = 1 + b.level_cost * self.num_levels + b.node_cost * num_nodes
        if (1 + total + gain) / (base + b.level_cost + b.node_cost * len(worth)) <= (1 + total) / base:
            return []
        return worth

    def feed(self, m: int) -> tuple[list[int], list[int], list[int]]:
        """SSM `m`'s work for the frontier: tokens, their depths, and the scratch parents (all rows)."""
        fed = self.fed[m]
        fed.scratch_of.extend([-1] * (len(self.cands) - len(fed.scratch_of)))
        for node in self.frontier:
            fed.scratch_of[node] = len(fed.scratch_parents)
            parent = self.cands.tree.parents[node]
            fed.scratch_parents.append(fed.scratch_of[parent] if parent > 0 else -1)
        tree = self.cands.tree
        return [tree.tokens[n] for n in self.frontier], [tree.depths[n] for n in self.frontier], list(fed.scratch_parents)

    def finish(self) -> tuple[TokenTree, BuiltTree]:
        """The step's tree, and what it was built from."""
        chosen, _ = self.cands.select(self.budget, self.num_levels, self.calibration.reach)
        for fed in self.fed.values():
            fed.scratch_of.extend([-1] * (len(self.cands) - len(fed.scratch_of)))
        tree, of = self.cands.build(chosen)
        return tree, BuiltTree(self.cands, of, self.is_greedy, self.model_free_value, tuple(self.fed), self.num_levels)
