"""The in-process engine: prefill, speculate, verify, commit (SpecInfer Section 2, Figure 2).

`Verifier` is the LLM side and `Speculator` (speculator.py) the SSM side; the services split
them across processes, and `Engine.generate` runs the same loop in one. Incremental decoding is
the same loop with a root-only tree: it is the baseline for every speedup and the fallback when
no SSM is available.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from specinfer.engine.blocks import SequenceKV
from specinfer.errors import UserError
from specinfer.engine.policy import CostModel, LoadAwarePolicy
from specinfer.engine.runner import ModelRunner, Work, chain_work
from specinfer.engine.sampling import make_generator, target_probs
from specinfer.params import SamplingParams
from specinfer.engine.speculator import SSMState, SSMTree, Speculator
from specinfer.params import TreeShape
from specinfer.engine.tree import TokenTree
from specinfer.limits import PAPER_TREE_WIDTH
from specinfer.engine.verify import verify_greedy, verify_stochastic

MODES = ("incremental", "sequence", "tree", "auto")


@dataclass(frozen=True)
class SpecConfig:
    """How a request speculates."""

    mode: str = "tree"
    widths: tuple[int, ...] = PAPER_TREE_WIDTH
    max_nodes: int = 64
    is_sampled_tree: bool = True
    proposal_top_k: int = 32
    min_path_prob: float = 0.0  # dynamic pruning of unlikely branches (see TreeShape)
    policy: str = "merge"  # several SSMs: "merge" their full trees, or "mixed" (see TreeShape)

    def __post_init__(self):
        if self.mode not in MODES:
            raise UserError(f"unknown mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.max_nodes < 1:
            raise UserError("max tree nodes must be >= 1")

    def shape(self) -> TreeShape | None:
        """The tree shape; in "auto" mode `widths` only bound what the policy may pick."""
        if self.mode == "incremental":
            return None
        widths = self.widths if self.mode in ("tree", "auto") else (1,) * len(self.widths)
        return TreeShape(widths, self.max_nodes, self.is_sampled_tree, self.proposal_top_k,
                         min_path_prob=self.min_path_prob, policy=self.policy)


@dataclass
class LLMState:
    seq: SequenceKV
    pending: list[int]  # verified tokens not yet in the LLM cache; the last one is the next root


class Verifier:
    """The LLM side: per-request KV, and one forward pass per token tree."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def start(self, prompt_ids: list[int]) -> LLMState:
        return LLMState(self.runner.new_sequence(), list(prompt_ids))

    def release(self, state: LLMState) -> None:
        state.seq.free()

    def verify(
        self, state: LLMState, tree: TokenTree, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[list[int], int]:
        """Verifies `tree` (rooted at the last pending token); returns (accepted tokens, bonus)."""
        return self.verify_batch([(state, tree, params, generator)])[0]

    def verify_batch(
        self, items: list[tuple[LLMState, TokenTree, SamplingParams, torch.Generator | None]]
    ) -> list[tuple[list[int], int]]:
        return self.step(items, [])

    def step(
        self,
        items: list[tuple[LLMState, TokenTree, SamplingParams, torch.Generator | None]],
        prefills: list[tuple[LLMState, int]],
    ) -> list[tuple[list[int], int]]:
        """One LLM forward pass: every item's pending tokens plus its tree, and `prefills`
        (state, n): the next n pending tokens of requests whose prompt is still being read in
        chunks. Returns (accepted tokens, bonus) per item."""
        works = [chain_work(state.seq, state.pending[:n], "none") for state, n in prefills]
        for state, tree, _, _ in items:
            works.append(self._tree_work(state, tree))
        all_logits = self.runner.run(works)  # one pass over every request's chunk or tree
        for state, n in prefills:
            state.seq.num_committed += n
            state.pending = state.pending[n:]
        results = []
        for (state, tree, params, gen), logits in zip(items, all_logits[len(prefills):]):
            if params.is_greedy:
                path, bonus = verify_greedy(tree, logits.argmax(dim=-1).tolist())
            else:
                path, bonus = verify_stochastic(tree, target_probs(logits, params), gen)
            num_chain = len(state.pending) - 1
            self.runner.commit(state.seq, list(range(num_chain)) + [num_chain + n for n in path])
            state.pending = [bonus]
            results.append(([tree.tokens[n] for n in path[1:]], bonus))
        return results

    @staticmethod
    def _tree_work(state: LLMState, tree: TokenTree) -> Work:
        """The pending verified tokens (a chain) followed by the tree hanging off the last one."""
        if tree.tokens[0] != state.pending[-1]:
            raise ValueError("tree root must be the last verified token")
        chain = state.pending[:-1]
        k = len(chain)
        base = state.seq.num_committed
        parents = list(range(-1, k - 1)) + [(p + k if p >= 0 else k - 1) for p in tree.parents]
        positions = list(range(base, base + k)) + [base + k + d for d in tree.depths]
        return Work(state.seq, chain + tree.tokens, positions, parents, len(tree))


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    num_llm_steps: int
    accepted_per_step: list[int] = field(default_factory=list)
    tree_nodes_per_step: list[int] = field(default_factory=list)
    latency_s: float = 0.0
    finish_reason: str = "length"

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

    def stats(self) -> dict:
        steps = max(1, self.num_llm_steps)
        speculated = sum(max(0, n - 1) for n in self.tree_nodes_per_step)
        return {
            "prompt_tokens": len(self.prompt_ids),
            "output_tokens": len(self.output_ids),
            "llm_steps": self.num_llm_steps,
            "tokens_per_step": self.tokens_per_step,
            "mean_accepted": sum(self.accepted_per_step) / steps,
            "mean_tree_nodes": sum(self.tree_nodes_per_step) / steps,
            "acceptance_rate": sum(self.accepted_per_step) / speculated if speculated else 0.0,
            "latency_s": self.latency_s,
        }


def check_request(prompt_ids: list[int], max_new_tokens: int, vocab_size: int, max_context: int) -> None:
    """Rejects requests the engine cannot serve, with a message naming the problem."""
    if not prompt_ids:
        raise UserError("prompt is empty")
    if max_new_tokens < 1:
        raise UserError(f"max new tokens must be >= 1, got {max_new_tokens}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise UserError(f"prompt token ids must be inside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) + max_new_tokens > max_context:
        raise UserError(
            f"prompt ({len(prompt_ids)} tokens) plus max new tokens ({max_new_tokens}) exceeds "
            f"the model context of {max_context} tokens"
        )


def speculation_depth(remaining: int, context: int, max_context: int) -> int:
    """How deep a tree may go: the bonus token needs one of the remaining tokens and positions."""
    return max(0, min(remaining - 1, max_context - context - 1))


@dataclass
class Request:
    """One generation in flight: both sides' state, its RNG streams and its running result."""

    max_new_tokens: int
    params: SamplingParams
    shape: TreeShape | None
    stops: frozenset[int]
    llm_state: LLMState
    ssm_states: list[SSMState | None]
    spec_gen: torch.Generator
    verify_gen: torch.Generator
    result: GenerationResult
    start_time: float
    is_auto: bool = False  # the load-aware policy picks each step's shape
    is_done: bool = False

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.result.output_ids)


