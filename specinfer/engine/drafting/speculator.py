"""Speculation with small models: expansion-based token trees, one batched SSM pass per level.

SpecInfer Section 3.1 (expansion-based construction): given a width vector <k1, ..., km>, every
frontier node at step i gets k_i children: the SSM's top-k_i tokens, or, for a sampled request,
the Gumbel-top-k_i of the SSM's distribution with the request's own noise (coupled drafts: the
first child is the token the LLM samples wherever the two distributions agree). Verification
keeps the LLM's own sample (`acceptance`), so no draft needs its distribution q: SpecInfer's
multi-step speculative sampling is not used. All frontier nodes of a level, for
every request in the batch, go through the SSM in one forward pass with a tree mask. Section
3.2 (merge-based construction) is `merge_trees` over the trees of several SSMs, and of the pool's
model-free members (prompt lookup, suffix speculation), whose deterministic drafts cost no pass.

An SSM keeps its own KV cache per request. Tokens verified since its last step are `pending`
and are fed first (the "catch-up"); after verification, the SSM commits the fed tree nodes that
lie on the accepted path and queues the rest of the accepted tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import torch

from specinfer.engine.scheduling.blocks import SequenceKV
from specinfer.engine.drafting.dynamic import BuiltTree, Calibration, DynamicBuild, MemberGain, learn
from specinfer.engine.runtime.runner import ModelRunner, Work, chain_work
from specinfer.engine.verification.sampling import SamplingNoise, fresh_seed, perturbed, warp_logits
from specinfer.engine.drafting.lookup import PromptLookup
from specinfer.engine.drafting.suffix import SuffixCache, SuffixSpeculator
from specinfer.engine.drafting.tree import ScoredTree, TokenTree, graft, merge_trees
from specinfer.limits import MODEL_FREE_MAX_DEPTH, MODEL_FREE_MAX_NODES, MODEL_FREE_NAMES, SUFFIX_CACHE_TOKENS
from specinfer.params import SamplingParams, TreeBudget, TreeShape

@dataclass
class SSMState:
    """One request's state in one SSM."""

    seq: SequenceKV
    pending: list[int] = field(default_factory=list)  # verified tokens not yet fed; last = root


@dataclass
class SSMTree:
    tree: TokenTree
    scratch_of: list[int]  # node id -> scratch index in the SSM cache, or -1 if never fed


class _Expansion:
    """Builds one request's tree in one SSM, level by level."""

    def __init__(self, state: SSMState, shape: TreeShape, params: SamplingParams, noise: SamplingNoise | None):
        self.state = state
        self.shape = shape
        self.params = params
        self.noise = noise
        self.tree = TokenTree.with_root(state.pending[-1])
        self.scratch_of = [-1]
        self.scratch_parents: list[int] = []
        self.path_logprob = [0.0]
        self.frontier = [0]
        self.level = 0

    @property
    def is_coupled(self) -> bool:
        """Children are the Gumbel-top-k of the SSM's distribution with the request's noise."""
        return not self.params.is_greedy and self.shape.is_sampled and self.noise is not None

    def grow(self, logits: torch.Tensor) -> Work | None:
        """Adds children to the frontier from its SSM logits (rows follow `self.frontier`).

        Returns the work that feeds the new nodes to the SSM, or None when the tree is done.
        """
        shape = self.shape
        k = shape.widths[self.level]
        min_logprob = math.log(shape.min_path_prob) if shape.min_path_prob > 0 else -math.inf
        self.level += 1
        tree = self.tree
        before = len(tree)
        # The level's most probable paths win the node budget (coupled: each child's rank among its
        # siblings stands for its chance, as its Gumbel-max order does).
        warped = logits.float() if self.params.is_greedy else warp_logits(logits, self.params)
        logp = torch.log_softmax(warped, dim=-1)
        order = logp
        if self.is_coupled:  # the children of this level sample the token at the root's position + level
            position = self.state.seq.num_committed - 1 + self.level
            order = perturbed(logp, self.noise, [position] * len(self.frontier))
        indices = torch.topk(order, min(k, logp.shape[-1]), dim=-1).indices
        values, indices = logp.gather(-1, indices).tolist(), indices.tolist()
        candidates = [
            (self.path_logprob[node] + (RANK_LOGPROB[min(j, len(RANK_LOGPROB) - 1)] if self.is_coupled
                                        else values[row][j]), node, indices[row][j])
            for row, node in enumerate(self.frontier)
            for j in range(len(values[row])) if values[row][j] > -math.inf
        ]
        candidates = [c for c in candidates if c[0] >= min_logprob]
        candidates.sort(key=lambda c: -c[0])
        for path_lp, node, token in candidates[: max(0, shape.max_nodes - len(tree))]:
            tree.add_draft(node, token)
            self.path_logprob.append(path_lp)
        new_nodes = list(range(before, len(tree)))
        # Most probable paths first, so the node cap spends its budget on them next level.
        new_nodes.sort(key=lambda n: -self.path_logprob[n])
        self.scratch_of.extend([-1] * (len(tree) - before))
        if not new_nodes or self.level >= len(shape.widths) or len(tree) >= shape.max_nodes:
            return None
        seq = self.state.seq
        root_position = seq.num_committed - 1
        for n in new_nodes:
            self.scratch_of[n] = len(self.scratch_parents)
            parent = tree.parents[n]
            self.scratch_parents.append(self.scratch_of[parent] if parent > 0 else -1)
        self.frontier = new_nodes
        return Work(
            seq,
            [tree.tokens[n] for n in new_nodes],
            [root_position + tree.depths[n] for n in new_nodes],
            list(self.scratch_parents),
            "all",
        )


