"""Prompt lookup: a model-free speculator that drafts from the request's own context.

A member of the SSM pool (SpecInfer Section 3.2 merges the trees of every pool member by path):
when the last n tokens of the context (prompt plus output so far) occurred earlier in it, what
followed them then is a likely continuation now. Code edits, quoting and summaries repeat long
stretches of their prompt, and this costs no model pass at all.

Children are deterministic picks; greedy and sampled verification (Section 4.3) keep the LLM's
own tokens, so they stay exact whatever is drafted. Plain Python, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specinfer.engine.drafting.tree import ScoredTree, TokenTree, add_paths, counted_tree
from specinfer.limits import LOOKUP_MAX_NGRAM, LOOKUP_MAX_PATHS, LOOKUP_MIN_NGRAM, SUFFIX_MAX_SOURCES


@dataclass
class ContextIndex:
    """A request's verified tokens and, for every n-gram of them, the positions that followed it."""

    max_ngram: int
    tokens: list[int] = field(default_factory=list)
    follows: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> next positions

    def extend(self, tokens: list[int]) -> None:
        seq, follows = self.tokens, self.follows
        for t in tokens:
            seq.append(t)
            end = len(seq)
            for n in range(1, min(self.max_ngram, end) + 1):
                follows.setdefault(tuple(seq[end - n:]), []).append(end)

    def continuations(self, n: int, depth: int, limit: int, is_distinct: bool = True) -> list[list[int]]:
        """What followed earlier occurrences of the last `n` tokens, most recent first, each up
        to `depth` tokens (at most `limit`; each once if `is_distinct`, else once per occurrence)."""
        seq = self.tokens
        if n > len(seq) or depth <= 0:
            return []
        out: list[list[int]] = []
        for pos in reversed(self.follows.get(tuple(seq[len(seq) - n:]), ())):
            if pos >= len(seq):
                continue  # the query itself: nothing followed it yet
            cont = seq[pos:pos + depth]
            if cont and not (is_distinct and cont in out):
                out.append(cont)
                if len(out) >= limit:
                    break
        return out


class PromptLookup:
    """N-gram matching over the request's context: the longest n with a match wins."""

    name = "lookup"

    def __init__(self, max_ngram: int = LOOKUP_MAX_NGRAM, min_ngram: int = LOOKUP_MIN_NGRAM,
                 max_paths: int = LOOKUP_MAX_PATHS):
        self.max_ngram, self.min_ngram, self.max_paths = max_ngram, min_ngram, max_paths

    def start(self, context_ids: list[int]) -> ContextIndex:
        index = ContextIndex(self.max_ngram)
        index.extend(context_ids)
        return index

    def extend(self, state: ContextIndex, tokens: list[int]) -> None:
        state.extend(tokens)

    def release(self, state: ContextIndex) -> None:
        pass

    def propose(self, state: ContextIndex, max_depth: int, max_nodes: int) -> TokenTree:
        """A tree rooted at the last verified token: up to `max_paths` distinct continuations of
        the longest matching n-gram, each at most `max_depth` deep, within `max_nodes` nodes."""
        tree = TokenTree.with_root(state.tokens[-1])
        for n in range(min(self.max_ngram, len(state.tokens) - 1), self.min_ngram - 1, -1):
            paths = state.continuations(n, max_depth, self.max_paths)
            if paths:
                add_paths(tree, paths, max_nodes)
                break
        return tree

    def scored(self, state: ContextIndex, max_depth: int, max_nodes: int) -> ScoredTree:
        """The continuations of the longest matching n-gram, counted over its occurrences: each
        node with the share of occurrences that continued with it."""
        tree = TokenTree.with_root(state.tokens[-1])
        for n in range(min(self.max_ngram, len(state.tokens) - 1), self.min_ngram - 1, -1):
            paths = state.continuations(n, max_depth, SUFFIX_MAX_SOURCES, is_distinct=False)
            if paths:
                return ScoredTree(tree, counted_tree(tree, paths, max_nodes, 0.0), n)
        return ScoredTree(tree, [1.0], 0)
