"""One request's decode loop (SpecInfer Figure 2), shared by the in-process engine and the verifier service.

Every step of every request goes through `run_step`, the one place where

    speculate -> verify -> observe -> record -> choose the next shape

happens: take the token tree the drafts built for this step (a root-only tree when none was
asked: plain decoding), verify it in the LLM (the caller's `verify`, the scheduler's batched pass
in both the engine and the service), let the load-aware policy and the guard observe the step,
record the accepted tokens and the bonus token (cut at a stop token or the budget), feed them back
to the drafts, and ask for the next tree: of fixed widths (SpecInfer's static expansion), or a
dynamic tree within the load-aware policy's budget for this step (`engine.dynamic`), or none.

Where trees come from is a `Drafts`: local SSMs (`specinfer.engine.llm_engine.LocalDrafts`, one
batched SSM pass per level for all requests), remote speculators (the verifier service's
streams), or `NoDrafts`. Plain Python; no protobuf.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

from specinfer.engine.scheduling.guard import SpeculationGuard
from specinfer.engine.scheduling.policy import LoadAwarePolicy
from specinfer.engine.drafting.tree import TokenTree
from specinfer.params import GenerationParams, TreeBudget
from specinfer.stats import GenerationStats


class DraftTree(NamedTuple):
    tree: TokenTree
    failed: list[str]  # sources that failed while building it (the request goes on without them)
    depth: int  # SSM levels it took; 0 = none (model-free drafts alone, or none asked)
    seconds: float  # time spent building it
    is_asked: bool = True  # a tree was asked for (False: a plain step)
    # Live sources whose tree was not in time for this step: it went on without them, and they are
    # asked again (no failure: the request does not count as fallen back). Its drafts and its time
    # say nothing of what speculation costs or yields.
    late: tuple[str, ...] = ()


class Drafts(Protocol):
    """One request's source of token trees."""

    is_usable: bool  # False once it can never speculate again (no SSMs, every speculator lost)
    is_steady: bool  # the tree asked last costs what a steady step costs (no stream opening, no catch-up)

    # Requests the next tree: the SSMs expand `widths`, model-free members draft up to `max_depth`
    # levels (default: as deep as the widths); or, with a `budget`, a dynamic tree `max_depth` deep
    # at most. () without a budget asks nothing.
    def ask(self, widths: tuple[int, ...], max_depth: int | None = None, budget: TreeBudget | None = None
            ) -> None: ...

    def tree(self, root: int) -> DraftTree: ...  # the tree asked for (root-only if none was)

    def after_step(self, verified: list[int]) -> None: ...  # a step's accepted tokens plus the bonus

    def close(self) -> None: ...


class NoDrafts:
    """Incremental decoding: every tree is just the root."""

    is_usable = False
    is_steady = False

    def ask(self, widths: tuple[int, ...], max_depth: int | None = None, budget: TreeBudget | None = None
            ) -> None:
        pass

    def tree(self, root: int) -> DraftTree:
        return DraftTree(TokenTree.with_root(root), [], 0, 0.0, False)

    def after_step(self, verified: list[int]) -> None:
        pass

    def close(self) -> None:
        pass


class StepObserver(Protocol):
    """What a host (the verifier service's spans and metrics) sees of each step."""

    def speculated(self, step: int, draft: DraftTree, started: float, ended: float) -> None: ...

    def verified(self, step: int, tree: TokenTree, accepted: list[int], kept: list[int], batch_size: int,
                 started: float, ended: float) -> None: ...


Plan = tuple[int, ...] | TreeBudget  # a step's tree: fixed widths, a dynamic tree's budget, or () for none


