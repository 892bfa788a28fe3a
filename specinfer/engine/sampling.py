"""Sampling parameters and the logits warping that defines the LLM's target distribution.

SpecInfer's stochastic verification (Section 4.3) guarantees the output follows the LLM's
distribution. With temperature, top-k and top-p, that distribution is the *warped* one; this
module defines it once, applied in the same order as Hugging Face's generate (temperature, then
top-k, then top-p), and both the verifier and plain incremental sampling use it.
"""

from __future__ import annotations

import torch

from specinfer.logprobs import TokenLogprob
from specinfer.params import SamplingParams


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Applies temperature, top-k and top-p to (n, V) logits; filtered entries become -inf."""
    logits = logits.float()
    if params.temperature != 1.0:
        logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - params.top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling must follow: softmax of the warped logits, (n, V) fp32."""
    return warp_logits(logits, params).softmax(dim=-1)


def proposal_probs(logits: torch.Tensor, params: SamplingParams, top_k: int) -> torch.Tensor:
    """An SSM's proposal q: the same warping as the target, then truncated to its top `top_k`.

    Truncating makes q exactly sparse, so it can be sent compactly; exactness only needs the
    verifier to know the q that each draft was really drawn from.
    """
    probs = target_probs(logits, params)
    if 0 < top_k < probs.shape[-1]:
        vals, idx = torch.topk(probs, top_k, dim=-1)
        probs = torch.zeros_like(probs).scatter_(-1, idx, vals)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], params: SamplingParams, num_top: int
                   ) -> list[TokenLogprob]:
    """Each token's logprob, and the `num_top` most likely tokens', under the distribution it was
    drawn from: row i of `logits` (k, V) is the LLM's output where token_ids[i] was chosen.
    Greedy requests get log_softmax of the raw logits; sampled ones, of the warped logits (tokens
    filtered out by top-k / top-p have probability 0 and are never listed as alternatives)."""
    logits = logits.float() if params.is_greedy else warp_logits(logits, params)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    if num_top:
        vals, idx = torch.topk(logp, min(num_top, logp.shape[-1]), dim=-1)
        tops = [tuple((t, v) for t, v in zip(ti, vi) if v != float("-inf")) for ti, vi in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


def make_generator(seed: int | None, stream: int, device="cpu") -> torch.Generator:
    """A per-request RNG. `stream` separates the speculator's and the verifier's draws."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed((int(seed) * 1_000_003 + stream) % (1 << 63))
    return gen
