"""Tiny random-weight Llama checkpoints for tests (no download, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_tiny_llama(
    path: Path,
    *,
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 64,
    max_pos: int = 256,
    tie: bool = False,
    seed: int = 0,
    init_std: float = 0.3,
    rope_scaling: dict | None = None,
    arch: str = "llama",
    attention_bias: bool = False,
    max_shard_size: str | None = None,
    eos_token_id: int | None = 1,
) -> Path:
    """Saves a random LlamaForCausalLM (or Mistral) as an ordinary HF checkpoint directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_pos,
        tie_word_embeddings=tie, initializer_range=init_std, bos_token_id=0, eos_token_id=eos_token_id,
        rms_norm_eps=1e-5,
    )
    if arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
        model = MistralForCausalLM(cfg)
    else:
        if rope_scaling is not None:
            common["rope_scaling"] = rope_scaling
        cfg = LlamaConfig(**common, attention_bias=attention_bias)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norm weights so the norms are really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return Path(path)


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int) -> Path:
    """A copy of a checkpoint with Gaussian noise on every weight: an SSM that mostly agrees."""
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            noisy = {k: (v + noise * v.std() * torch.randn(v.shape, generator=gen)).contiguous() for k, v in tensors.items()}
            save_file(noisy, str(dst / f.name), metadata={"format": "pt"})
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def add_tokenizer(model_dir: Path, vocab: int, corpus: list[str]) -> None:
    """Trains a small byte-level BPE of exactly `vocab` tokens and saves it next to the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() <= vocab, tok.get_vocab_size()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def set_config(model_dir: Path, **updates) -> None:
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(updates)
    cfg_path.write_text(json.dumps(cfg))
