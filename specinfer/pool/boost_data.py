"""Training data for collective boost-tuning: corpus prompts and the LLM's own continuations.

SpecInfer (arXiv 2305.09781, Section 3, "collective boost-tuning") tunes the SSM pool without
labels: take prompts from a corpus, let the LLM generate continuations, and train the SSMs to
reproduce the LLM. This module builds that data, deterministically from a seed:

1. **Prompts.** Every corpus file is tokenized with the LLM's tokenizer and split by position: the
   first ``1 - eval_fraction`` of its tokens can give training prompts, the rest held-out
   (evaluation) prompts, so the "before/after" agreement is measured on text no SSM trained on.
   A prompt is a window that starts at a line start, ``prompt_tokens // 2 ..  prompt_tokens``
   tokens long, in a file drawn in proportion to its size.
2. **Continuations.** The LLM continues every prompt with the engine (`Engine.generate_batch`,
   many requests in lockstep): greedily, or, for a seeded ``sampled_fraction`` of the prompts,
   by sampling at ``temperature`` (the contexts a stochastic request visits).
3. **Targets.** At each continuation position the target is the LLM's top-1 token there: for a
   greedy continuation that is the next continuation token itself; for a sampled one (and for
   the top ``kl_top_k`` probabilities of a KL term) they come with the generation, from the
   logprobs the engine computes from the logits it already has, so no second LLM pass re-reads
   the text.

`BoostData` holds the result as padded tensors and round-trips through safetensors.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence

import torch

from specinfer.errors import UserError
from specinfer.pool.tuning_config import DataConfig
from specinfer.util import progress_bar
from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.logprobs import TokenLogprob
from specinfer.params import SamplingParams

PAD_ID = 0


@dataclass
class BoostData:
    """Padded sequences (prompt + LLM continuation) and the LLM's targets.

    Position j of a row is the prediction of token j + 1; `mask[n, j]` marks the continuation
    positions (prompt_len - 1 <= j <= length - 2), the only ones trained and evaluated.
    """

    tokens: torch.Tensor  # (N, L) long, PAD_ID after `lengths`
    lengths: torch.Tensor  # (N,) long
    targets: torch.Tensor  # (N, L) long: the LLM's top-1 at each position (0 outside the mask)
    mask: torch.Tensor  # (N, L) bool
    sampled: torch.Tensor  # (N,) bool: continuation sampled (True) or greedy
    topk_ids: torch.Tensor  # (N, L, K) long; K = 0 without KL
    topk_probs: torch.Tensor  # (N, L, K) float32

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_positions(self) -> int:
        return int(self.mask.sum())

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{f.name}": getattr(self, f.name).contiguous() for f in fields(self)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "BoostData":
        return cls(**{f.name: tensors[f"{prefix}.{f.name}"] for f in fields(cls)})


# ---- corpus and prompts ----------------------------------------------------------------------


def read_corpus(paths: Sequence[str | Path], exclude: Sequence[str | Path] = ()) -> list[Path]:
    """Corpus files: given files, plus every ``*.py`` under given directories; sorted, deduplicated."""
    excluded = {Path(p).resolve() for p in exclude}
    files: set[Path] = set()
    for p in map(Path, paths):
        if p.is_dir():
            files.update(f.resolve() for f in p.rglob("*.py") if f.is_file())
        elif p.is_file():
            files.add(p.resolve())
        else:
            raise UserError(f"corpus path not found: {p}")
    out = sorted(f for f in files if f not in excluded)
    if not out:
        raise UserError("the corpus is empty (no files left after exclusions)")
    return out


def newline_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokens whose text ends a line: a prompt may start right after one."""
    tok = tokenizer.tok
    return frozenset(i for i in range(tok.get_vocab_size()) if tok.decode([i]).endswith("\n"))


@dataclass(frozen=True)
class _Region:
    ids: list[int]
    starts: list[int]  # line-start offsets inside the region with room for a shortest prompt


def split_regions(token_lists: Sequence[list[int]], newline_ids: frozenset[int], eval_fraction: float,
                  min_len: int) -> tuple[list[_Region], list[_Region]]:
    """Each file's tokens cut at `1 - eval_fraction`: (training regions, evaluation regions)."""
    train, evals = [], []
    for ids in token_lists:
        cut = int(len(ids) * (1 - eval_fraction))
        for part, out in ((ids[:cut], train), (ids[cut:], evals)):
            starts = [0] + [i + 1 for i, t in enumerate(part) if t in newline_ids]
            starts = [s for s in starts if s + min_len <= len(part)]
            if starts:
                out.append(_Region(part, starts))
    return train, evals


