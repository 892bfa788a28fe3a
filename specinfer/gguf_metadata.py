"""A GGUF file's metadata as the files of a Hugging Face checkpoint directory (no torch).

llama.cpp's GGUF format keeps a model's configuration, its tokenizer and its chat template as
key/value metadata under llama.cpp's own names, and its weights as tensors named `blk.N.attn_q`
and so on, quantized in blocks. `read_gguf` turns the metadata into what a checkpoint directory
holds: the transformers config dict (`config.json`, with `architectures`), the tokenizer
transformers builds from the same metadata (`tokenizer.json`), the special tokens, BOS and chat
template (`tokenizer_config.json`) and `generation_config.json`; and it indexes the tensors under
their Hugging Face names (the inverse of gguf's tensor name map for the architecture, as
transformers loads them) with each one's ggml type, shape and byte range in the file, so the
weights are read from the file itself (`specinfer/engine/models/gguf.py`) without its header
being parsed again. Those files are written once per file (`specinfer.model_source`).

Torch-free: the gateway reads a GGUF's tokenizer and chat template through this module too.
Speculative decoding (SpecInfer, arXiv 2305.09781) needs nothing GGUF-specific beyond this: an
LLM or SSM given as a GGUF is dequantized once at load time and then is an ordinary model.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specinfer.errors import UserError

log = logging.getLogger(__name__)

# general.architecture -> (the transformers class in config.json's `architectures`, model_type).
# Mistral's GGUF files say "llama": llama.cpp converts them as Llama models.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}

# ggml tensor types that are dequantized at load time: plain floats, the legacy block quants, the
# K-quants, and the i-quants and ternary types gguf-py implements.
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
               "TQ1_0", "TQ2_0")
SUPPORTED_TYPES = FLOAT_TYPES + QUANT_TYPES

_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# Each family's per-layer modules under their transformers names (each with .weight, maybe .bias).
LAYER_MODULES = {
    "llama": _ATTN + _MLP + _NORMS,
    "qwen2": _ATTN + _MLP + _NORMS,
    "qwen3": _ATTN + _QK_NORMS + _MLP + _NORMS,
    "gemma3": _ATTN + _QK_NORMS + _MLP + _NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "phi3": ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj") + _NORMS,
}
TOP_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# Tensors that carry configuration rather than weights: read into the config, not loaded.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
INDEX_FILE = "gguf_tensors.json"
SHARD_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: its Hugging Face and GGUF names, ggml type, shape in torch order
    (rows first) and where its bytes are in the file."""

    name: str
    gguf_name: str
    ggml_type: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class GGUFMetadata:
    """What `read_gguf` finds in a file, as checkpoint-directory files (`write_files`)."""

    architecture: str
    config: dict
    tokenizer_json: str | None  # None: the file has no tokenizer metadata that converts
    tokenizer_config: dict
    generation_config: dict
    tensors: tuple[TensorEntry, ...]

    def write_files(self, out_dir: Path) -> None:
        def dump(name: str, obj) -> None:
            (out_dir / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")

        dump("config.json", self.config)
        dump("tokenizer_config.json", self.tokenizer_config)
        dump("generation_config.json", self.generation_config)
        dump(INDEX_FILE, {"architecture": self.architecture, "tensors": [asdict(t) for t in self.tensors]})
        if self.tokenizer_json is not None:
            (out_dir / "tokenizer.json").write_text(self.tokenizer_json, encoding="utf-8")


def read_tensor_index(meta_dir: Path) -> tuple[str, tuple[TensorEntry, ...]]:
    """(architecture, tensors) as `GGUFMetadata.write_files` wrote them."""
    raw = json.loads((Path(meta_dir) / INDEX_FILE).read_text())
    return raw["architecture"], tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in raw["tensors"])


