"""Suffix speculation: model-free drafts from the request's context and recent outputs of others.

In the style of SuffixDecoding (arXiv 2411.04975): the longest suffix of the request's context
(up to `max_pattern` tokens) that occurred before, in the request's own context or in a bounded
cache of recent outputs shared by all requests, selects every continuation that followed it.
A draft built by `specinfer make-draft` also carries the LLM's own answers to its teacher
prompts; they seed a second, fixed cache (`SuffixCache.of`) that recent outputs never evict, so a
fresh server drafts the LLM's habitual phrasing from its first request. Those continuations
(the request's own first, then recent outputs, then the seed) are counted into a trie and the
draft tree takes its most frequent branches first, as long as a branch's empirical probability
stays above `min_prob`. How deep it drafts adapts to how much matched: `depth_per_match` tokens
per matched token, within the step's bound.
Agents, code edits and repeated tasks produce text that other requests already produced.

A member of the SSM pool whose trees merge by path with the SSMs' (SpecInfer Section 3.2). Its
children are deterministic picks; verification keeps the LLM's own tokens, so it stays exact
(Section 4.3). Plain Python, no tensors.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from specinfer.engine.drafting.lookup import ContextIndex
from specinfer.engine.drafting.tree import ScoredTree, TokenTree, counted_tree
from specinfer.limits import (
    SUFFIX_CACHE_TOKENS, SUFFIX_DEPTH_PER_MATCH, SUFFIX_MAX_PATTERN, SUFFIX_MAX_SOURCES, SUFFIX_MIN_PROB,
)


class SuffixCache:
    """Recent outputs of finished requests, shared by all requests, at most `max_tokens` tokens
    (the oldest output goes first). Thread-safe."""

    def __init__(self, max_tokens: int = SUFFIX_CACHE_TOKENS, max_pattern: int = SUFFIX_MAX_PATTERN):
        self.max_tokens, self.max_pattern = max_tokens, max_pattern
        self._docs: deque[tuple[int, list[int]]] = deque()
        self._follows: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> (doc, next position)
        self._texts: dict[int, list[int]] = {}
        self._num_tokens = 0
        self._next_id = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, documents, max_pattern: int = SUFFIX_MAX_PATTERN) -> "SuffixCache | None":
        """A cache holding all of `documents` (token lists), none evicted; None when they are empty."""
        documents = [list(d) for d in documents]
        cache = cls(sum(map(len, documents)), max_pattern)
        for doc in documents:
            cache.add(doc)  # a document under 2 tokens teaches nothing and is not kept
        return cache if cache.num_tokens else None

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add(self, tokens: list[int]) -> None:
        tokens = list(tokens[-self.max_tokens:]) if self.max_tokens > 0 else []
        if len(tokens) < 2:  # a cache of 0 tokens holds nothing: each request drafts from its own context
            return
        with self._lock:
            doc, self._next_id = self._next_id, self._next_id + 1
            self._docs.append((doc, tokens))
            self._texts[doc] = tokens
            self._num_tokens += len(tokens)
            for end in range(1, len(tokens)):  # a pattern ending at the last token has no continuation
                for n in range(1, min(self.max_pattern, end) + 1):
                    self._follows.setdefault(tuple(tokens[end - n:end]), []).append((doc, end))
            while self._num_tokens > self.max_tokens:
                self._evict()

    def _evict(self) -> None:
        doc, tokens = self._docs.popleft()
        del self._texts[doc]
        self._num_tokens -= len(tokens)
        for end in range(1, len(tokens)):
            for n in range(1, min(self.max_pattern, end) + 1):
                key = tuple(tokens[end - n:end])
                kept = [e for e in self._follows.get(key, ()) if e[0] != doc]
                if kept:
                    self._follows[key] = kept
                else:
                    self._follows.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._docs.clear()
            self._follows.clear()
            self._texts.clear()
            self._num_tokens = 0

    def continuations(self, pattern: tuple[int, ...], depth: int, limit: int) -> list[list[int]]:
        """What followed `pattern` in the cached outputs, most recent first (at most `limit`)."""
        with self._lock:
            out = []
            for doc, pos in reversed(self._follows.get(pattern, ())):
                out.append(self._texts[doc][pos:pos + depth])
                if len(out) >= limit:
                    break
            return out


@dataclass
class SuffixState:
    context: ContextIndex
    num_prompt: int

    @property
    def tokens(self) -> list[int]:
        return self.context.tokens


class SuffixSpeculator:
    """Frequency-weighted draft trees from the longest matching suffix (see the module doc);
    `seed`, a fixed cache of a draft's answers, is read after the shared recent outputs."""

    name = "suffix"

    def __init__(self, cache: SuffixCache | None = None, max_pattern: int = SUFFIX_MAX_PATTERN,
                 min_prob: float = SUFFIX_MIN_PROB, depth_per_match: float = SUFFIX_DEPTH_PER_MATCH,
                 max_sources: int = SUFFIX_MAX_SOURCES, seed: SuffixCache | None = None):
        self.cache = cache if cache is not None else SuffixCache(max_pattern=max_pattern)
        self.seed = seed
        self.max_pattern, self.min_prob = max_pattern, min_prob
        self.depth_per_match, self.max_sources = depth_per_match, max_sources

    def start(self, context_ids: list[int]) -> SuffixState:
        context = ContextIndex(self.max_pattern)
        context.extend(context_ids)
        return SuffixState(context, len(context_ids))

    def extend(self, state: SuffixState, tokens: list[int]) -> None:
        state.context.extend(tokens)

    def release(self, state: SuffixState) -> None:
        """The request's output joins the shared cache."""
        self.cache.add(state.context.tokens[state.num_prompt:])

    def propose(self, state: SuffixState, max_depth: int, max_nodes: int) -> TokenTree:
        return self.scored(state, max_depth, max_nodes).tree

    def scored(self, state: SuffixState, max_depth: int, max_nodes: int) -> ScoredTree:
        """The tree of the longest matching suffix, each node with its branch's empirical probability."""
        seq = state.context.tokens
        tree = TokenTree.with_root(seq[-1])
        for n in range(min(self.max_pattern, len(seq) - 1), 0, -1):
            depth = min(max_depth, math.ceil(self.depth_per_match * n))
            paths = (state.context.continuations(n, depth, self.max_sources, is_distinct=False)
                     + self.cache.continuations(tuple(seq[len(seq) - n:]), depth, self.max_sources)
                     + (self.seed.continuations(tuple(seq[len(seq) - n:]), depth, self.max_sources)
                        if self.seed is not None else []))
            paths = [p for p in paths if p]
            if paths:
                return ScoredTree(tree, counted_tree(tree, paths, max_nodes, self.min_prob), n)
        return ScoredTree(tree, [1.0], 0)
