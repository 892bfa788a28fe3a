"""The in-process engine: prefill, speculate, verify, commit (SpecInfer Section 2, Figure 2).

`Verifier` is the LLM side and `Speculator` (speculator.py) the SSM side; the services split
them across processes, and `Engine.generate` runs the same loop in one. Incremental decoding is
the same loop with a root-only tree: it is the baseline for every speedup and the fallback when
no SSM is available.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specinfer.blocks import SequenceKV
from specinfer.errors import UserError
from specinfer.runner import ModelRunner, Work
from specinfer.sampling import SamplingParams, make_generator, target_probs
from specinfer.speculator import SSMState, SSMTree, Speculator, TreeShape
from specinfer.tree import PAPER_TREE_WIDTH, TokenTree
from specinfer.verify import verify_greedy, verify_stochastic

MODES = ("incremental", "sequence", "tree")


@dataclass(frozen=True)
class SpecConfig:
    """How a request speculates."""

    mode: str = "tree"
    widths: tuple[int, ...] = PAPER_TREE_WIDTH
    max_nodes: int = 64
    is_sampled_tree: bool = True
    proposal_top_k: int = 32

    def __post_init__(self):
        if self.mode not in MODES:
            raise UserError(f"unknown mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.max_nodes < 1:
            raise UserError("max tree nodes must be >= 1")

    def shape(self) -> TreeShape | None:
        if self.mode == "incremental":
            return None
        widths = self.widths if self.mode == "tree" else (1,) * len(self.widths)
        return TreeShape(widths, self.max_nodes, self.is_sampled_tree, self.proposal_top_k)


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
        runner = self.runner
        for state, tree, _, _ in items:
            if tree.tokens[0] != state.pending[-1]:
                raise ValueError("tree root must be the last verified token")
            if len(state.pending) > 1:  # e.g. the prompt, or a new turn: commit all but the root
                runner.prefill(state.seq, state.pending[:-1])
                state.pending = state.pending[-1:]
        works = []
        for state, tree, _, _ in items:
            base = state.seq.num_committed
            works.append(Work(state.seq, tree.tokens, [base + d for d in tree.depths], tree.parents, "all"))
        all_logits = runner.run(works)  # one pass over every request's tree
        results = []
        for (state, tree, params, gen), logits in zip(items, all_logits):
            if params.is_greedy:
                path, bonus = verify_greedy(tree, logits.argmax(dim=-1).tolist())
            else:
                path, bonus = verify_stochastic(tree, target_probs(logits, params), gen)
            runner.commit(state.seq, path)
            state.pending = [bonus]
            results.append(([tree.tokens[n] for n in path[1:]], bonus))
        return results


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


class Engine:
    """LLM + optional SSMs in one process."""

    def __init__(self, llm: ModelRunner, ssms: list[ModelRunner] | None = None):
        self.verifier = Verifier(llm)
        self.speculator = Speculator(list(ssms or []))
        for ssm in self.speculator.runners:
            if ssm.cfg.vocab_size != llm.cfg.vocab_size:
                raise UserError(
                    f"SSM vocabulary ({ssm.cfg.vocab_size}) differs from the LLM's ({llm.cfg.vocab_size})"
                )

    @property
    def max_context(self) -> int:
        return min([self.verifier.runner.max_context] + [r.max_context for r in self.speculator.runners])

    def check_request(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise UserError("prompt is empty")
        if max_new_tokens < 1:
            raise UserError(f"max new tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.max_context:
            raise UserError(
                f"prompt ({len(prompt_ids)} tokens) plus max new tokens ({max_new_tokens}) exceeds "
                f"the model context of {self.max_context} tokens"
            )

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        spec: SpecConfig = SpecConfig(),
        stop_token_ids: tuple[int, ...] | None = None,
    ) -> GenerationResult:
        self.check_request(prompt_ids, max_new_tokens)
        shape = spec.shape() if self.speculator.runners else None
        stops = set(self.verifier.runner.cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
        spec_gen = make_generator(params.seed, 1)
        verify_gen = make_generator(params.seed, 2)
        start = time.perf_counter()
        llm_state = self.verifier.start(prompt_ids)
        ssm_states: list[SSMState] = self.speculator.start(prompt_ids) if shape else []
        result = GenerationResult(list(prompt_ids), [], 0)
        try:
            while len(result.output_ids) < max_new_tokens:
                remaining = max_new_tokens - len(result.output_ids)
                context = len(prompt_ids) + len(result.output_ids)
                depth = min(remaining - 1, self.max_context - context - 1)
                ssm_trees: list[SSMTree] = []
                if shape and depth > 0:
                    ((tree, ssm_trees),) = self.speculator.propose([(ssm_states, shape.clipped(depth), params, spec_gen)])
                else:
                    tree = TokenTree.with_root(llm_state.pending[-1])
                accepted, bonus = self.verifier.verify(llm_state, tree, params, verify_gen)
                if ssm_states:
                    if ssm_trees:
                        self.speculator.feedback(ssm_states, ssm_trees, accepted, bonus)
                    else:
                        for s in ssm_states:
                            s.pending.extend(accepted + [bonus])
                result.num_llm_steps += 1
                result.accepted_per_step.append(len(accepted))
                result.tree_nodes_per_step.append(len(tree))
                new = accepted + [bonus]
                for t in new[:remaining]:
                    result.output_ids.append(t)
                    if t in stops:
                        result.finish_reason = "stop"
                        break
                if result.finish_reason == "stop":
                    break
        finally:
            self.verifier.release(llm_state)
            self.speculator.release(ssm_states)
        result.latency_s = time.perf_counter() - start
        return result
