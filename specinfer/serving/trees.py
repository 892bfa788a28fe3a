"""Token trees on the wire, converted and validated at the service edge.

Token trees travel compactly (SpecInfer Section 3 trees, Section 4.3 verification inputs):
greedy trees are just tokens and parents; stochastic trees add their draft attempts and each
distinct proposal distribution q once, sparsely (the speculator samples from a top-k-truncated q,
so q is exactly sparse).
"""

from __future__ import annotations

import math

import torch

from specinfer.errors import UserError
from specinfer.engine.drafting.tree import Draft, TokenTree
from specinfer.limits import MAX_TREE_NODES
from specinfer.v1 import specinfer_pb2 as pb


def tree_to_proto(tree: TokenTree, is_greedy: bool) -> pb.TokenTree:
    msg = pb.TokenTree(tokens=tree.tokens, parents=tree.parents)
    if is_greedy:
        return msg
    proposal_index: dict[int, int] = {}
    for node, drafts in enumerate(tree.drafts):
        for d in drafts:
            msg.draft_nodes.append(node)
            msg.draft_children.append(d.child)
            if d.proposal is None:
                msg.draft_proposals.append(-1)
                continue
            key = id(d.proposal)
            if key not in proposal_index:
                q = d.proposal
                ids = torch.nonzero(q > 0).flatten()
                proposal_index[key] = len(msg.proposals)
                msg.proposals.append(pb.Proposal(token_ids=ids.tolist(), probs=q[ids].tolist()))
            msg.draft_proposals.append(proposal_index[key])
    return msg


def tree_from_proto(msg: pb.TokenTree, vocab_size: int, is_greedy: bool) -> TokenTree:
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
        tree.drafts.append([])
        tree.children[parent].append(i)
    if is_greedy or not msg.draft_nodes:
        for i in range(1, n):
            tree.drafts[msg.parents[i]].append(Draft(i, None))
        return tree
    proposals = [_dense_proposal(p, vocab_size) for p in msg.proposals]
    if not (len(msg.draft_nodes) == len(msg.draft_children) == len(msg.draft_proposals)):
        raise UserError("tree: draft arrays differ in length")
    for node, child, q in zip(msg.draft_nodes, msg.draft_children, msg.draft_proposals):
        if not (0 <= node < n and 0 < child < n and tree.parents[child] == node):
            raise UserError(f"tree: draft ({node} -> {child}) is not an edge of the tree")
        if not -1 <= q < len(proposals):
            raise UserError(f"tree: draft proposal index {q} out of range")
        proposal = proposals[q] if q >= 0 else None
        if proposal is not None and proposal[tree.tokens[child]] <= 0:
            raise UserError("tree: a sampled draft has zero probability under its proposal")
        tree.drafts[node].append(Draft(child, proposal))
    return tree


def _token(token: int, vocab_size: int) -> int:
    if not 0 <= token < vocab_size:
        raise UserError(f"token id {token} is outside the vocabulary [0, {vocab_size})")
    return int(token)


def _dense_proposal(p: pb.Proposal, vocab_size: int) -> torch.Tensor:
    if len(p.token_ids) != len(p.probs) or not p.token_ids:
        raise UserError("tree: proposal token_ids and probs differ in length or are empty")
    q = torch.zeros(vocab_size, dtype=torch.float32)
    ids = torch.tensor([_token(t, vocab_size) for t in p.token_ids], dtype=torch.long)
    probs = torch.tensor(list(p.probs), dtype=torch.float32)
    total = float(probs.sum())
    if (probs < 0).any() or not math.isfinite(total) or abs(total - 1.0) > 1e-3:
        raise UserError("tree: proposal probabilities must be >= 0 and sum to 1")
    q[ids] = probs / total
    return q
