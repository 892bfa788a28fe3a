"""Model configuration read from a Hugging Face ``config.json``, and the registry of model families.

SpecInfer (arXiv 2305.09781) evaluates LLaMA-family LLMs and SSMs (Section 6); the engine serves
the decoder families users run: one module per family (`llama.py`, `qwen2.py`, `qwen3.py`,
`gemma3.py`, `phi3.py`) turns its config format into this one frozen dataclass, which the one
generic forward (`transformer.DecoderModel`) is parameterised by, so model code never touches
raw JSON. A config picks its family by `architectures`, else by `model_type`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specinfer.engine.models import gemma3, llama, phi3, qwen2, qwen3
from specinfer.engine.models.hf import SLIDING_ATTENTION, Family, RopeConfig, yarn_attention_factor
from specinfer.errors import UserError
from specinfer.model_source import ModelSource, resolve

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY, phi3.FAMILY)
SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeConfig", "family_of", "supported_text",
           "yarn_attention_factor"]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig = field(default_factory=RopeConfig)  # of the full-attention layers
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (and o's, where the checkpoint has one)
    mlp_bias: bool = False
    sliding_window: int | None = None  # keys a sliding-attention layer sees: q - k < window
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    stored_dtype: str = "float32"
    family: str = "llama"
    hidden_act: str = "silu"  # the gate's activation of the gated MLP
    layer_types: tuple[str, ...] = ()  # per layer full_attention | sliding_attention; () = all full
    local_rope: RopeConfig | None = None  # of the sliding-attention layers; None = `rope`
    rotary_dim: int | None = None  # leading dimensions of a head that RoPE rotates; None = all
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w), in fp32 when nonzero (Gemma)
    is_qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    is_sandwich_norm: bool = False  # attention and MLP outputs are normed before the residual add
    embed_scale: float | None = None  # embeddings times this (in the model's dtype)
    query_pre_attn_scalar: float | None = None  # attention scale is its ** -0.5; None: head_dim's
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # A draft's reduced vocabulary (`DRAFT_VOCAB_KEY` in its config.json): the only tokens its LM
    # head scores, sorted; () = every token.
    head_token_ids: tuple[int, ...] = ()

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def attention_window(self) -> int | None:
        """The sliding layers' window, None when no layer is windowed."""
        return self.sliding_window if SLIDING_ATTENTION in self.layer_types else None

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    def layer_rope(self, layer: int) -> RopeConfig:
        return self.local_rope if self.local_rope is not None and self.is_sliding(layer) else self.rope

    @property
    def max_context(self) -> int:
        """The longest sequence the engine runs exactly: the position table's length, or, for
        LongRoPE, the original context whose frequencies the table holds (see `phi3.py`)."""
        if self.rope.rope_type == "longrope" and self.rope.original_max_position_embeddings:
            return min(self.max_position_embeddings, self.rope.original_max_position_embeddings)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes one token's K and V take across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if raw.get("auto_map"):  # its model is defined by code shipped with it, not by this module
            classes = raw["auto_map"]
            named = ", ".join(sorted(map(str, classes.values()))) if isinstance(classes, dict) else str(classes)
            raise UserError(f"config.json has auto_map ({named}): the checkpoint needs its own (remote) model code, "
                            f"which is never run here; supported are standard {supported_text()} checkpoints")
        fam, arch = find_family(raw)
        fields = fam.config_fields(raw, arch)
        if fields["num_heads"] % fields["num_kv_heads"]:
            raise UserError(f"config.json: {fields['num_heads']} attention heads are not a multiple of "
                            f"{fields['num_kv_heads']} KV heads")
        return cls(architecture=arch, family=fam.name, head_token_ids=draft_vocab(raw, fields["vocab_size"]), **fields)

    @classmethod
    def from_dir(cls, model: str | Path | ModelSource) -> "ModelConfig":
        """The config of a checkpoint directory or a GGUF file (`model_source.resolve`)."""
        return cls.from_dict(resolve(model).read_config())


DRAFT_VOCAB_KEY = "specinfer_draft_vocab"  # config.json: the token ids a draft's LM head keeps
# A draft's stored answers (the LLM's own, from its build): int32 "tokens" (concatenated) and
# "lengths"; the suffix member drafts from them (`drafting.suffix`).
DRAFT_ANSWERS_FILE = "answers.safetensors"
DRAFT_RECORD_FILE = "make_draft.json"  # how a draft was built and what it measured (`make_draft`)


def draft_vocab(raw: dict, vocab_size: int) -> tuple[int, ...]:
    """The reduced vocabulary a draft's config names (`DRAFT_VOCAB_KEY`), checked; () when none.
    A draft only proposes tokens, so scoring fewer of them changes what it proposes, never what
    the LLM accepts."""
    ids = raw.get(DRAFT_VOCAB_KEY)
    if ids is None:
        return ()
    if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
            or len(set(ids)) != len(ids)):
        raise UserError(f"config.json: {DRAFT_VOCAB_KEY} must be a non-empty list of distinct token ids "
                        f"in [0, {vocab_size})")
    return tuple(sorted(ids))


def supported_text() -> str:
    """The supported architectures and what they serve, for error messages."""
    return "; ".join(f"{'/'.join(f.architectures)} ({f.covers})" for f in FAMILIES)


def find_family(raw: dict) -> tuple[Family, str]:
    """The family of a raw config and its architecture: `architectures[0]`, else the one its
    `model_type` names."""
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else None
    for fam in FAMILIES:
        if arch is None and raw.get("model_type") in fam.model_types:
            arch = fam.architectures[fam.model_types.index(raw["model_type"])]
        if arch in fam.architectures:
            return fam, arch
    named = arch or f"model_type {raw.get('model_type')!r}"
    raise UserError(f"unsupported architecture {named!r}: supported are {supported_text()}")


def family_of(cfg: ModelConfig) -> Family:
    return next(f for f in FAMILIES if f.name == cfg.family)
