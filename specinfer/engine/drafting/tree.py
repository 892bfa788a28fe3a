"""Token trees (SpecInfer Section 3): nodes, expansion shapes, merging, and the tree mask.

Plain Python, no tensors. Node 0 is the root: the last verified token, whose successor the
LLM predicts. Nodes are kept in topological order (a parent's index is below its children's),
level by level, so a node's depth never exceeds its index. Siblings carry distinct tokens.

A tree is just its tokens and their parents: verification keeps the LLM's own tokens (its
argmax, or its seeded sample, with drafts coupled to that sample), so it needs no record of how
a draft was made nor the distribution it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple
import heapq


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)

    @classmethod
    def with_root(cls, token: int) -> "TokenTree":
        tree = cls()
        tree._append(token, -1, 0)
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def _append(self, token: int, parent: int, depth: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.children.append([])
        return len(self.tokens) - 1

    def child_with_token(self, node: int, token: int) -> int | None:
        for c in self.children[node]:
            if self.tokens[c] == token:
                return c
        return None

    def add_draft(self, parent: int, token: int) -> int:
        """Adds `token` as a child of `parent`; reuses the child if this token is already there."""
        child = self.child_with_token(parent, token)
        if child is None:
            child = self._append(token, parent, self.depths[parent] + 1)
            self.children[parent].append(child)
        return child

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to `node` (the root excluded)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def ancestors(self) -> list[list[int]]:
        """For each node, the sorted indices of its ancestors and itself: the tree mask's rows."""
        return ancestor_rows(self.parents)

    def find_path(self, tokens: list[int]) -> list[int]:
        """Nodes (root first) along the longest prefix of `tokens` present in the tree."""
        path = [0]
        for t in tokens:
            c = self.child_with_token(path[-1], t)
            if c is None:
                break
            path.append(c)
        return path


class ScoredTree(NamedTuple):
    """A model-free drafter's tree with, per node, its empirical probability given its parent (the
    root's is 1), and how many context tokens matched to find it: what dynamic trees value it by."""

    tree: TokenTree
    confidence: list[float]
    num_matched: int


def counted_tree(tree: TokenTree, paths: list[list[int]], max_nodes: int, min_prob: float) -> list[float]:
    """Grows `tree` (its root only) from the branches of `paths` by empirical probability: a
    node's count over its parent's, multiplied along the path; the likeliest first. Returns each
    node's count over its parent's (the root's 1)."""
    trie: list[dict[int, int]] = [{}]  # trie node -> token -> child trie node
    counts = [len(paths)]
    for path in paths:
        node = 0
        for token in path:
            child = trie[node].get(token)
            if child is None:
                child = trie[node][token] = len(trie)
                trie.append({})
                counts.append(0)
            counts[child] += 1
            node = child
    confidence = [1.0]
    heap = [(-counts[c] / counts[0], token, c, 0, counts[c] / counts[0]) for token, c in trie[0].items()]
    heapq.heapify(heap)
    while heap and len(tree) < max_nodes:
        neg_prob, token, trie_node, parent, local = heapq.heappop(heap)
        if -neg_prob < min_prob:
            break
        node = tree.add_draft(parent, token)
        confidence.append(local)
        for t, c in trie[trie_node].items():
            ratio = counts[c] / counts[trie_node]
            heapq.heappush(heap, (neg_prob * ratio, t, c, node, ratio))
    return confidence


def add_paths(tree: TokenTree, paths: list[list[int]], max_nodes: int) -> TokenTree:
    """Adds token paths below the root, sharing common prefixes, while the tree has fewer than `max_nodes` nodes. Earlier paths first."""
    for path in paths:
        node = 0
        for token in path:
            child = tree.child_with_token(node, token)
            if child is None:
                if len(tree) >= max_nodes:
                    return tree
                child = tree.add_draft(node, token)
            node = child
    return tree


def subtree(tree: TokenTree, keep: list[bool]) -> TokenTree:
    """The nodes of `tree` marked in `keep` whose ancestors are all kept, in their order. The root
    is always kept."""
    out = TokenTree.with_root(tree.tokens[0])
    mapped = [0] + [-1] * (len(tree) - 1)
    for node in range(1, len(tree)):
        parent = mapped[tree.parents[node]]
        if keep[node] and parent >= 0:
            mapped[node] = out._append(tree.tokens[node], parent, out.depths[parent] + 1)
            out.children[parent].append(mapped[node])
    return out


