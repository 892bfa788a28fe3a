"""Sampling: the logits warping that defines the LLM's target distribution, and the noise every
sampled token is drawn with.

SpecInfer's stochastic verification (Section 4.3) guarantees the output follows the LLM's
distribution. With temperature, top-k and top-p, that distribution is the *warped* one; this
module defines it once, applied in the same order as Hugging Face's generate (temperature, then
top-k, then top-p, then min-p), after the logits processors (`processors`), and both the verifier and plain incremental sampling use it.

A sampled token is the Gumbel-max of the warped logits, argmax(warped - log E) with E ~ Exp(1)
per vocabulary entry, and E is fixed by the request's seed and the token's position alone
(`SamplingNoise`). So a request's output is a function of its seed and prompt: the same whether
it was decoded plainly or speculated, with whatever trees, in whatever batch, resumed or not.
And the token at position t is an exact sample of the LLM's distribution given the tokens
before it, since its noise is independent of theirs. Drafters use the same noise (their
children are the Gumbel-max of their own distribution), so a draft matches the LLM's sample
as often as the two distributions' coupling allows; verification keeps a draft exactly when it
is the LLM's sample (`verify.verify_tree`).
"""

from __future__ import annotations

import os

import torch

from specinfer.logprobs import TokenLogprob
from specinfer.params import SamplingParams


def first_max(rows: torch.Tensor) -> list[int]:
    """The index of each row's largest value (the first, on ties), as `argmax` gives it: torch's
    max over the last dimension, which a CPU computes in about half argmax's time over a
    vocabulary (a tree step takes one per node)."""
    return rows.max(dim=-1).indices.tolist()


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Applies temperature, top-k, top-p and min-p to (n, V) logits; filtered entries become -inf."""
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
    if params.min_p > 0.0:  # below min_p x the most likely token's probability (never that token)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling must follow: softmax of the warped logits, (n, V) fp32."""
    return warp_logits(logits, params).softmax(dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], params: SamplingParams, num_top: int
                   ) -> list[TokenLogprob]:
    """Each token's logprob, and the `num_top` most likely tokens', under the distribution it was
    drawn from: row i of `logits` (k, V) is the LLM's output where token_ids[i] was chosen.
    `logits` are already processed (`processors`: a grammar's mask, bias, penalties). Greedy
    requests get their log_softmax; sampled ones, that of the warped logits (tokens filtered out
    by the grammar, top-k, top-p or min-p have probability 0 and are never listed as alternatives)."""
    logits = logits.float() if params.is_greedy else warp_logits(logits, params)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    if num_top:
        vals, idx = torch.topk(logp, min(num_top, logp.shape[-1]), dim=-1)
        tops = [tuple((t, v) for t, v in zip(ti, vi) if v != float("-inf")) for ti, vi in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


def fresh_seed() -> int:
    """A random seed for a sampled request that names none (the noise needs one)."""
    return int.from_bytes(os.urandom(8), "little") % (1 << 63)


_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64's finalizer, so nearby seeds and
    positions give unrelated streams."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(position) * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class SamplingNoise:
    """One request's sampling noise: per token position, log E over the vocabulary with E ~ Exp(1),
    drawn from a generator seeded by (seed, position). The most recent positions are kept (a
    step's tree reaches positions the next step reads again)."""

    def __init__(self, seed: int, vocab_size: int, device="cpu", num_kept: int = 64):
        self.seed, self.vocab_size, self.device, self.num_kept = int(seed), vocab_size, device, num_kept
        self._rows: dict[int, torch.Tensor] = {}

    def row(self, position: int) -> torch.Tensor:
        row = self._rows.get(position)
        if row is None:
            gen = torch.Generator().manual_seed(_mix(self.seed, position))
            uniform = torch.rand(self.vocab_size, generator=gen).clamp_(min=1e-30, max=1 - 2 ** -24)
            row = uniform.log_().neg_().log_().to(self.device)
            if len(self._rows) >= self.num_kept:
                del self._rows[min(self._rows)]
            self._rows[position] = row
        return row

    def rows(self, positions: list[int]) -> torch.Tensor:
        """(len(positions), V): the noise of each position; (1, V) when they are all one."""
        if all(p == positions[0] for p in positions):
            return self.row(positions[0]).unsqueeze(0)
        return torch.stack([self.row(p) for p in positions])


def perturbed(warped: torch.Tensor, noise: SamplingNoise, positions: list[int]) -> torch.Tensor:
    """Warped logits (n, V) minus the noise of the positions they sample: their argmax is the
    sampled token (Gumbel-max), their order the drafts' (Gumbel-top-k)."""
    return warped - noise.rows(positions).to(warped.device)


def sample(logits: torch.Tensor, params: SamplingParams, noise: SamplingNoise, positions: list[int]) -> list[int]:
    """The sampled token of each row of (n, V) logits, row i sampling the token at positions[i]."""
    return first_max(perturbed(warp_logits(logits, params), noise, positions))