class WidthChoice:
    """One request's tree per step: fixed widths, or the load-aware policy's budget as the guard
    allows. `ticket` is the guard's record of the latest guarded choice (None for fixed shapes)."""

    def __init__(self, fixed: tuple[int, ...], policy: LoadAwarePolicy | None = None,
                 guard: SpeculationGuard | None = None, is_greedy: bool = True, pool: tuple[str, ...] = ()):
        self.fixed, self.policy, self.guard, self.is_greedy = fixed, policy, guard, is_greedy
        self.pool = pool  # the pool members the request names (its own statistics at the policy)
        self.ticket = None

    def __call__(self, batch_size: int) -> Plan:
        if self.policy is None:
            return self.fixed
        choose = lambda: self.policy.choose(batch_size, self.is_greedy, self.pool)  # noqa: E731
        if self.guard is None:  # the policy unchecked
            return choose()
        plan, self.ticket = self.guard.plan(batch_size, choose, self.pool)
        return plan


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    num_llm_steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    tree_nodes_per_step: list[int] = field(default_factory=list)
    latency_s: float = 0.0
    finish_reason: str = "length"
    is_fell_back: bool = False  # a speculator failed and the request went on without it
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when asked for
    processing_s: float = 0.0  # time its logits processors and grammar took (`processors.RequestLogits`)

    @property
    def tokens_per_step(self) -> float:
        return len(self.output_ids) / self.num_llm_steps if self.num_llm_steps else 0.0

    def record_step(self, accepted: list[int], bonus: int, num_nodes: int, max_new_tokens: int,
                    stops: frozenset[int]) -> list[int]:
        """Appends one verified step's tokens (cut at a stop token or the budget); returns them."""
        self.num_llm_steps += 1
        self.accepted_per_step.append(len(accepted))
        self.tree_nodes_per_step.append(num_nodes)
        kept = []
        for t in (accepted + [bonus])[: max_new_tokens - len(self.output_ids)]:
            kept.append(t)
            if t in stops:
                self.finish_reason = "stop"
                break
        self.output_ids.extend(kept)
        return kept

    def is_finished(self, max_new_tokens: int) -> bool:
        return self.finish_reason == "stop" or len(self.output_ids) >= max_new_tokens

    def stats(self) -> GenerationStats:
        return GenerationStats.measured(len(self.prompt_ids), len(self.output_ids), self.accepted_per_step,
                                        self.tree_nodes_per_step, self.latency_s, self.is_fell_back)


def speculation_depth(remaining: int, context: int, max_context: int) -> int:
    """How deep a tree may go: the bonus token needs one of the remaining tokens and positions."""
    return max(0, min(remaining - 1, max_context - context - 1))


def reserved_slots(num_prompt: int, max_new_tokens: int, max_draft_nodes: int) -> int:
    """KV slots a request may ever need: its prompt, every new token, and the draft nodes (a
    tree's nodes beyond its root, the last verified token) of the largest tree its draft sources
    may merge in one step (`DraftSource.max_draft_nodes`)."""
    return num_prompt + max_new_tokens + 1 + max_draft_nodes