def graft(tree: TokenTree, other: TokenTree, max_nodes: int) -> TokenTree:
    """Adds `other`'s paths into `tree` (same root), deduplicated by path, while `tree` has fewer
    than `max_nodes` nodes. Each added node goes after the children already at its parent."""
    if other.tokens[0] != tree.tokens[0]:
        raise ValueError("trees to graft must share their root token")
    mapped = [0] + [-1] * (len(other) - 1)
    for node in range(1, len(other)):
        parent = mapped[other.parents[node]]
        if parent < 0:
            continue
        child = tree.child_with_token(parent, other.tokens[node])
        if child is None and len(tree) >= max_nodes:
            continue
        mapped[node] = tree.add_draft(parent, other.tokens[node])
    return tree


def ancestor_rows(parents: list[int]) -> list[list[int]]:
    """Ancestor-or-self index lists for a parent array in topological order (-1 = no parent)."""
    rows: list[list[int]] = []
    for i, p in enumerate(parents):
        rows.append((rows[p] + [i]) if p >= 0 else [i])
    return rows


def visibility(parents: list[int]) -> tuple[list[int], list[list[int]]]:
    """The same mask as `ancestor_rows`, compactly: node i sees indices j < limits[i], plus
    extras[i]. A chain costs O(1) per node (no quadratic row copies for long prompt chunks),
    and a tree node adds only its tree ancestors."""
    limits: list[int] = []
    extras: list[list[int]] = []
    for i, p in enumerate(parents):
        if p < 0:
            limit, extra = (1, []) if i == 0 else (0, [i])
        elif not extras[p] and limits[p] == i:  # p sees exactly 0..p, and p == i - 1
            limit, extra = i + 1, []
        else:
            limit, extra = limits[p], extras[p] + [i]
        limits.append(limit)
        extras.append(extra)
    return limits, extras


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def window_starts(parents: list[int], num_new: int, num_committed: int, positions: list[int],
                  window: int) -> list[int]:
    """For the last `num_new` nodes of a scratch region (`parents` as in `ancestor_rows`) at
    `positions`: the first key index (committed prefix, then scratch region) a sliding-window
    layer lets each see, keys at positions p - window < position <= p (transformers' sliding
    window). Committed key j sits at position j, a scratch node at num_committed + its depth, so
    a window starting inside the scratch region starts at the node's ancestor window - 1 levels up.
    """
    starts = []
    first = len(parents) - num_new
    is_chain_region = is_chain(parents)
    for r, p in enumerate(positions):
        low = p - window + 1
        if low < num_committed:
            starts.append(max(0, low))
            continue
        node = first + r
        if is_chain_region:
            node -= window - 1
        else:
            for _ in range(window - 1):
                if parents[node] < 0:
                    break
                node = parents[node]
        starts.append(num_committed + max(0, node))
    return starts


def merge_trees(trees: list[TokenTree]) -> tuple[TokenTree, list[list[int]]]:
    """Union of trees with the same root, deduplicated by whole root-to-node path.

    Returns the merged tree and, per input tree, the map from its node ids to merged ids.
    Node identity is (merged parent, token), which by induction is identity of the whole path:
    the same token at the same depth under different parents stays two nodes. Nodes are created
    level by level, each level's in input order.
    """
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    root = trees[0].tokens[0]
    if any(t.tokens[0] != root for t in trees):
        raise ValueError("trees to merge must share their root token")
    merged = TokenTree.with_root(root)
    maps: list[list[int]] = []
    # Create all nodes level by level, so merged ids stay topological and level-ordered.
    for tree in trees:
        maps.append([0] * len(tree))
    max_depth = max(t.max_depth for t in trees)
    for depth in range(1, max_depth + 1):
        for ti, tree in enumerate(trees):
            for node in range(len(tree)):
                if tree.depths[node] != depth:
                    continue
                parent = maps[ti][tree.parents[node]]
                existing = merged.child_with_token(parent, tree.tokens[node])
                if existing is None:
                    existing = merged._append(tree.tokens[node], parent, depth)
                    merged.children[parent].append(existing)
                maps[ti][node] = existing
    return merged, maps