RANK_LOGPROB = tuple(math.log(p) for p in (0.6, 0.15, 0.05, 0.02))  # a coupled child's chance by rank


class ModelFree(Protocol):
    """A pool member that drafts without a model (`lookup.PromptLookup`, `suffix.SuffixSpeculator`):
    deterministic children only."""

    name: str

    def start(self, context_ids: list[int]) -> Any: ...

    def extend(self, state: Any, tokens: list[int]) -> None: ...

    def propose(self, state: Any, max_depth: int, max_nodes: int) -> TokenTree: ...

    def scored(self, state: Any, max_depth: int, max_nodes: int) -> ScoredTree: ...  # each node's probability

    def release(self, state: Any) -> None: ...


def model_free_member(name: str, cache_tokens: int = SUFFIX_CACHE_TOKENS, answers=()) -> ModelFree:
    """The model-free pool member called `name` (one of `limits.MODEL_FREE_NAMES`); `suffix`
    shares the recent outputs of up to `cache_tokens` tokens across requests (0: none), and
    drafts from `answers` (token lists: the LLM's answers a draft was built from) too."""
    if name == "lookup":
        return PromptLookup()
    if name == "suffix":
        return SuffixSpeculator(SuffixCache(cache_tokens), seed=SuffixCache.of(answers))
    raise ValueError(f"no model-free speculator named {name!r} (have {', '.join(MODEL_FREE_NAMES)})")


@dataclass
class Proposal:
    """One request's ask: its pool states, the SSMs' shape, sampling, and the depth bound of
    model-free drafts (the request's own bound; the SSMs' widths are already within it)."""

    states: list[Any]
    shape: TreeShape
    params: SamplingParams
    noise: SamplingNoise | None  # a sampled request's: coupled drafts (None: greedy, or uncoupled)
    max_depth: int = MODEL_FREE_MAX_DEPTH
    is_model_free_only: bool = False  # the SSMs sit this step out
    max_nodes: int | None = None  # the merged tree's bound (one speculator's share of the request's KV)
    budget: TreeBudget | None = None  # a dynamic tree within this budget (`shape`'s widths are then unused)


class Built(NamedTuple):
    """One request's tree for one step, and what feedback needs of it: each SSM's own tree (its
    scratch cache rows), what a dynamic tree was built from, and the SSM levels it took."""

    tree: TokenTree
    ssm_trees: list[SSMTree | None]
    dynamic: BuiltTree | None = None
    num_levels: int = 0


