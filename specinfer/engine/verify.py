"""Token-tree verification (SpecInfer Section 4.3): greedy, and multi-step speculative sampling.

Both take the LLM's output at every tree node from one forward pass and return the accepted
path (node ids, root first) plus the bonus token the LLM contributes after it.

Stochastic verification is Algorithm 2 (MSS) with one refinement that makes it exact for any
tree construction: at each node, draft attempts are tried in the order they were drawn, each
against the proposal q it was actually drawn from. A sampled draft is accepted with
min(1, p[x]/q[x]) and on rejection p becomes norm(max(0, p - q)); a deterministic draft (a top-k
pick) is a point mass, so it is accepted with p[x] and on rejection p[x] is zeroed.
"""

from __future__ import annotations

import torch

from specinfer.engine.tree import TokenTree

_EPS = 1e-12


def verify_greedy(tree: TokenTree, argmax: list[int]) -> tuple[list[int], int]:
    """Walks down while a child's token equals the LLM's argmax at its parent."""
    path = [0]
    while True:
        node = path[-1]
        child = tree.child_with_token(node, argmax[node])
        if child is None:
            return path, argmax[node]
        path.append(child)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what is left of p after a rejected draft from q."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    if total <= _EPS:  # p == q up to rounding: rejection had probability ~0
        return p
    return r / total


def verify_stochastic(
    tree: TokenTree, probs: torch.Tensor, generator: torch.Generator
) -> tuple[list[int], int]:
    """Multi-step speculative sampling over the tree.

    probs: (n, V) target distribution at every node (already warped). Draft proposals are
    dense (V,) tensors, or None for deterministic picks.
    """
    path = [0]
    while True:
        node = path[-1]
        p = probs[node]
        accepted = None
        for draft in tree.drafts[node]:
            x = tree.tokens[draft.child]
            q = draft.proposal if draft.proposal is not None else _point_mass(p, x)
            qx = q[x].item()
            u = torch.rand((), generator=generator).item()
            if qx > 0 and u < min(1.0, p[x].item() / qx):
                accepted = draft.child
                break
            p = residual_distribution(p, q)
        if accepted is None:
            return path, sample_token(p, generator)
        path.append(accepted)


def _point_mass(like: torch.Tensor, token: int) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())
