"""The settings of boost-tuning (`specinfer.pool.boost_tune`, `specinfer.pool.boost_data`).

Torch-free, so the command line's parser can show their defaults without loading a model library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specinfer.errors import UserError
from specinfer.limits import MAX_LOGPROBS


@dataclass(frozen=True)
class DataConfig:
    num_prompts: int = 256
    eval_prompts: int = 32
    prompt_tokens: int = 96  # prompts are prompt_tokens // 2 .. prompt_tokens tokens long
    continuation_tokens: int = 64
    sampled_fraction: float = 0.0
    temperature: float = 1.0  # for the sampled continuations
    kl_top_k: int = 0  # 0: no LLM distributions are kept (no KL term)
    eval_fraction: float = 0.1
    gen_batch_size: int = 32
    seed: int = 0

    def __post_init__(self):
        if self.num_prompts < 1 or self.eval_prompts < 1:
            raise UserError("--num-prompts and --eval-prompts must be >= 1")
        if self.prompt_tokens < 2 or self.continuation_tokens < 1:
            raise UserError("--prompt-tokens must be >= 2 and --continuation-tokens >= 1")
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise UserError(f"--sampled-fraction must be in [0, 1], got {self.sampled_fraction}")
        if self.temperature <= 0.0:
            raise UserError(f"--temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise UserError(f"eval fraction must be in (0, 1), got {self.eval_fraction}")
        if not 0 <= self.kl_top_k <= MAX_LOGPROBS or self.gen_batch_size < 1:
            raise UserError(f"--kl-top-k must be in [0, {MAX_LOGPROBS}] (the engine's logprobs give the LLM's "
                            f"top-k), got {self.kl_top_k}; the generation batch size must be >= 1")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    lr: float = 1e-3
    kl_weight: float = 0.0
    warmup_steps: int = 10
    min_lr_factor: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    eval_batch_size: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1 or self.checkpoint_every < 1:
            raise UserError("--steps must be >= 0, --batch-size and --checkpoint-every >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"--lr must be a positive number, got {self.lr}")
        if self.kl_weight < 0:
            raise UserError(f"--kl-weight must be >= 0, got {self.kl_weight}")


@dataclass(frozen=True)
class DraftConfig:
    """The settings of `specinfer make-draft` (`specinfer.pool.make_draft`).

    `minutes` bounds the whole build; of the time left after loading and cutting,
    `data_share` goes to the LLM's teacher data and the rest to distillation.
    """

    minutes: float = 9.0
    layers: str = "2"  # the LLM layers the draft keeps (`make_ssm.parse_layers`)
    mlp_keep: float = 1.0
    data_share: float = 0.6
    prompt_tokens: int = 96  # corpus prompts are prompt_tokens // 2 .. prompt_tokens tokens long
    continuation_tokens: int = 96
    sampled_fraction: float = 0.5  # continuations sampled (the contexts stochastic requests visit)
    temperature: float = 0.7
    kl_top_k: int = 20  # the most the engine's logprobs give (limits.MAX_LOGPROBS)
    kl_weight: float = 1.0
    eval_prompts: int = 16
    gen_batch_size: int = 48
    batch_size: int = 8
    lr: float = 5e-3  # the best of 1e-3, 3e-3, 5e-3 and 1e-2 on SmolLM2 (BENCHMARKS.md)
    max_batches: int = 0  # of teacher data; 0 = as many as the budget allows
    steps: int = 0  # of distillation; 0 = as many as the budget allows
    seed: int = 0
    # Tokens the draft's LM head scores: the LLM's most frequent answer tokens (0 = every token).
    # A draft's pass is mostly its head (the LLM's whole vocabulary against a few layers).
    vocab: int = 16384

    def __post_init__(self):
        if self.vocab < 0:
            raise UserError(f"--vocab must be >= 0 (0 = the whole vocabulary), got {self.vocab}")
        if self.max_batches < 0 or self.steps < 0:
            raise UserError("the batch and step counts must be >= 0 (0 = by the time budget)")
        if not (self.minutes > 0 and math.isfinite(self.minutes)):
            raise UserError(f"--minutes must be a positive number, got {self.minutes}")
        if not 0.0 < self.data_share < 1.0:
            raise UserError(f"the data share must be in (0, 1), got {self.data_share}")
        if self.eval_prompts < 1 or self.gen_batch_size < 1 or self.batch_size < 1:
            raise UserError("the evaluation prompts and batch sizes must be >= 1")
        if self.continuation_tokens < 2:
            raise UserError(f"continuation tokens must be >= 2, got {self.continuation_tokens}")

    def data_config(self) -> DataConfig:
        """The boost-tuning data settings of one batch of teacher data."""
        return DataConfig(num_prompts=self.gen_batch_size, eval_prompts=self.eval_prompts,
                          prompt_tokens=max(2, self.prompt_tokens), continuation_tokens=self.continuation_tokens,
                          sampled_fraction=self.sampled_fraction, temperature=self.temperature,
                          kl_top_k=self.kl_top_k, gen_batch_size=self.gen_batch_size, seed=self.seed)