class Generation:
    """One request in flight: its drafts, its LLM-side session, its width choice and its result."""

    def __init__(self, prompt_ids: list[int], params: GenerationParams, stops: frozenset[int], drafts: Drafts,
                 choose: WidthChoice, max_context: int, session: Any, noise,
                 observer: StepObserver | None = None):
        self.params = params
        self.stops = stops
        self.drafts = drafts
        self.choose = choose
        self.max_context = max_context
        self.session = session  # the scheduler's handle on this request's LLM state
        self.noise = noise  # a sampled request's `sampling.SamplingNoise` (None: greedy)
        self.observer = observer
        self.result = GenerationResult(list(prompt_ids))
        self.is_done = False
        self._has_asked = False
        self._measured = None  # (guard ticket, tokens, start) of the previous step
        self._ticket = None  # the guard's ticket for this step's widths
        self._draft: DraftTree | None = None  # this step's
        self._is_constrained = False  # this step's tree is its drafts cut and extended by a grammar
        self._step_started = 0.0
        self._started = time.perf_counter()

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.result.output_ids)

    @property
    def root(self) -> int:
        return self.session.state.pending[-1]

    def _plan(self, batch_size: int) -> tuple[tuple[int, ...], int, TreeBudget | None]:
        """The next tree: widths clipped to the depth the request has left and that depth (the bound
        of model-free drafts; 0 for a plain step), or a dynamic tree's budget within that depth."""
        context = len(self.result.prompt_ids) + len(self.result.output_ids)
        depth = speculation_depth(self.remaining, context, self.max_context)
        if not self.drafts.is_usable or depth <= 0:
            return (), 0, None
        plan = self.choose(batch_size)
        if isinstance(plan, TreeBudget):
            budget = plan.clipped(depth)
            return (), budget.max_depth, budget
        widths = tuple(plan)
        return widths[:depth], depth if widths else 0, None

    def begin(self, batch_size: int) -> None:
        """Asks for the first tree (later trees are asked as each step is recorded)."""
        if not self._has_asked:
            self._has_asked = True
            self.drafts.ask(*self._plan(batch_size))

    def speculate(self) -> TokenTree:
        """Speculate: this step's tree. Also closes the guard's measurement of the previous step."""
        self._step_started = started = time.perf_counter()
        if self._measured is not None:
            ticket, num_tokens, since = self._measured
            self.choose.guard.observe(ticket, num_tokens, started - since)
        self._ticket, self.choose.ticket = self.choose.ticket, None
        draft = self.drafts.tree(self.root)
        self._draft = draft
        tree = draft.tree
        processors = self.session.state.processors
        if processors is not None and processors.grammar is not None:  # cut what it rejects, add what it forces
            context = len(self.result.prompt_ids) + len(self.result.output_ids)
            depth = speculation_depth(self.remaining, context, self.max_context) if self.params.is_speculative else 0
            tree = processors.constrain(tree, depth)
        self._is_constrained = tree is not draft.tree
        policy = self.choose.policy
        if policy is not None and draft.is_asked and self.drafts.is_steady:
            policy.observe_speculation(draft.depth, draft.seconds)
        if draft.failed:
            self.result.is_fell_back = True
        if self.observer is not None:
            self.observer.speculated(self.result.num_llm_steps, draft, started, time.perf_counter())
        return tree

    def record(self, tree: TokenTree, accepted: list[int], bonus: int, batch_size: int, verify_started: float
               ) -> list[int]:
        """Observe, record, feed back, and choose the next shape; returns the tokens kept."""
        step = self.result.num_llm_steps
        policy, is_greedy = self.choose.policy, self.params.sampling.is_greedy
        if policy is not None and self._draft.is_asked:
            # Not with a late source's drafts, nor with a grammar's: not what speculation yields.
            if not self._draft.late and not self._is_constrained:
                policy.observe_step(len(accepted), len(tree) - 1, self._draft.depth, batch_size, is_greedy,
                                    self.choose.pool)
        elif policy is not None and step and self.session.last_batch_size == 1:
            # A plain step alone in its pass (not the first: that one reads the prompt). In a batch,
            # a request's step may also wait for passes of other requests: not a step's own cost.
            policy.observe_plain_step(time.perf_counter() - self._step_started)
        kept = self.result.record_step(accepted, bonus, len(tree), self.params.max_new_tokens, self.stops)
        if self.params.num_logprobs is not None:
            self.result.output_logprobs.extend(self.session.state.last_logprobs[:len(kept)])
        # The first step's time includes the prompt's prefill: not a speculation step.
        self._measured = (self._ticket, len(accepted) + 1, self._step_started) if self._ticket and step else None
        if self.observer is not None:
            self.observer.verified(step, tree, accepted, kept, self.session.last_batch_size, verify_started,
                                   time.perf_counter())
        if self.result.is_finished(self.params.max_new_tokens):
            self.is_done = True
            self.result.latency_s = time.perf_counter() - self._started
            if self.session.state.processors is not None:
                self.result.processing_s = self.session.state.processors.seconds
        else:
            self.drafts.after_step(accepted + [bonus])
            self.drafts.ask(*self._plan(batch_size))
        return kept


Verify = Callable[[list[tuple[Generation, TokenTree]]], list[tuple[list[int], int]]]


def run_step(generations: list[Generation], verify: Verify, batch_size: Callable[[], int] | None = None
             ) -> list[list[int]]:
    """One decode step of every unfinished generation; returns the tokens each one kept.

    `batch_size()` is the load the width choice plans for (default: the generations here)."""
    active = [g for g in generations if not g.is_done]
    load = batch_size or (lambda: len(active))
    for g in active:
        g.begin(load())
    trees = [g.speculate() for g in active]  # local drafts build all their trees in one batch here
    verify_started = time.perf_counter()
    results = verify(list(zip(active, trees)))
    return [g.record(tree, accepted, bonus, load(), verify_started)
            for g, tree, (accepted, bonus) in zip(active, trees, results)]
