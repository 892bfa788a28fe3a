"""The engine: the LLM, its scheduler and a source of token trees (SpecInfer Section 2, Figure 2).

One `Engine` serves both paths. In process (`Engine.from_runners`: `specinfer generate`,
`specinfer bench`) the scheduler runs inline on the caller's thread and trees come from local
SSMs, every request's tree of a step from one batched SSM pass per level (`LocalSpeculation`,
whose `drafting.drafter.Drafter` is the speculator service's too).
In the verifier service the scheduler runs on the model's thread, trees stream from speculator
services, and each request steps on its own RPC thread. Either way a step is
`specinfer.engine.loop.run_step`. Incremental decoding is the same loop with root-only trees:
the baseline for every speedup, and the fallback when no SSM is available.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Protocol

from specinfer import limits
from specinfer.engine.scheduling.guard import SpeculationGuard
from specinfer.engine.loop import (
    Drafts, DraftTree, Generation, GenerationResult, NoDrafts, StepObserver, WidthChoice, reserved_slots, run_step,
)
from specinfer.engine.runtime.calibration import calibrated_cost_model
from specinfer.engine.scheduling.policy import CostModel, LoadAwarePolicy
from specinfer.engine.verification.processors import RequestLogits
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.verification.sampling import SamplingNoise, fresh_seed
from specinfer.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from specinfer.engine.drafting.drafter import Ask, Drafter, Outcome
from specinfer.engine.drafting.speculator import Built, DraftSession, Proposal, Speculator
from specinfer.engine.drafting.tree import TokenTree
from specinfer.engine.verification.verifier import Verifier
from specinfer.errors import UserError
from specinfer.params import GenerationParams, SampleProgress, SamplingParams, TreeBudget, TreeShape, sample_params


@dataclass(frozen=True)
class EngineConfig:
    # Requests that name no widths get dynamic trees priced per step by the load-aware policy (or
    # none where speculation does not pay), of at most `max_tree_nodes` nodes beyond the root and
    # `max_tree_depth` levels; not load-aware, they get `default_shape` (the paper's static expansion).
    default_shape: TreeShape = TreeShape(limits.PAPER_TREE_WIDTH)
    is_load_aware: bool = True
    max_tree_nodes: int = limits.DYNAMIC_MAX_NODES
    max_tree_depth: int = limits.DYNAMIC_MAX_DEPTH
    # A measured guard keeps load-aware speculation from running slower than plain decoding: the
    # services have one (a long life amortises its phases of plain decoding); in process it costs
    # more than it saves (BENCHMARKS.md, "The measured guard in process, tried").
    is_guarded: bool = False
    # Inline, nothing else can free memory, so a request that does not fit fails at once.
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(admission_timeout_s=0.0))


class DraftSource(Protocol):
    """Where requests' token trees come from: local SSMs, or the verifier service's speculators."""

    def num_sources(self, ssm_names: tuple[str, ...]) -> int: ...  # trees merged per step (0 = none)

    # Nodes beyond the root that one step's merged tree may hold (the request's KV reservation):
    # static trees of `shape`, or dynamic trees of at most `max_dynamic_nodes` per source.
    def max_draft_nodes(self, ssm_names: tuple[str, ...], shape: TreeShape, max_dynamic_nodes: int | None = None
                        ) -> int: ...

    def drafts(self, request_id: str, prompt_ids: list[int], params: GenerationParams, shape: TreeShape,
               timeout_s: float | None) -> Drafts: ...


class LocalSpeculation:
    """Trees from a pool in this process: SSMs and model-free members (prompt lookup, suffix
    speculation). The trees all requests asked for in a step are built together: one batched SSM
    pass per tree level covers every request (Section 5). Thread-safe, so the verifier service
    can host its pool co-located: whichever request thread needs a tree first builds every tree
    asked so far. Its `Drafter` does not draft ahead: here the SSMs run on the LLM's thread and
    cores, so a tree drafted during verification would only delay the pass."""

    def __init__(self, speculator: Speculator, names: list[str] | None = None):
        self.drafter = Drafter(speculator)
        self.speculator = speculator
        # `names` names the SSMs (then the model-free members go by their own names) or every member.
        names = list(names or [f"ssm-{i}" for i in range(len(speculator.runners))])
        if len(names) == len(speculator.runners):
            names += [m.name for m in speculator.model_free]
        self.names = names
        if len(self.names) != speculator.num_members:
            raise ValueError(f"{len(self.names)} names for {speculator.num_members} pool members")
        self._asked: list[LocalDrafts] = []
        self.lock = threading.RLock()
        # Where trees are built: on the calling thread, or (in the verifier) on the model's thread.
        self.run_drafting: Callable[[Callable[[], None]], None] = lambda build: build()

    def pool(self, ssm_names: tuple[str, ...]) -> list[int]:
        """Indices of the members a request speculates with (all of them when it names none)."""
        if not ssm_names:
            return list(range(len(self.names)))
        unknown = [n for n in ssm_names if n not in self.names]
        if unknown:
            raise UserError(f"ssm_names: no SSM named {', '.join(unknown)} (have {', '.join(self.names)})")
        return [i for i, name in enumerate(self.names) if name in ssm_names]

    def num_sources(self, ssm_names: tuple[str, ...]) -> int:
        return len(self.pool(ssm_names))

    def max_draft_nodes(self, ssm_names: tuple[str, ...], shape: TreeShape, max_dynamic_nodes: int | None = None
                        ) -> int:
        """Each SSM's tree holds at most `shape.max_nodes` nodes, root included; each model-free
        member adds at most `min(shape.max_nodes, MODEL_FREE_MAX_NODES)` (`Speculator.merge`). A
        dynamic tree is one tree of the whole pool, within its budget."""
        static = self._max_static_nodes(ssm_names, shape)
        return static if max_dynamic_nodes is None else max(static, max_dynamic_nodes)

    def _max_static_nodes(self, ssm_names: tuple[str, ...], shape: TreeShape) -> int:
        pool = self.pool(ssm_names)
        num_ssms = sum(1 for m in pool if m < len(self.speculator.runners))
        free_nodes = min(shape.max_nodes, limits.MODEL_FREE_MAX_NODES)
        return num_ssms * (shape.max_nodes - 1) + (len(pool) - num_ssms) * free_nodes

    def all_names(self) -> list[str]:
        return list(self.names)

    def drafts(self, request_id: str, prompt_ids: list[int], params: GenerationParams, shape: TreeShape,
               timeout_s: float | None) -> "LocalDrafts":
        return LocalDrafts(self, self.drafter.open(prompt_ids, params.sampling, shape, self.pool(params.ssm_names)))

    def build_asked(self) -> None:
        """Builds every tree asked so far, in one batch; each request reads its verified steps first."""
        with self.lock:
            asked, self._asked = self._asked, []
            asks = [Ask(d.session, d.asked, d.take_outcomes()) for d in asked]
            for drafts, built in zip(asked, self.drafter.build(asks)):
                drafts.built = built


class LocalDrafts:
    """One request's trees from the local pool (its `DraftSession`: KV caches in every SSM it uses)."""

    is_usable = True

    def __init__(self, local: LocalSpeculation, session: DraftSession):
        self.local = local
        self.session = session
        self.asked: Proposal | None = None
        self.built: tuple[Built, float] | None = None
        self._outcomes: list[Outcome] = []  # verified steps the pool has not read yet
        self.is_steady = False
        self._has_built_ssm_tree = False  # the tree built last came from the SSMs (not the model-free alone)
        self._has_ever_built_ssm_tree = False  # the SSMs have read the prompt
        self._num_plain_steps = 0

    def ask(self, widths: tuple[int, ...], max_depth: int | None = None, budget: TreeBudget | None = None) -> None:
        """Asks for a tree of `widths` (the SSMs') whose model-free drafts go `max_depth` deep
        (default: as deep as the widths), or for a dynamic tree within `budget`."""
        if budget is None and not widths:
            return
        max_depth = len(widths) if max_depth is None else max_depth
        session = self.session
        self.asked = session.proposal(replace(session.shape, widths=widths), max_depth, budget=budget)
        # Steady: the SSMs only catch up on the last step's tokens (not the prompt, not a plain run,
        # not a step they sat out). A dynamic tree knows once it is built.
        self.is_steady = budget is None and self._has_built_ssm_tree and self._num_plain_steps == 0
        with self.local.lock:
            self.local._asked.append(self)

    def tree(self, root: int) -> DraftTree:
        if self.asked is None:
            self._num_plain_steps += 1
            return DraftTree(TokenTree.with_root(root), [], 0, 0.0, False)
        if self.built is None:
            self.local.run_drafting(self.local.build_asked)
        (built, seconds), is_dynamic = self.built, self.asked.budget is not None
        if is_dynamic:  # its SSMs' first pass reads what they have not seen yet: one pass, whatever its
            # length on the tokens of the steps they sat out; but not the prompt (their first tree)
            self.is_steady = not built.num_levels or self._has_ever_built_ssm_tree
            self._has_ever_built_ssm_tree = self._has_ever_built_ssm_tree or bool(built.num_levels)
        self._has_built_ssm_tree = bool(built.num_levels)
        self.asked, self.built, self._num_plain_steps = None, None, 0
        return DraftTree(built.tree, [], built.num_levels, seconds)

    def after_step(self, verified: list[int]) -> None:
        """Records a verified step; the SSMs read it when the next tree is built (on the thread
        that builds trees, as their cache updates are model work)."""
        self._outcomes.append((self.session.last, verified[:-1], verified[-1]))
        self.session.last = None

    def take_outcomes(self) -> list[Outcome]:
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def close(self) -> None:
        with self.local.lock:
            self.local.drafter.close(self.session, self.take_outcomes())


