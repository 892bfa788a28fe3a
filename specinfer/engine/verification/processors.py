"""Logits processors at every node of a token tree: penalties, logit bias and a grammar's mask.

SpecInfer's verification (Section 4.3) keeps a draft exactly when it is the LLM's own token at its
parent. With logits processors the LLM's token at a node is the argmax (or the seeded sample) of
its logits *processed in that node's own context*: the request's output so far plus the drafts on
the path from the root down to the node, as if they had been generated. So every node gets the
penalties of its own path and the grammar state after its own path, and the accepted path is
token for token what decoding one token at a time would produce.

The order is vLLM's: the grammar's mask, `logit_bias`, then transformers' repetition penalty (over
prompt and output), then OpenAI's frequency and presence penalties (over the output only); the
warpers (temperature, top-k, top-p, min_p) follow in `sampling.warp_logits`. A step's work is a
few (n, V) tensor operations plus sparse updates along the paths, without Python per vocabulary
entry.

A grammar does more than mask. Drafts its grammar rejects are cut from the tree before the LLM's
pass (they could never be accepted), and where the grammar admits a single continuation (a JSON
key, a brace, a comma) those tokens join the tree as certain drafts no model had to propose.
"""

from __future__ import annotations

import time

import torch

from specinfer import limits
from specinfer.engine.drafting.tree import TokenTree, add_paths, subtree
from specinfer.params import SamplingParams


class RequestLogits:
    """One request's logits processors and grammar state, kept in step with its verified tokens."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], num_output: int, vocab_size: int,
                 grammar=None, max_forced_tokens: int = limits.DEFAULT_MAX_FORCED_TOKENS):
        limits.check_logit_bias_vocab(params.logit_bias, vocab_size)
        self.params, self.vocab_size, self.grammar = params, vocab_size, grammar
        self.max_forced_tokens = max_forced_tokens
        self._bias = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size)
            ids, values = zip(*params.logit_bias)
            self._bias[list(ids)] = torch.tensor(values)
        self._counts = torch.zeros(vocab_size)  # each token's count in the output
        self._seen = torch.zeros(vocab_size, dtype=torch.bool)  # in prompt or output
        num_prompt = len(prompt_ids) - num_output
        self._note(prompt_ids[:num_prompt], is_output=False)
        self._note(prompt_ids[num_prompt:], is_output=True)
        if grammar is not None and num_output:
            grammar.advance(list(prompt_ids[num_prompt:]))
        self.masks = None  # this step's grammar masks, one row per node of `_masked_tree`
        self._masked_tree: TokenTree | None = None
        self.seconds = 0.0  # spent here and in the grammar, for the benchmarks

    @property
    def is_active(self) -> bool:
        return self.grammar is not None or self.params.has_penalties or self._bias is not None

    def _note(self, tokens: list[int], is_output: bool) -> None:
        if not tokens:
            return
        ids = torch.tensor(tokens, dtype=torch.long).clamp_(0, self.vocab_size - 1)
        self._seen[ids] = True
        if is_output:
            self._counts.index_add_(0, ids, torch.ones(len(tokens)))

    def advance(self, tokens: list[int]) -> None:
        """Verified output tokens (a step's accepted drafts and bonus), in order."""
        started = time.perf_counter()
        self._note(tokens, is_output=True)
        if self.grammar is not None:
            self.grammar.advance(tokens)
        self.seconds += time.perf_counter() - started

    def constrain(self, tree: TokenTree, max_depth: int) -> TokenTree:
        """The tree the LLM verifies: drafts the grammar rejects cut, the tokens it forces from the
        root added (at most `max_depth` of them), and this step's masks computed for `process`."""
        if self.grammar is None:
            return tree
        started = time.perf_counter()
        try:
            return self._constrain(tree, max_depth)
        finally:
            self.seconds += time.perf_counter() - started

    def _constrain(self, tree: TokenTree, max_depth: int) -> TokenTree:
        masks = self.grammar.tree_masks(tree.tokens, tree.parents)
        if not all(masks.valid):
            tree = subtree(tree, masks.valid)
            masks = None
        if max_depth > 0 and self.max_forced_tokens > 0:
            forced = self.grammar.forced(min(self.max_forced_tokens, max_depth))
            if forced:
                num_nodes = len(tree)
                tree = add_paths(tree, [forced], num_nodes + len(forced))
                masks = masks if len(tree) == num_nodes else None
        self.masks = masks if masks is not None else self.grammar.tree_masks(tree.tokens, tree.parents)
        self._masked_tree = tree
        return tree

    def process(self, logits: torch.Tensor, tree: TokenTree) -> torch.Tensor:
        """(n, V) logits of the tree's nodes -> processed in each node's own context."""
        if not self.is_active:
            return logits
        started = time.perf_counter()
        try:
            return self._process(logits, tree)
        finally:
            self.seconds += time.perf_counter() - started

    def _process(self, logits: torch.Tensor, tree: TokenTree) -> torch.Tensor:
        logits = logits.float().clone()
        if self.grammar is not None:
            masks = self.masks if self._masked_tree is tree else self.grammar.tree_masks(tree.tokens, tree.parents)
            logits = masks.apply(logits)
            self.masks, self._masked_tree = None, None
        if self._bias is not None:
            logits += self._bias.to(logits.device)
        if self.params.has_penalties:
            self._penalize(logits, tree)
        return logits

    def _penalize(self, logits: torch.Tensor, tree: TokenTree) -> None:
        params, device = self.params, logits.device
        # The path of node i (its drafts below the root) counts as output in row i.
        rows, cols = [], []
        for node in range(1, len(tree)):
            path = tree.path_tokens(node)
            rows += [node] * len(path)
            cols += path
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        cols_t = torch.tensor(cols, dtype=torch.long, device=device)
        if params.repetition_penalty != 1.0:
            seen = self._seen.to(device).unsqueeze(0).expand_as(logits).clone()  # (n, V)
            if rows:
                seen[rows_t, cols_t] = True
            penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits.copy_(torch.where(seen, penalized, logits))
        if params.frequency_penalty or params.presence_penalty:
            counts = self._counts.to(device)
            if params.frequency_penalty:
                logits -= params.frequency_penalty * counts
                if rows:
                    logits.index_put_((rows_t, cols_t), torch.full((len(rows),), -params.frequency_penalty,
                                                                   device=device), accumulate=True)
            if params.presence_penalty:
                logits -= params.presence_penalty * (counts > 0).float()
                pairs = sorted(set(zip(rows, cols)))  # a token present twice on a path counts once
                if pairs:
                    r, c = (torch.tensor(x, dtype=torch.long, device=device) for x in zip(*pairs))
                    fresh = counts[c] == 0  # tokens the output does not hold yet
                    logits[r[fresh], c[fresh]] -= params.presence_penalty
