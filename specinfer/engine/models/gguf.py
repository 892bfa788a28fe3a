"""The weights of a GGUF file, dequantized to the compute dtype under their Hugging Face names.

`specinfer.gguf_metadata` indexes a file's tensors once (HF name, ggml type, shape, byte range);
here each is read from the file through a read-only memory map, dequantized with gguf-py
(`gguf.quants.dequantize`: the legacy block quants, the K-quants, the i-quants; F16 and BF16 are
taken as they are), given the fixes transformers' GGUF loader applies, and cast to the dtype the
model computes in, one tensor at a time. The fixes undo what llama.cpp's converter did:

- llama: the rows of attn_q and attn_k were permuted for ggml's interleaved RoPE; they are
  permuted back (per head for q, per KV head for k).
- gemma3: ggml's RMSNorm multiplies by its weight where Gemma's multiplies by (1 + weight), so
  every norm weight was stored plus one; one is subtracted (in float32, as transformers does).

The result is an ordinary state dict, so a GGUF model runs the same forward as a checkpoint
directory and speculative decoding (SpecInfer, arXiv 2305.09781) keeps its exactness guarantee
with respect to the dequantized model.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as dequantize_blocks, quant_shape_to_byte_shape

from specinfer.errors import UserError
from specinfer.gguf_metadata import FLOAT_TYPES, TensorEntry, read_tensor_index
from specinfer.model_source import ModelSource
from specinfer.util import progress_bar


class GGUFTensors:
    """A GGUF's tensors with the interface of safetensors' `safe_open` handle (`keys`,
    `get_tensor`, `get_slice`), each dequantized when asked for. A progress bar on stderr counts
    them while stderr is a terminal."""

    def __init__(self, source: ModelSource, dtype: torch.dtype | None = None, is_progress: bool | None = None):
        self.source = source
        self.dtype = dtype
        self.arch, entries = read_tensor_index(source.meta_dir)
        self.entries: dict[str, TensorEntry] = {e.name: e for e in entries}
        self.config = json.loads(source.config_file.read_text())
        self.data = np.memmap(source.gguf_file, dtype=np.uint8, mode="r")
        enabled = sys.stderr.isatty() if is_progress is None else is_progress
        self.bar = progress_bar(len(entries), f"dequantizing {source.path.name}", enabled)

    def __enter__(self) -> "GGUFTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.bar.close()
        self.data = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        raw = self.data[entry.offset:entry.offset + entry.num_bytes]
        if len(raw) != entry.num_bytes:
            raise UserError(f"{self.source.path} is truncated: tensor {entry.gguf_name!r} ends past the end of the "
                            "file")
        tensor = fix_tensor(self.arch, name, dequantize(raw, entry), self.config)
        self.bar.update(1)
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def get_slice(self, name: str) -> "_Slice":
        return _Slice(self, name)


class _Slice:
    """`get_slice(name)[rows]`, as safetensors offers it: the whole tensor is dequantized (blocks
    span columns), then only the slice is kept."""

    def __init__(self, tensors: GGUFTensors, name: str):
        self.tensors, self.name = tensors, name

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensors.get_tensor(self.name)[index].clone()


def dequantize(raw: np.ndarray, entry: TensorEntry) -> torch.Tensor:
    """One tensor's bytes as a tensor of `entry.shape`: F32, F16 and BF16 as stored, every block
    type as float32."""
    shape = entry.shape
    if entry.ggml_type in FLOAT_TYPES:
        np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[entry.ggml_type]
        tensor = torch.from_numpy(np.array(raw.view(np_dtype)).reshape(shape))
        return tensor.view(torch.bfloat16) if entry.ggml_type == "BF16" else tensor
    qtype = GGMLQuantizationType[entry.ggml_type]
    blocks = np.asarray(raw).reshape(quant_shape_to_byte_shape(shape, qtype))
    return torch.from_numpy(np.ascontiguousarray(dequantize_blocks(blocks, qtype)).reshape(shape))


def fix_tensor(arch: str, name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
    """Undoes llama.cpp's conversion of one tensor (see the module docstring)."""
    if arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return unpermute_rope(tensor, config["num_attention_heads"])
    if arch == "llama" and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return unpermute_rope(tensor, config["num_key_value_heads"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        return tensor.float() - 1
    return tensor


def unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's `permute` of q/k rows: per head, the rows that rotate
    together come back as first half / second half, as Hugging Face's RoPE pairs them."""
    head_rows = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, head_rows, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
