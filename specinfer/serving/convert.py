"""Protobuf <-> domain conversion, at the service edge only (model code never sees *_pb2).

Token trees travel compactly (SpecInfer Section 3 trees, Section 4.3 verification inputs):
greedy trees are just tokens and parents; stochastic trees add their draft attempts and each
distinct proposal distribution q once, sparsely (the speculator samples from a top-k-truncated q,
so q is exactly sparse).
"""

from __future__ import annotations

import math

import torch

from specinfer.errors import UserError
from specinfer.engine.sampling import SamplingParams
from specinfer.engine.speculator import TreeShape
from specinfer.engine.tree import DEFAULT_MAX_NODES, Draft, TokenTree
from specinfer.v1 import specinfer_pb2 as pb

MAX_TREE_NODES = 1024
MAX_TREE_DEPTH = 64


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p else 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def shape_from_proto(msg: pb.TreeShape, default: TreeShape) -> TreeShape:
    """The requested shape, with unset fields taken from `default`; raises on malformed widths."""
    widths = tuple(int(w) for w in msg.widths) or default.widths
    if any(w < 1 for w in widths):
        raise UserError("shape.widths: every width must be >= 1")
    if len(widths) > MAX_TREE_DEPTH:
        raise UserError(f"shape.widths: deeper than {MAX_TREE_DEPTH} levels")
    max_nodes = int(msg.max_nodes) or default.max_nodes or DEFAULT_MAX_NODES
    if max_nodes > MAX_TREE_NODES:
        raise UserError(f"shape.max_nodes: over the limit of {MAX_TREE_NODES}")
    has_shape = bool(msg.widths) or msg.max_nodes or msg.proposal_top_k
    if not 0.0 <= msg.min_path_prob < 1.0:
        raise UserError("shape.min_path_prob: must be in [0, 1)")
    return TreeShape(
        widths=widths,
        max_nodes=max_nodes,
        is_sampled=bool(msg.sampled) if has_shape else default.is_sampled,
        proposal_top_k=int(msg.proposal_top_k) or default.proposal_top_k,
        min_path_prob=float(msg.min_path_prob) or default.min_path_prob,
        policy=_POLICY_NAMES.get(msg.policy, default.policy),
    )


_POLICY_NAMES = {pb.TREE_POLICY_MERGE: "merge", pb.TREE_POLICY_MIXED: "mixed"}
_POLICY_VALUES = {name: value for value, name in _POLICY_NAMES.items()}


def shape_to_proto(shape: TreeShape) -> pb.TreeShape:
    return pb.TreeShape(widths=list(shape.widths), max_nodes=shape.max_nodes, sampled=shape.is_sampled,
                        proposal_top_k=shape.proposal_top_k, min_path_prob=shape.min_path_prob,
                        policy=_POLICY_VALUES[shape.policy])


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
