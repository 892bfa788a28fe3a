"""What the demo models are: their shapes, vocabulary and training budget.

The LLM is a small Llama with grouped-query attention; the SSMs are much cheaper Llamas of the
same family and tokenizer (SpecInfer, Section 3), each of another shape so that a merged pool is
not redundant. `DemoBudget.full()` is what `specinfer demo-models` builds, `DemoBudget.tiny()` what
the tests build.
"""

from __future__ import annotations

from dataclasses import dataclass
from transformers import LlamaConfig

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")
BOS_ID, EOS_ID = 0, 1


@dataclass(frozen=True)
class ModelShape:
    """Architecture of one Llama model (the vocabulary comes from the tokenizer)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 1024

    def llama_config(self, vocab_size: int):
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=None,
        )


LLM_SHAPE = ModelShape(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=688,
                       tie_word_embeddings=False)
SSM_SHAPES = (
    ModelShape(num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=384,
               tie_word_embeddings=True),
    ModelShape(num_layers=2, hidden_size=96, num_heads=2, num_kv_heads=1, intermediate_size=256,
               tie_word_embeddings=True),
)
TINY_LLM_SHAPE = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
                            tie_word_embeddings=False, max_position_embeddings=256)
TINY_SSM_SHAPES = (
    ModelShape(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64,
               tie_word_embeddings=True, max_position_embeddings=256),
)


@dataclass(frozen=True)
class DemoBudget:
    """How much to train. The i-th SSM has shape ``ssm_shapes[i % len(ssm_shapes)]``."""

    vocab_size: int
    llm_steps: int
    ssm_steps: int
    batch_size: int
    seq_len: int
    num_ssms: int
    llm_lr: float  # AdamW: embeddings, output head, norms
    ssm_lr: float
    muon_lr: float  # Muon: the hidden matrices of every model
    llm_shape: ModelShape
    ssm_shapes: tuple[ModelShape, ...]
    max_train_files: int | None = None  # None = every training file
    num_prompts: int = 32
    prompt_chars: tuple[int, int] = (240, 640)  # min and max prompt length in characters
    eval_windows: int = 32  # held-out windows of seq_len tokens for the loss/agreement report
    warmup_steps: int = 20

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must cover the 256 bytes plus the special tokens")
        if min(self.llm_steps, self.ssm_steps, self.batch_size, self.num_ssms) < 1 or self.seq_len < 8:
            raise ValueError("steps, batch_size and num_ssms must be positive; seq_len at least 8")
        if not self.ssm_shapes:
            raise ValueError("ssm_shapes must not be empty")

    @classmethod
    def full(cls) -> "DemoBudget":
        """What `specinfer demo-models` builds: 4.8 minutes measured on two idle CPU cores.

        Step times there: LLM 0.64 s, distillation of both SSMs 0.36 s. Small batches, many
        steps: at this token budget that beat larger batches at equal compute. Measured result:
        held-out LLM loss 4.27; SSM top-1 agreement with the LLM 65% and 64%, pool 74%.
        """
        return cls(vocab_size=4096, llm_steps=300, ssm_steps=240, batch_size=8, seq_len=256, num_ssms=2,
                   llm_lr=5e-3, ssm_lr=5e-3, muon_lr=0.02, llm_shape=LLM_SHAPE, ssm_shapes=SSM_SHAPES,
                   warmup_steps=20)

    @classmethod
    def tiny(cls) -> "DemoBudget":
        """For tests: valid checkpoints in seconds, quality irrelevant."""
        return cls(vocab_size=512, llm_steps=4, ssm_steps=4, batch_size=4, seq_len=64, num_ssms=2,
                   llm_lr=5e-3, ssm_lr=5e-3, muon_lr=0.02, llm_shape=TINY_LLM_SHAPE, ssm_shapes=TINY_SSM_SHAPES,
                   max_train_files=12, num_prompts=4, eval_windows=2, warmup_steps=1)

    def ssm_shape(self, index: int) -> ModelShape:
        return self.ssm_shapes[index % len(self.ssm_shapes)]