class Engine:
    """LLM + optional SSMs in one process. Requests in a batch step together: one batched SSM
    pass per tree level and one LLM pass per step cover all of them."""

    def __init__(self, llm: ModelRunner, ssms: list[ModelRunner] | None = None):
        self.verifier = Verifier(llm)
        self.speculator = Speculator(list(ssms or []))
        self.policies: dict[tuple, LoadAwarePolicy] = {}  # per width bound, built on first "auto" use
        for ssm in self.speculator.runners:
            if ssm.cfg.vocab_size != llm.cfg.vocab_size:
                raise UserError(
                    f"SSM vocabulary ({ssm.cfg.vocab_size}) differs from the LLM's ({llm.cfg.vocab_size})"
                )

        self.max_context = min([llm.max_context] + [r.max_context for r in self.speculator.runners])

    def check_request(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        check_request(prompt_ids, max_new_tokens, self.verifier.runner.cfg.vocab_size, self.max_context)

    def start(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        spec: SpecConfig = SpecConfig(),
        stop_token_ids: tuple[int, ...] | None = None,
    ) -> Request:
        self.check_request(prompt_ids, max_new_tokens)
        shape = spec.shape() if self.speculator.runners else None
        stops = self.verifier.runner.cfg.eos_token_ids if stop_token_ids is None else stop_token_ids
        return Request(
            max_new_tokens=max_new_tokens,
            params=params,
            shape=shape,
            stops=frozenset(stops),
            llm_state=self.verifier.start(prompt_ids),
            ssm_states=self.speculator.start(prompt_ids) if shape else [],
            spec_gen=make_generator(params.seed, 1),
            verify_gen=make_generator(params.seed, 2),
            result=GenerationResult(list(prompt_ids), [], 0),
            start_time=time.perf_counter(),
            is_auto=spec.mode == "auto" and shape is not None,
        )

    def step(self, requests: list[Request]) -> None:
        """One speculate + verify iteration for every unfinished request."""
        active = [r for r in requests if not r.is_done]
        if not active:
            return
        proposing, shapes = [], {}
        for req in active:
            context = len(req.result.prompt_ids) + len(req.result.output_ids)
            depth = speculation_depth(req.remaining, context, self.max_context)
            shape = req.shape
            if shape is not None and req.is_auto:
                shape = replace(shape, widths=self._policy(shape).choose(len(active), req.params.is_greedy))
            if shape is not None and depth > 0 and shape.widths:
                proposing.append(req)
                shapes[id(req)] = shape.clipped(depth)
        trees: dict[int, tuple[TokenTree, list[SSMTree]]] = {}
        if proposing:
            started = time.perf_counter()
            batch = [(r.ssm_states, shapes[id(r)], r.params, r.spec_gen) for r in proposing]
            for req, out in zip(proposing, self.speculator.propose(batch)):
                trees[id(req)] = out
            seconds = time.perf_counter() - started
            for req in proposing:
                if req.is_auto:
                    self._policy(req.shape).observe_speculation(len(shapes[id(req)].widths), seconds)
        items = []
        for req in active:
            tree = trees[id(req)][0] if id(req) in trees else TokenTree.with_root(req.llm_state.pending[-1])
            items.append((req.llm_state, tree, req.params, req.verify_gen))
        for req, (state, tree, _, _), (accepted, bonus) in zip(active, items, self.verifier.verify_batch(items)):
            ssm_trees = trees[id(req)][1] if id(req) in trees else None
            self.speculator.feedback(req.ssm_states, ssm_trees, accepted, bonus)
            if req.is_auto:
                self._policy(req.shape).observe_step(tree, tree.find_path(accepted), req.params.is_greedy)
            self._emit(req, accepted, bonus, len(tree))

    def _policy(self, bound: TreeShape) -> LoadAwarePolicy:
        """The load-aware policy for shapes within `bound` (its cost model calibrated once)."""
        key = (len(bound.widths), max(bound.widths), bound.max_nodes)
        if key not in self.policies:
            if not self.policies:
                self.cost_model = CostModel.calibrate(self.verifier.runner)
            self.policies[key] = LoadAwarePolicy(self.cost_model, max_depth=key[0], max_width=key[1], max_nodes=key[2])
        return self.policies[key]

    def _emit(self, req: Request, accepted: list[int], bonus: int, num_nodes: int) -> None:
        req.result.record_step(accepted, bonus, num_nodes, req.max_new_tokens, req.stops)
        if req.result.is_finished(req.max_new_tokens):
            self.finish(req)

    def finish(self, req: Request) -> None:
        """Frees the request's KV caches (idempotent)."""
        if not req.is_done:
            req.is_done = True
            req.result.latency_s = time.perf_counter() - req.start_time
        self.verifier.release(req.llm_state)
        self.speculator.release(req.ssm_states)

    def generate_batch(self, requests: list[Request]) -> list[GenerationResult]:
        try:
            while any(not r.is_done for r in requests):
                self.step(requests)
        finally:
            for r in requests:
                self.finish(r)
        return [r.result for r in requests]

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        spec: SpecConfig = SpecConfig(),
        stop_token_ids: tuple[int, ...] | None = None,
    ) -> GenerationResult:
        return self.generate_batch([self.start(prompt_ids, max_new_tokens, params, spec, stop_token_ids)])[0]
