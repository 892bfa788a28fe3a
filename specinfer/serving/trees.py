"""Token trees on the wire, converted and validated at the service edge.

Token trees travel compactly (SpecInfer Section 3 trees, Section 4.3 verification inputs): just
tokens and parents, greedy or sampled. Verification keeps the LLM's own tokens, so a draft's
proposal distribution is never needed: the deprecated draft-attempt and proposal fields of
`TokenTree` are neither sent nor read.
"""

from __future__ import annotations

from specinfer.errors import UserError
from specinfer.engine.drafting.tree import TokenTree
from specinfer.limits import MAX_TREE_NODES
from specinfer.v1 import specinfer_pb2 as pb


def tree_to_proto(tree: TokenTree) -> pb.TokenTree:
    return pb.TokenTree(tokens=tree.tokens, parents=tree.parents)


def tree_from_proto(msg: pb.TokenTree, vocab_size: int) -> TokenTree:
    """Rebuilds and validates a tree; raises UserError on anything inconsistent."""
    n = len(msg.tokens)
    if n == 0 or n > MAX_TREE_NODES or len(msg.parents) != n:
        raise UserError(f"tree: needs 1..{MAX_TREE_NODES} nodes with one parent each")
    if msg.parents[0] != -1:
        raise UserError("tree: node 0 must be the root (parent -1)")
    tree = TokenTree.with_root(_token(msg.tokens[0], vocab_size))
    for i in range(1, n):
        parent = msg.parents[i]
        if not 0 <= parent < i:
            raise UserError(f"tree: node {i} has parent {parent}; parents must precede children")
        token = _token(msg.tokens[i], vocab_size)
        if tree.child_with_token(parent, token) is not None:
            raise UserError(f"tree: node {i} duplicates a sibling's token")
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(tree.depths[parent] + 1)
        tree.children.append([])
        tree.children[parent].append(i)
    return tree


def _token(token: int, vocab_size: int) -> int:
    if not 0 <= token < vocab_size:
        raise UserError(f"token id {token} is outside the vocabulary [0, {vocab_size})")
    return int(token)