def is_gguf_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def read_gguf(path: Path) -> GGUFMetadata:
    """The metadata of a one-file GGUF of a supported architecture; UserError otherwise."""
    from gguf import GGUFReader  # gguf: only for a .gguf file

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:  # a bad magic, version, or a truncated file
        raise UserError(f"{path} is not a readable GGUF file: {exc}") from None
    if reader.byte_order != "I":
        raise UserError(f"{path} is a GGUF of the other byte order (big-endian); only little-endian files load")
    values = _field_values(reader)
    split_count = int(values.get("split.count", 1) or 1)
    if split_count > 1:
        raise UserError(f"{path} is one shard of a GGUF split into {split_count} files; merge them into one "
                        "first (llama.cpp: llama-gguf-split --merge FIRST-SHARD OUT.gguf)")
    arch = values.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: unsupported GGUF architecture {arch!r}; supported are {', '.join(ARCHITECTURES)} "
                        "(Llama 1/2/3, SmolLM, TinyLlama and Mistral GGUFs say llama)")
    gguf_tensors = {t.name: t for t in reader.tensors}
    tensors = _index_tensors(path, arch, values, gguf_tensors)
    config = hf_config(arch, values, gguf_tensors, tensors)
    tokenizer_json, tokenizer_config = _tokenizer(path, arch, values)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    return GGUFMetadata(arch, config, tokenizer_json, tokenizer_config, generation, tensors)


def _field_values(reader) -> dict:
    """Every metadata key with its value (arrays as lists, strings decoded)."""
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except (UnicodeDecodeError, ValueError):  # a value that is not text where text is expected
            log.warning("GGUF metadata %s could not be read; ignored", key)
    return out


