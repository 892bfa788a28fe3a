"""The LLM side: per-request KV state and one forward pass that verifies many token trees.

SpecInfer Section 4: the tree (rooted at the last verified token) and any verified tokens not yet
in the cache go through the LLM in one pass with a topology-aware mask; the LLM's own token at
every node (its argmax, or its seeded sample: `sampling.SamplingNoise`) picks the accepted path
and one bonus token, and only the accepted nodes' KV is committed. Prompt chunks of requests still being prefilled ride in the same pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specinfer.engine.scheduling.blocks import BlockHash, SequenceKV
from specinfer.engine.verification.processors import RequestLogits
from specinfer.engine.runtime.runner import ModelRunner, Work, chain_work
from specinfer.engine.verification.sampling import SamplingNoise, first_max, sample, token_logprobs
from specinfer.engine.drafting.tree import TokenTree
from specinfer.engine.verification.acceptance import verify_tree
from specinfer.params import SamplingParams


@dataclass
class LLMState:
    seq: SequenceKV
    pending: list[int]  # verified tokens not yet in the LLM cache; the last one is the next root
    num_logprobs: int | None = None  # the request wants logprobs with this many alternatives
    last_logprobs: list = field(default_factory=list)  # the last step's, one per accepted token and the bonus
    processors: RequestLogits | None = None  # penalties, logit bias and grammar, per tree node


VerifyItem = tuple[LLMState, TokenTree, SamplingParams, SamplingNoise | None]  # noise: sampled requests


class Verifier:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def start(self, prompt_ids: list[int], root: BlockHash | None = None) -> LLMState:
        """A request's state; with a cache `root`, its committed KV is addressable by prefix."""
        return LLMState(self.runner.new_sequence(root), list(prompt_ids))

    def release(self, state: LLMState) -> None:
        state.seq.free()

    def step(self, items: list[VerifyItem], prefills: list[tuple[LLMState, int]]
             ) -> list[tuple[list[int], int] | Exception]:
        """One LLM forward pass: every item's pending tokens plus its tree, and `prefills`
        (state, n): the next n pending tokens of requests whose prompt is still being read in
        chunks. Returns (accepted tokens, bonus) per item, or the exception that failed that
        item alone (invalid logits, probabilities or tree): the other items are not affected."""
        works = [chain_work(state.seq, state.pending[:n], "none") for state, n in prefills]
        works += [tree_work(state, tree) for state, tree, _, _ in items]
        all_logits = self.runner.run(works)  # one pass over every request's chunk or tree
        for state, n in prefills:
            state.seq.advance(state.pending[:n])
            state.pending = state.pending[n:]
        results: list[tuple[list[int], int] | Exception] = []
        for item, logits in zip(items, all_logits[len(prefills):]):
            try:
                results.append(self._accept(*item, logits))
            except Exception as exc:  # noqa: BLE001 - it belongs to this item's request only
                results.append(exc)
        return results

    def _accept(self, state: LLMState, tree: TokenTree, params: SamplingParams, noise: SamplingNoise | None,
                logits: torch.Tensor) -> tuple[list[int], int]:
        """Verifies one tree against its logits and commits the accepted path's KV."""
        if not math.isfinite(float(logits.sum())):  # one reduction: any inf or NaN makes the sum non-finite
            raise ArithmeticError("the LLM produced non-finite logits for this request")
        if state.processors is not None:  # each node's logits in its own path's context
            logits = state.processors.process(logits, tree)
        if params.is_greedy:
            llm_tokens = first_max(logits)
        else:  # node n's logits sample the token right after it
            root = state.seq.num_committed + len(state.pending) - 1
            llm_tokens = sample(logits, params, noise, [root + d + 1 for d in tree.depths])
        path, bonus = verify_tree(tree, llm_tokens)
        if state.num_logprobs is not None:  # from the logits at hand: the rows of the accepted path
            state.last_logprobs = token_logprobs(logits[path], [tree.tokens[n] for n in path[1:]] + [bonus], params,
                                                 state.num_logprobs)
        if state.processors is not None:
            state.processors.advance([tree.tokens[n] for n in path[1:]] + [bonus])
        num_chain = len(state.pending) - 1
        self.runner.commit(state.seq, list(range(num_chain)) + [num_chain + n for n in path],
                           state.pending[:-1] + [tree.tokens[n] for n in path])
        state.pending = [bonus]
        return [tree.tokens[n] for n in path[1:]], bonus


def tree_work(state: LLMState, tree: TokenTree) -> Work:
    """The pending verified tokens (a chain) followed by the tree hanging off the last one."""
    if tree.tokens[0] != state.pending[-1]:
        raise ValueError("tree root must be the last verified token")
    chain = state.pending[:-1]
    k = len(chain)
    base = state.seq.num_committed
    parents = list(range(-1, k - 1)) + [(p + k if p >= 0 else k - 1) for p in tree.parents]
    positions = list(range(base, base + k)) + [base + k + d for d in tree.depths]
    return Work(state.seq, chain + tree.tokens, positions, parents, len(tree))