class Engine:
    """The LLM, its scheduler and a source of drafts. In process (`from_runners`) the scheduler
    runs inline and trees come from local SSMs; the verifier service runs the scheduler on its
    own thread, trees come from speculator services, and each request steps on its RPC thread."""

    def __init__(self, llm: ModelRunner, source: DraftSource | None, cfg: EngineConfig = EngineConfig(),
                 scheduler: Scheduler | None = None, max_context: int | None = None, grammars=None):
        self.cfg = cfg
        self.grammars = grammars  # a `grammar.GrammarCompiler` for the LLM's tokenizer; None: no structured output
        self.verifier = Verifier(llm)
        self.source = source
        self.scheduler = scheduler or Scheduler(self.verifier, cfg.scheduler, is_threaded=False, is_inline=True)
        self.max_context = max_context or llm.max_context
        self.load_policy: LoadAwarePolicy | None = None  # built on first load-aware use
        self.cost_model: CostModel | None = None
        self.guard = SpeculationGuard() if cfg.is_guarded else None
        if isinstance(source, LocalSpeculation):  # a co-located pool drafts on the LLM's thread
            source.run_drafting = self.scheduler.run_drafting

    @classmethod
    def from_runners(cls, llm: ModelRunner, ssms: list[ModelRunner] | None = None, cfg: EngineConfig = EngineConfig(),
                     ssm_names: list[str] | None = None, model_free: list | None = None, grammars=None) -> "Engine":
        """LLM and its pool in one process: SSMs, and model-free members (`speculator.model_free_member`)."""
        ssms, model_free = list(ssms or []), list(model_free or [])
        for ssm in ssms:
            if ssm.cfg.vocab_size != llm.cfg.vocab_size:
                raise UserError(f"SSM vocabulary ({ssm.cfg.vocab_size}) differs from the LLM's ({llm.cfg.vocab_size})")
        source = LocalSpeculation(Speculator(ssms, model_free), ssm_names) if ssms or model_free else None
        return cls(llm, source, cfg, max_context=min([llm.max_context] + [r.max_context for r in ssms]),
                   grammars=grammars)

    def start(self, prompt_ids: list[int], params: GenerationParams, request_id: str = "",
              session_id: str | None = None, timeout_s: float | None = None,
              observer: StepObserver | None = None, prefix_group: str | None = None) -> Generation:
        """Admits one request (its worst-case KV reserved) and returns its decode loop. Requests
        of one `prefix_group` (the samples of an n > 1 request) share their common prompt's KV."""
        llm_cfg = self.verifier.runner.cfg
        if not params.sampling.is_greedy and params.sampling.seed is None:  # the noise needs a seed; drafts share it
            params = replace(params, sampling=replace(params.sampling, seed=fresh_seed()))
        limits.check_prompt_ids(prompt_ids, params.max_new_tokens, llm_cfg.vocab_size, self.max_context)
        limits.check_stop_token_ids(params.stop_token_ids, llm_cfg.vocab_size)
        processors = self._processors(prompt_ids, params)
        stops = params.stop_tokens(llm_cfg.eos_token_ids)
        if params.constraint is not None:  # where the grammar is complete, the request ends
            stops |= frozenset(llm_cfg.eos_token_ids)
        num_sources = self.source.num_sources(params.ssm_names) if self.source and params.is_speculative else 0
        shape = self.cfg.default_shape if params.shape.is_default else params.shape
        is_load_aware = bool(num_sources) and params.shape.is_default and self.cfg.is_load_aware
        # Under a guard, a load-aware request may also decode plainly, or get the static default.
        dynamic_nodes = self.cfg.max_tree_nodes if is_load_aware else None
        num_draft_nodes = self.source.max_draft_nodes(params.ssm_names, shape, dynamic_nodes) if num_sources else 0
        if processors is not None and processors.grammar is not None and params.is_speculative:
            num_draft_nodes += processors.max_forced_tokens  # forced tokens join every tree
        num_slots = reserved_slots(len(prompt_ids), params.max_new_tokens, num_draft_nodes)
        session = self.scheduler.open(list(prompt_ids), session_id, num_slots, timeout_s, prefix_group)
        session.state.num_logprobs = params.num_logprobs
        session.state.processors = processors
        try:
            drafts = (self.source.drafts(request_id, prompt_ids, params, shape, timeout_s) if num_sources
                      else NoDrafts())
        except BaseException:
            self.scheduler.close(session)
            raise
        choose = WidthChoice(shape.widths, self.policy() if is_load_aware else None, self.guard,
                             params.sampling.is_greedy, tuple(sorted(params.ssm_names)))
        noise = None if params.sampling.is_greedy else SamplingNoise(params.sampling.seed, llm_cfg.vocab_size,
                                                                      self.verifier.runner.model.device)
        return Generation(prompt_ids, params, stops, drafts, choose, self.max_context, session, noise, observer)

    def start_samples(self, prompt_ids: list[int], params: GenerationParams, request_id: str = "",
                      timeout_s: float | None = None, observer: StepObserver | None = None,
                      progress: tuple[SampleProgress, ...] = ()) -> list[tuple[int, Generation]]:
        """The `params.num_samples` samples of one prompt (SpecInfer's serving of n > 1), each
        `(index, its decode loop)`. Sample i is the request `start` makes of it alone, seeded with
        `sample_seed(seed, i)` (`params.sample_params`; a sampled request without a seed gets one
        first); the samples form one prefix group of their own, so the first reads the prompt and
        the others adopt its blocks. `progress` continues a request part way: only the samples it
        lists, each from the tokens it has (they follow the prompt as its earlier output)."""
        if not params.sampling.is_greedy and params.sampling.seed is None:
            params = replace(params, sampling=replace(params.sampling, seed=fresh_seed()))
        num = params.num_samples
        progress = progress or tuple(SampleProgress(i) for i in range(num))
        indices = [p.index for p in progress]
        if len(set(indices)) != len(indices) or not all(0 <= i < num for i in indices):
            raise UserError(f"samples: each index once, each < num_samples={num}, got {indices}")
        for p in progress:
            if len(p.token_ids) >= params.max_new_tokens:
                raise UserError(f"samples: sample {p.index} has {len(p.token_ids)} tokens, "
                                f"not fewer than max_new_tokens={params.max_new_tokens}")
        group = f"samples:{uuid.uuid4().hex}"  # its own: no other call's cached blocks, whatever their key
        started: list[tuple[int, Generation]] = []
        try:
            for p in progress:
                own = sample_params(params, p.index)
                own = replace(own, max_new_tokens=own.max_new_tokens - len(p.token_ids),
                              num_resumed_tokens=own.num_resumed_tokens + len(p.token_ids))
                started.append((p.index, self.start(list(prompt_ids) + list(p.token_ids), own, request_id, None,
                                                    timeout_s, observer, group)))
        except BaseException:
            for _, generation in started:
                self.finish(generation)
            raise
        return started

    def _processors(self, prompt_ids: list[int], params: GenerationParams) -> RequestLogits | None:
        """The request's logits processors and grammar state; None where it has neither."""
        sampling, llm_cfg = params.sampling, self.verifier.runner.cfg
        if params.num_resumed_tokens > len(prompt_ids):
            raise UserError(f"num_resumed_tokens: {params.num_resumed_tokens} exceeds the prompt ({len(prompt_ids)})")
        grammar = None
        if params.constraint is not None:
            if not llm_cfg.eos_token_ids:
                raise UserError(f"{params.constraint.kind}: the model has no end-of-sequence token to end on")
            if self.grammars is None:
                raise UserError(f"{params.constraint.kind}: structured output needs the model's tokenizer, "
                                "which this server has not loaded")
            grammar = self.grammars.new_state(params.constraint)
        if grammar is None and not sampling.has_penalties and not sampling.logit_bias:
            return None
        return RequestLogits(sampling, list(prompt_ids), params.num_resumed_tokens, llm_cfg.vocab_size, grammar)

    def step(self, generations: list[Generation], should_stop: Callable[[], None] | None = None) -> list[list[int]]:
        """One speculate + verify iteration for every unfinished request; the tokens each kept.
        While waiting for a scheduler that runs elsewhere, `should_stop()` may raise to abandon
        the wait."""
        def verify(items: list[tuple[Generation, TokenTree]]) -> list[tuple[list[int], int]]:
            futures = [self.scheduler.verify(g.session, tree, g.params.sampling, g.noise)
                       for g, tree in items]
            if self.scheduler.worker.is_inline:
                self.scheduler.pump(futures)
            return [wait_result(f, should_stop) for f in futures]

        return run_step(generations, verify, lambda: self.scheduler.num_open)

    def finish(self, generation: Generation) -> None:
        """Frees the request's KV caches; the LLM's full committed blocks stay in its prefix cache
        for later requests (a session's next turn among them). Idempotent."""
        if generation.session is None:
            return
        session, generation.session = generation.session, None
        generation.is_done = True
        try:
            generation.drafts.close()
        finally:
            self.scheduler.close(session)

    def generate_batch(self, generations: list[Generation]) -> list[GenerationResult]:
        try:
            while any(not g.is_done for g in generations):
                self.step(generations)
                for g in generations:
                    if g.is_done:
                        self.finish(g)  # its KV is free for the others at once
        finally:
            for g in generations:
                self.finish(g)
        return [g.result for g in generations]

    def generate(self, prompt_ids: list[int], params: GenerationParams) -> GenerationResult:
        return self.generate_batch([self.start(prompt_ids, params)])[0]

    def calibrate(self, cache_dir: Path | None = None, report: Callable[[str], None] | None = None) -> CostModel:
        """The load-aware policy's cost model of the LLM, now rather than on the first request: read
        from `cache_dir` where this machine calibrated this model before, else timed (told to
        `report`, default logged); then refined by every measured pass of the scheduler."""
        if self.cost_model is None:
            self.cost_model = calibrated_cost_model(self.verifier.runner, cache_dir, report)
            self.scheduler.cost_model = self.cost_model
        return self.cost_model

    def policy(self) -> LoadAwarePolicy:
        """The load-aware policy (its cost model calibrated once: `calibrate`)."""
        if self.load_policy is None:
            names = self.source.all_names() if self.source is not None else []
            self.load_policy = LoadAwarePolicy(self.calibrate(), self.cfg.max_tree_nodes, self.cfg.max_tree_depth,
                                               free_members=tuple(n for n in names if n in limits.MODEL_FREE_NAMES))
        return self.load_policy


POLL_S = 0.05


def wait_result(future: Future, should_stop: Callable[[], None] | None):
    """The future's result; polls `should_stop` (which raises to give up) while waiting."""
    while True:
        try:
            return future.result(timeout=None if should_stop is None else POLL_S)
        except FutureTimeout:
            should_stop()


MODES = ("incremental", "sequence", "tree", "auto")


def mode_params(mode: str, max_new_tokens: int, shape: TreeShape = TreeShape(limits.PAPER_TREE_WIDTH),
                sampling: SamplingParams = SamplingParams(), **extra) -> GenerationParams:
    """The command line's modes as request parameters: `incremental` (no trees), `sequence` (a
    chain as deep as `shape`), `tree` (`shape`'s static expansion) and `auto` (dynamic trees
    priced per step by the load-aware policy; the engine's `default_shape` gives their sampling
    settings)."""
    if mode not in MODES:
        raise UserError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "sequence":
        shape = replace(shape, widths=(1,) * len(shape.widths))
    return GenerationParams(max_new_tokens=max_new_tokens, sampling=sampling,
                            shape=TreeShape() if mode == "auto" else shape,
                            is_speculative=mode != "incremental", **extra)