def draw_prompts(regions: Sequence[_Region], count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """`count` prompts: a region in proportion to its size, a line start, a length in [min_len, max_len]."""
    if not regions:
        raise UserError(f"no corpus file is long enough for prompts of {min_len} tokens")
    rng = random.Random(seed)
    cumulative, total = [], 0
    for r in regions:
        total += len(r.ids)
        cumulative.append(total)
    prompts = []
    for _ in range(count):
        region = regions[bisect.bisect_right(cumulative, rng.randrange(total))]
        start = region.starts[rng.randrange(len(region.starts))]
        length = min(rng.randint(min_len, max_len), len(region.ids) - start)
        prompts.append(region.ids[start : start + length])
    return prompts


# ---- the LLM's continuations and targets -----------------------------------------------------


def generate_continuations(engine, prompts: Sequence[list[int]], cfg: DataConfig, seed: int,
                           progress: bool) -> tuple[list[list[int]], list[bool], list[list[TokenLogprob]]]:
    """The LLM's continuation of every prompt (greedy, or sampled for a seeded subset), and the
    logprobs the engine computed with each token, where the targets need them (a sampled
    continuation, or any when a KL term is wanted; empty otherwise)."""
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    sampled = set(order[: round(cfg.sampled_fraction * len(prompts))])
    outputs: list[list[int]] = []
    logprobs: list[list[TokenLogprob]] = []
    with progress_bar(len(prompts), "LLM continuations", progress) as bar:
        for lo in range(0, len(prompts), cfg.gen_batch_size):
            requests = []
            for n in range(lo, min(lo + cfg.gen_batch_size, len(prompts))):
                num_top = max(1, cfg.kl_top_k) if (cfg.kl_top_k or n in sampled) else None
                params = (SamplingParams(temperature=cfg.temperature, seed=seed * 100_003 + n)
                          if n in sampled else SamplingParams())
                requests.append(engine.start(list(prompts[n]), mode_params(
                    "incremental", cfg.continuation_tokens, sampling=params, num_logprobs=num_top)))
            for r in engine.generate_batch(requests):
                outputs.append(r.output_ids)
                logprobs.append(r.output_logprobs)
            bar.update(len(requests))
    return outputs, [n in sampled for n in range(len(prompts))], logprobs


def targets_for(prompts: Sequence[list[int]], continuations: Sequence[list[int]], sampled: Sequence[bool],
                logprobs: Sequence[Sequence[TokenLogprob]], top_k: int, temperature: float
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The LLM's targets per sequence, (top-1 ids, top-k ids, top-k probabilities) per position,
    from the generation itself: no second pass of the LLM. A greedy continuation is the LLM's top-1
    at every position. Otherwise the engine's logprobs give them: a greedy token's are the raw
    distribution's; a sampled token's are of the distribution it was drawn from (logits / T), the
    same order, and T * logprob is the raw log-probability up to a constant, so the raw top-k,
    renormalised (what the KL term uses), is softmax(T * logprobs)."""
    out = []
    for p, c, was_sampled, lps in zip(prompts, continuations, sampled, logprobs):
        top1 = torch.tensor(list(p[1:]) + list(c) + [PAD_ID], dtype=torch.long)  # row j predicts token j + 1
        ids = torch.zeros(len(top1), top_k, dtype=torch.long)
        probs = torch.zeros(len(top1), top_k)
        if was_sampled or top_k:
            if len(lps) != len(c):
                raise RuntimeError(f"the engine returned {len(lps)} logprobs for {len(c)} tokens")
            span = slice(len(p) - 1, len(p) - 1 + len(c))
            if was_sampled:
                top1[span] = torch.tensor([lp.top[0][0] for lp in lps])
            if top_k:  # every token's alternatives, padded to k with probability 0 (a tiny vocabulary)
                width = [len(lp.top[:top_k]) for lp in lps]
                ids[span] = torch.tensor([[t for t, _ in lp.top[:top_k]] + [0] * (top_k - n)
                                          for lp, n in zip(lps, width)])
                values = torch.tensor([[v for _, v in lp.top[:top_k]] + [-math.inf] * (top_k - n)
                                       for lp, n in zip(lps, width)], dtype=torch.float64)
                values = torch.softmax(values * temperature, -1) if was_sampled else values.exp()
                probs[span] = values.float()
        out.append((top1, ids, probs))
    return out


def assemble(prompts: Sequence[list[int]], continuations: Sequence[list[int]], sampled: Sequence[bool],
             scores: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], top_k: int) -> BoostData:
    n = len(prompts)
    width = max(len(p) + len(c) for p, c in zip(prompts, continuations))
    data = BoostData(
        tokens=torch.full((n, width), PAD_ID, dtype=torch.long),
        lengths=torch.zeros(n, dtype=torch.long),
        targets=torch.zeros(n, width, dtype=torch.long),
        mask=torch.zeros(n, width, dtype=torch.bool),
        sampled=torch.tensor(list(sampled), dtype=torch.bool),
        topk_ids=torch.zeros(n, width, top_k, dtype=torch.long),
        topk_probs=torch.zeros(n, width, top_k, dtype=torch.float32),
    )
    for i, (p, c, (top1, ids, probs)) in enumerate(zip(prompts, continuations, scores)):
        seq = list(p) + list(c)
        length, first, last = len(seq), len(p) - 1, len(seq) - 1  # positions first .. last - 1
        data.tokens[i, :length] = torch.tensor(seq)
        data.lengths[i] = length
        data.mask[i, first:last] = True
        data.targets[i, first:last] = top1[first:last]
        if top_k:
            data.topk_ids[i, first:last] = ids[first:last]
            data.topk_probs[i, first:last] = probs[first:last]
    return data


def build_data(llm_runner, tokenizer, corpus: Sequence[Path], cfg: DataConfig,
               progress: bool = True) -> tuple[BoostData, BoostData]:
    """(training data, held-out evaluation data) for the LLM in `llm_runner`."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in corpus]
    token_lists = [enc.ids for enc in tokenizer.tok.encode_batch(texts, add_special_tokens=False)]
    min_len = max(1, cfg.prompt_tokens // 2)
    train_regions, eval_regions = split_regions(token_lists, newline_token_ids(tokenizer), cfg.eval_fraction, min_len)
    engine = Engine.from_runners(llm_runner)
    out = []
    for split, regions, count in (("train", train_regions, cfg.num_prompts), ("eval", eval_regions, cfg.eval_prompts)):
        seed = cfg.seed * 2 + (split == "eval")
        prompts = draw_prompts(regions, count, min_len, cfg.prompt_tokens, seed)
        continuations, sampled, logprobs = generate_continuations(engine, prompts, cfg, seed, progress)
        scores = targets_for(prompts, continuations, sampled, logprobs, cfg.kl_top_k, cfg.temperature)
        out.append(assemble(prompts, continuations, sampled, scores, cfg.kl_top_k))
    return out[0], out[1]