def _index_tensors(path: Path, arch: str, values: dict, gguf_tensors: dict) -> tuple[TensorEntry, ...]:
    """The file's weights under their transformers names; UserError naming a tensor whose ggml
    type is not dequantized here."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map  # gguf: as in read_gguf

    num_layers = int(values[f"{arch}.block_count"])
    model_arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    name_map = get_tensor_name_map(model_arch, num_layers)
    modules = list(TOP_MODULES) + [f"model.layers.{i}.{m}" for i in range(num_layers) for m in LAYER_MODULES[arch]]
    to_hf = {}
    for module in modules:
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            to_hf[gguf_name + ".weight"] = module + ".weight"
            to_hf[gguf_name + ".bias"] = module + ".bias"
    entries, ignored = [], []
    for gguf_name, t in gguf_tensors.items():
        if gguf_name not in to_hf:
            if gguf_name not in CONFIG_TENSORS:
                ignored.append(gguf_name)
            continue
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise UserError(f"{path}: tensor {gguf_name!r} has ggml type {type_name}, which is not supported; "
                            f"supported are {', '.join(SUPPORTED_TYPES)}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        entries.append(TensorEntry(to_hf[gguf_name], gguf_name, type_name, shape, int(t.data_offset), int(t.n_bytes)))
    if ignored:
        log.warning("%s: %d tensors not used by the %s model are ignored: %s", path, len(ignored), arch,
                    ", ".join(ignored[:5]))
    return tuple(entries)


# ---- the config ----------------------------------------------------------------------------------


def hf_config(arch: str, values: dict, gguf_tensors: dict, tensors: tuple[TensorEntry, ...]) -> dict:
    """The transformers config dict of the file, as transformers builds it from the same keys,
    plus what the file states that transformers' mapping leaves to its class defaults (head_dim
    from attention.key_length, Gemma 3's window pattern, local RoPE base and query scaling, RoPE
    scaling, Llama 3's frequency factors)."""
    def key(name: str, default=None):
        return values.get(f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UserError(f"{arch} GGUF with per-layer KV head counts is not supported")
    hidden = int(key("embedding_length"))
    tokens = values.get("tokenizer.ggml.tokens") or []
    hf_arch, model_type = ARCHITECTURES[arch]
    names = {t.name for t in tensors}
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        # the embedding's rows where the file does not say: a tokenizer may name fewer tokens
        "vocab_size": int(key("vocab_size") or _rows(tensors, "model.embed_tokens.weight") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(key("attention.key_length") or (arch == "llama" and key("rope.dimension_count"))
                        or hidden // heads),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in gguf_tensors,
        "dtype": _stored_dtype(tensors),
        **_special_token_ids(values),
    }
    rope = {"rope_theta": float(key("rope.freq_base", 10000.0)), "rope_type": "default", **_rope_scaling(key)}
    extra = _FAMILY_CONFIG[arch](key, config, rope, gguf_tensors, names)
    if arch in ("qwen2", "phi3"):  # their configs have no head_dim: it is hidden_size / heads
        config.pop("head_dim")
    return {**config, **extra}


def _rows(tensors, name: str) -> int:
    return next((t.shape[0] for t in tensors if t.name == name), 0)


def _stored_dtype(tensors) -> str:
    """What the weights are stored as: a float type, or float32 for dequantized blocks."""
    types = {t.ggml_type for t in tensors}
    if not types <= set(FLOAT_TYPES):
        return "float32"
    return "bfloat16" if "BF16" in types else "float16" if "F16" in types else "float32"


def _special_token_ids(values: dict) -> dict:
    """bos/pad/unk as the file states them; EOS with llama.cpp's end-of-turn and end-of-message
    tokens where the file names them, since generation ends at those as it does at EOS."""
    ids = {name: values.get(f"tokenizer.ggml.{key}")
           for name, key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id"),
                             ("unk_token_id", "unknown_token_id"))}
    eos = [values.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    ids["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    return {k: (int(v) if isinstance(v, int) else v) for k, v in ids.items() if v is not None}


def _rope_scaling(key) -> dict:
    """`{arch}.rope.scaling.*` as transformers' rope parameters (linear and YaRN)."""
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    out = {"rope_type": kind, "factor": float(key("rope.scaling.factor", 1.0))}
    original = key("rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        for name, gguf_name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                                ("attention_factor", "attn_factor")):
            if key(f"rope.scaling.{gguf_name}") is not None:
                out[name] = float(key(f"rope.scaling.{gguf_name}"))
    return out


def _llama_config(key, config, rope, gguf_tensors, names) -> dict:
    if "rope_freqs.weight" in gguf_tensors:  # Llama 3.1+: llama.cpp stores the llama3 rope factors
        rope = {**rope, **llama3_rope(np.asarray(gguf_tensors["rope_freqs.weight"].data, dtype=np.float64),
                                      rope["rope_theta"], config["head_dim"])}
    return {"hidden_act": "silu", "rope_parameters": rope,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in names,
            "mlp_bias": "model.layers.0.mlp.gate_proj.bias" in names}


def _qwen2_config(key, config, rope, gguf_tensors, names) -> dict:
    return {"hidden_act": "silu", "rope_parameters": rope, "use_sliding_window": False}


def _qwen3_config(key, config, rope, gguf_tensors, names) -> dict:
    return {**_qwen2_config(key, config, rope, gguf_tensors, names),
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in names}


def _gemma3_config(key, config, rope, gguf_tensors, names) -> dict:
    """Gemma 3 text: local (sliding) and global layers with their own RoPE bases. llama.cpp
    writes neither the pattern nor the local base (it fixes them at every 6th layer global and
    10000, as Gemma 3 is) nor the query scaling (1/sqrt(head_dim), or 1/sqrt(hidden/heads) for
    the 27B model), unless a newer converter states them."""
    num_layers = config["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: is it sliding?
        layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
        pattern = next((i + 1 for i, s in enumerate(pattern) if not s), num_layers)
    else:
        layer_types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                       for i in range(num_layers)]
    is_27b = config["hidden_size"] == 5376 and config["num_attention_heads"] == 32
    local = {"rope_theta": float(key("rope.freq_base_swa", 10000.0)), "rope_type": "default"}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]) if is_27b
        else config["head_dim"],
        "sliding_window": int(key("attention.sliding_window", 4096)),
        "_sliding_window_pattern": int(pattern),
        "layer_types": layer_types,
        "rope_parameters": {"full_attention": rope, "sliding_attention": local},
        "final_logit_softcapping": key("final_logit_softcapping"),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "attention_bias": False,
        "use_bidirectional_attention": False,
    }


def _phi3_config(key, config, rope, gguf_tensors, names) -> dict:
    """Phi-3: partial rotary where rope.dimension_count is below head_dim; LongRoPE's factors
    are stored as tensors (rope_factors_long/short)."""
    out = {"hidden_act": "silu", "rope_parameters": rope}
    rotary = key("rope.dimension_count")
    if rotary and int(rotary) != config["head_dim"]:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"] = int(rotary) / config["head_dim"]
    if key("attention.sliding_window"):
        out["sliding_window"] = int(key("attention.sliding_window"))
    if "rope_factors_long.weight" in gguf_tensors:
        rope.update(rope_type="longrope",
                    long_factor=[float(x) for x in np.asarray(gguf_tensors["rope_factors_long.weight"].data)],
                    short_factor=[float(x) for x in np.asarray(gguf_tensors["rope_factors_short.weight"].data)])
        rope.pop("factor", None)
        original = key("rope.scaling.original_context_length")
        if original:
            out["original_max_position_embeddings"] = int(original)
            rope.pop("original_max_position_embeddings", None)
    return out


_FAMILY_CONFIG = {"llama": _llama_config, "qwen2": _qwen2_config, "qwen3": _qwen3_config,
                  "gemma3": _gemma3_config, "phi3": _phi3_config}


def llama3_rope(freqs: np.ndarray, theta: float, head_dim: int) -> dict:
    """The llama3 RoPE scaling parameters whose per-frequency divisors are `freqs` (the
    `rope_freqs` tensor llama.cpp writes instead of the parameters); UserError when no standard
    setting gives them."""
    factor = float(freqs.max())
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    for original, low, high in ((8192, 1.0, 4.0), (4096, 1.0, 4.0), (8192, 1.0, 8.0)):
        smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
        expected = np.where(wavelen < original / high, 1.0,
                            np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
        if expected.shape == freqs.shape and np.allclose(expected, freqs, rtol=1e-5, atol=1e-6):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise UserError("the GGUF's rope_freqs tensor is not a llama3 RoPE scaling this loader recognises")


# ---- the tokenizer -------------------------------------------------------------------------------


def _tokenizer(path: Path, arch: str, values: dict) -> tuple[str | None, dict]:
    """(tokenizer.json text, tokenizer_config) as transformers builds them from the same
    metadata: its converter for the tokenizer, its post-processor for BOS/EOS."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING  # transformers: GGUF only

    def group(name: str) -> dict:
        return {hf: values[f"tokenizer.{k}"] for k, hf in GGUF_TOKENIZER_MAPPING[name].items()
                if f"tokenizer.{k}" in values}

    tokenizer_dict, cfg = group("tokenizer"), group("tokenizer_config")
    tokens = tokenizer_dict.get("tokens")
    if not tokens:
        return None, cfg
    if tokenizer_dict.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to sentencepiece vocabularies
        cfg.setdefault("add_bos_token", True)
    cfg.setdefault("add_bos_token", False)
    cfg.setdefault("add_eos_token", False)
    for name, k in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                    ("pad_token", "padding_token_id")):
        token_id = values.get(f"tokenizer.ggml.{k}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            cfg[name] = tokens[int(token_id)]
    try:
        return _convert_tokenizer(arch, tokenizer_dict, cfg), cfg
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s: its tokenizer (%s) does not convert: %s", path, tokenizer_dict.get("tokenizer_type"), exc)
        return None, cfg


def _convert_tokenizer(arch: str, tokenizer_dict: dict, cfg: dict) -> str:
    from tokenizers import processors  # tokenizers: as in _tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer  # transformers: GGUF only

    tok, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    # transformers' tokenizer classes set this post-processor from add_bos_token / add_eos_token
    bos, eos = cfg.get("bos_token"), cfg.get("eos_token")
    add_bos, add_eos = bool(cfg["add_bos_token"] and bos), bool(cfg["add_eos_token"] and eos)
    if not (add_bos or add_eos):
        return tok.to_str()
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = ([(bos, tok.token_to_id(bos))] if add_bos else []) + ([(eos, tok.token_to_id(eos))] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    return tok.to_str()