@dataclass
class DraftSession:
    """One request's drafting state in a pool: its members' states (SSM caches, model-free
    contexts), sampling, shape and random stream, and the tree it was handed last with what
    feedback needs of it. The one per-request type of every pool host, all of which hold and build
    them through one `drafter.Drafter`: the in-process engine and a co-located verifier
    (`llm_engine.LocalSpeculation`), and the speculator service (`workers.SpeculatorWorker`)."""

    states: list[Any]
    params: SamplingParams
    shape: TreeShape
    noise: SamplingNoise | None  # a sampled request's (its drafts coupled with the LLM's sample)
    last: Built | None = None  # the tree handed out last
    last_proposal: Proposal | None = None  # what it was asked as
    last_batch_size: int = 0  # requests whose trees were built together with this one's last
    ahead: Any = None  # the next tree, drafted while the last one is verified (`pipeline.Ahead`)
    is_last_ahead: bool = False  # the tree handed out last had been drafted ahead

    def proposal(self, shape: TreeShape, max_depth: int, is_model_free_only: bool = False,
                 max_nodes: int | None = None, budget: TreeBudget | None = None) -> Proposal:
        return Proposal(self.states, shape, self.params, self.noise, max_depth, is_model_free_only, max_nodes, budget)


class Speculator:
    """Hosts a pool: SSMs (`runners`) and model-free members (`model_free`), and builds each
    request's tree, merged by path across the members it uses. A request's states are indexed
    by member: the SSMs first, then the model-free members."""

    def __init__(self, runners: list[ModelRunner], model_free: list[ModelFree] | None = None):
        self.runners = runners
        self.model_free = list(model_free or [])
        # Dynamic trees learn how often each drafter's candidates are accepted, and what each SSM's
        # drafts alone bring, greedy and sampled apart.
        self.calibration = {True: Calibration(), False: Calibration()}
        self.member_gain = {True: MemberGain(), False: MemberGain()}

    @property
    def num_members(self) -> int:
        return len(self.runners) + len(self.model_free)

    def start(self, prompt_ids: list[int], ssm_indices: list[int] | None = None) -> list[Any]:
        """New per-member states (None for members the request does not use); the prompt is fed
        to the SSMs lazily, with the first speculation."""
        use = set(range(self.num_members) if ssm_indices is None else ssm_indices)
        states: list[Any] = [SSMState(r.new_sequence(), list(prompt_ids)) if m in use else None
                             for m, r in enumerate(self.runners)]
        base = len(self.runners)
        return states + [d.start(list(prompt_ids)) if base + i in use else None for i, d in enumerate(self.model_free)]

    def open(self, prompt_ids: list[int], params: SamplingParams, shape: TreeShape,
             ssm_indices: list[int] | None = None) -> DraftSession:
        """A request's drafting state (see `start`), with a sampled request's noise: the verifier's
        own when the request names its seed (the verifier always does), else one of its own."""
        noise = None
        if not params.is_greedy and self.runners:
            runner = self.runners[0]
            noise = SamplingNoise(params.seed if params.seed is not None else fresh_seed(), runner.cfg.vocab_size,
                                  runner.model.device)
        return DraftSession(self.start(prompt_ids, ssm_indices), params, shape, noise)

    def release(self, states: list[Any]) -> None:
        for m, s in enumerate(states):
            if s is None:
                continue
            if m < len(self.runners):
                s.seq.free()
            else:
                self.model_free[m - len(self.runners)].release(s)

    def has_ssm(self, states: list[Any]) -> bool:
        return any(s is not None for s in states[: len(self.runners)])

    def root(self, states: list[Any]) -> int:
        """The last verified token (the root of the request's next tree)."""
        for m, s in enumerate(states):
            if s is not None:
                return s.pending[-1] if m < len(self.runners) else s.tokens[-1]
        raise ValueError("request uses no pool member")

    def root_position(self, states: list[Any]) -> int:
        """The root's position in the request: its verified tokens but one."""
        for m, s in enumerate(states):
            if s is not None:
                return (s.seq.num_committed + len(s.pending) if m < len(self.runners) else len(s.tokens)) - 1
        raise ValueError("request uses no pool member")

    def propose(self, batch: list[Proposal | tuple]) -> list[Built]:
        """Builds each request's merged tree. One SSM forward per level covers the whole batch;
        model-free members add their drafts after the SSMs' at every node (verification keeps the
        LLM's own tokens, so any tree stays exact).
        Proposals with a budget get dynamic trees (`engine.dynamic`), the others static ones."""
        batch = [b if isinstance(b, Proposal) else Proposal(*b) for b in batch]
        out: list[Built | None] = [None] * len(batch)
        static = [i for i, p in enumerate(batch) if p.budget is None]
        for i, ssm_trees in zip(static, self.expand([batch[i] for i in static])):
            out[i] = Built(self.merge(batch[i], ssm_trees), ssm_trees, None, len(batch[i].shape.widths))
        dynamic = [i for i, p in enumerate(batch) if p.budget is not None]
        for i, built in zip(dynamic, self.expand_dynamic([batch[i] for i in dynamic])):
            out[i] = built
        return out

    def expand(self, batch: list[Proposal]) -> list[list[SSMTree | None]]:
        """Each request's tree in each SSM it uses (None elsewhere), one forward per level per SSM."""
        per_item: list[list[SSMTree | None]] = [[None] * len(self.runners) for _ in batch]
        for m, runner in enumerate(self.runners):
            users = [b for b, p in enumerate(batch) if p.states[m] is not None and not p.is_model_free_only
                     and p.shape.widths]
            if not users:
                continue
            expansions = [
                _Expansion(batch[b].states[m], batch[b].shape.for_ssm(m == _first_used(batch[b].states)),
                           batch[b].params, batch[b].noise)
                for b in users
            ]
            for b, built in zip(users, self._expand(runner, expansions)):
                per_item[b][m] = built
        return per_item

    def merge(self, p: Proposal, ssm_trees: list[SSMTree | None]) -> TokenTree:
        """The request's tree: its SSMs' trees merged by path, then its model-free members' drafts."""
        trees = [t.tree for t in ssm_trees if t is not None]
        merged = trees[0] if len(trees) == 1 else (merge_trees(trees)[0] if trees else None)
        depth = min(p.max_depth, MODEL_FREE_MAX_DEPTH)
        base = len(self.runners)
        free = [(d, p.states[base + i]) for i, d in enumerate(self.model_free) if p.states[base + i] is not None]
        if depth > 0 and free:
            # A copy: the SSMs' own trees stay as built (feedback maps them to their caches).
            merged = merge_trees([merged])[0] if merged is not None else TokenTree.with_root(self.root(p.states))
            cap = min(p.shape.max_nodes, MODEL_FREE_MAX_NODES)
            bound = p.max_nodes if p.max_nodes is not None else len(merged) + cap * len(free)
            for d, state in free:
                graft(merged, d.propose(state, depth, cap), bound)
        return merged if merged is not None else TokenTree.with_root(self.root(p.states))

    def expand_dynamic(self, batch: list[Proposal]) -> list[Built]:
        """Dynamic trees for the batch: model-free candidates first, then every SSM a request runs
        expands its most valuable nodes, one forward per SSM per level for the whole batch."""
        builds = [self._dynamic_build(p) for p in batch]
        rows: dict[int, dict[int, torch.Tensor]] = {i: {} for i in range(len(builds))}
        for m, runner in enumerate(self.runners):  # catch-up on the verified tokens: logits at the root
            users = [i for i, b in enumerate(builds) if m in b.ssm_seqs]
            if not users:
                continue
            states = [builds[i].ssm_seqs[m] for i in users]
            for i, state, out in zip(users, states, runner.run([chain_work(s.seq, s.pending, "last") for s in states])):
                state.seq.num_committed += len(state.pending)
                state.pending = []
                rows[i][m] = out
        active = [i for i, b in enumerate(builds) if b.is_expanding]
        while active:
            for i in active:
                builds[i].grow(rows[i])
            active = [i for i in active if builds[i].is_expanding]
            rows = {i: {} for i in active}
            for m, runner in enumerate(self.runners):
                users = [i for i in active if m in builds[i].ssm_seqs]
                works = []
                for i in users:
                    tokens, depths, parents = builds[i].feed(m)
                    seq = builds[i].ssm_seqs[m].seq
                    works.append(Work(seq, tokens, [seq.num_committed - 1 + d for d in depths], parents, "all"))
                for i, out in zip(users, runner.run(works) if works else []):
                    rows[i][m] = out
        out = []
        for build in builds:
            tree, record = build.finish()
            ssm_trees = [SSMTree(build.cands.tree, build.fed[m].scratch_of) if m in build.fed else None
                         for m in range(len(self.runners))]
            out.append(Built(tree, ssm_trees, record, build.num_levels))
        return out

    def _dynamic_build(self, p: Proposal) -> DynamicBuild:
        base = len(self.runners)
        budget = p.budget.clipped(p.max_depth)
        if p.max_nodes is not None:  # one speculator's share of the request's KV reservation
            budget = replace(budget, max_nodes=min(budget.max_nodes, p.max_nodes - 1))
        scored = []
        if budget.max_depth > 0:
            depth, cap = min(budget.max_depth, MODEL_FREE_MAX_DEPTH), min(budget.max_nodes + 1, MODEL_FREE_MAX_NODES)
            scored = [(d.name, d.scored(p.states[base + i], depth, cap)) for i, d in enumerate(self.model_free)
                      if p.states[base + i] is not None]
        ssm_seqs = {} if p.is_model_free_only else {m: s for m, s in enumerate(p.states[:base]) if s is not None}
        is_greedy = p.params.is_greedy
        return DynamicBuild(self.root(p.states), self.root_position(p.states), budget, p.params, p.noise,
                            self.calibration[is_greedy], self.member_gain[is_greedy], scored, ssm_seqs,
                            p.shape.is_sampled)

    @staticmethod
    def _expand(runner: ModelRunner, expansions: list[_Expansion]) -> list[SSMTree]:
        # Catch-up: feed every request's pending verified tokens; logits at the root.
        works = [chain_work(e.state.seq, e.state.pending, "last") for e in expansions]
        logits = runner.run(works)
        for e in expansions:
            e.state.seq.num_committed += len(e.state.pending)
            e.state.pending = []
        active = list(range(len(expansions)))
        while active:
            next_active, works = [], []
            for i, rows in zip(active, logits):
                work = expansions[i].grow(rows) if expansions[i].shape.widths[expansions[i].level :] else None
                if work is not None:
                    next_active.append(i)
                    works.append(work)
            active = next_active
            logits = runner.run(works) if works else []
        return [SSMTree(e.tree, e.scratch_of) for e in expansions]

    def feedback(self, states: list[SSMState | None], built: Built | None, accepted: list[int], bonus: int) -> None:
        """Commits what each SSM already computed on the accepted path of the step's tree
        (`built`); queues the rest; and, for a dynamic tree, calibrates its drafters on the outcome.

        Without a tree (the step was not speculated) every accepted token is simply queued.
        """
        ssm_trees = built.ssm_trees if built is not None else None
        self.learn(built, accepted, bonus)
        for m, state in enumerate(states):
            if state is None:
                continue
            if m >= len(self.runners):
                self.model_free[m - len(self.runners)].extend(state, accepted + [bonus])
                continue
            self.commit_path(m, state, ssm_trees[m] if ssm_trees else None, accepted)
            state.pending.append(bonus)

    def learn(self, built: Built | None, accepted: list[int], bonus: int) -> None:
        """Calibrates a dynamic tree's drafters on its outcome alone (a request's last step: its
        caches are freed, not updated). Without it only the steps that did not end a request
        would be learnt from: the short ones."""
        if built is not None and built.dynamic is not None:
            is_greedy = built.dynamic.is_greedy
            learn(self.calibration[is_greedy], built.dynamic, accepted, bonus, self.member_gain[is_greedy])

    def commit_path(self, m: int, state: SSMState, st: SSMTree | None, accepted: list[int]) -> None:
        """SSM `m` commits what it computed of `accepted` in its last tree `st`; the rest is queued."""
        if st is None:
            state.pending.extend(accepted)
            return
        fed = []
        for node in st.tree.find_path(accepted)[1:]:
            if st.scratch_of[node] < 0:
                break
            fed.append(st.scratch_of[node])
        self.runners[m].commit(state.seq, fed)
        state.pending = accepted[len(fed) :]


def _first_used(states: list[Any]) -> int:
    """The request's first SSM in pool order: the one that expands the full tree under "mixed"."""
    return next(m for m, s in enumerate(states) if s is not None)
