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
with respect to the dequantized model. A float32 tensor dequantized from the block types whose
every element is one fused multiply-add of an integer code (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K) also carries those codes as `block_codes` (`layers.cpu_gemm.BlockCodes`): the CPU
kernel multiplies by them directly, and gets the very same float32 elements from a third of the
bytes.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize as dequantize_blocks, quant_shape_to_byte_shape

from specinfer.engine.layers import cpu_gemm
from specinfer.engine.layers.cpu_gemm import BlockCodes
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
        return tensor if self.dtype is None else tensor.to(self.dtype)  # the same tensor, codes kept, in float32

    def get_slice(self, name: str) -> "_Slice":
        return _Slice(self, name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name].shape)


class _Slice:
    """`get_slice(name)[rows]`, as safetensors offers it: the whole tensor is dequantized (blocks
    span columns), then only the slice is kept."""

    def __init__(self, tensors: GGUFTensors, name: str):
        self.tensors, self.name = tensors, name

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensors.get_tensor(self.name)[index].clone()


def dequantize(raw: np.ndarray, entry: TensorEntry) -> torch.Tensor:
    """One tensor's bytes as a tensor of `entry.shape`: F32, F16 and BF16 as stored, every block
    type as float32. A block type's rows are dequantized (and their codes taken) a few million
    elements at a time, into the result: gguf-py's arithmetic makes several temporaries the size
    of its input, which for a whole embedding would take several times the result's memory."""
    shape = entry.shape
    if entry.ggml_type in FLOAT_TYPES:
        np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[entry.ggml_type]
        tensor = torch.from_numpy(np.array(raw.view(np_dtype)).reshape(shape))
        return tensor.view(torch.bfloat16) if entry.ggml_type == "BF16" else tensor
    qtype = GGMLQuantizationType[entry.ggml_type]
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    num_rows, row = (shape[0], int(np.prod(shape[1:]))) if len(shape) > 1 else (1, shape[0])
    rows = np.asarray(raw).reshape(quant_shape_to_byte_shape((num_rows, row), qtype))
    out = np.empty((num_rows, row), dtype=np.float32)
    coded = CODED_TYPES.get(entry.ggml_type) if len(shape) == 2 else None
    codes = None  # (codes, scales, offsets) of every row, made with the first chunk's
    step = max(1, cpu_gemm.CHUNK_ELEMENTS // row)
    for start in range(0, num_rows, step):
        blocks = rows[start:start + step]
        out[start:start + step] = dequantize_blocks(blocks, qtype).reshape(-1, row)
        if coded is not None:
            *chunk, block = coded(blocks.reshape(-1, block_bytes))
            chunk = [a.reshape(len(blocks), -1) for a in chunk]
            if codes is None:
                codes = [np.empty((num_rows, a.shape[1]), dtype=a.dtype) for a in chunk]
            for whole, a in zip(codes, chunk):
                whole[start:start + step] = a
    tensor = torch.from_numpy(out.reshape(shape))
    if codes is not None:
        tensor.block_codes = BlockCodes(*(torch.from_numpy(a) for a in codes), block)
    return tensor


# ---- block codes: for each type, (codes int8, scales, offsets, block) such that gguf-py's dequantized
# element is float32 fma(scale, code, offset): its products scale * code are exact in float32, and
# it rounds once, adding the offset (`BlockCodes.values` checks this before the codes are used).

def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Each row of packed 4-bit values: the low nibbles of `width` bytes, then their high ones."""
    n = qs.shape[0]
    q = qs.reshape((n, -1, 1, width)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
    return (q & np.uint8(0x0F)).reshape((n, -1))


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _codes_q4_0(blocks):  # d * (q - 8)
    d, qs = _half(blocks[:, :2]), _nibbles(blocks[:, 2:], 16)
    return qs.astype(np.int8) - np.int8(8), d, np.zeros_like(d), 32


def _codes_q4_1(blocks):  # d * q + m
    d, m, qs = _half(blocks[:, :2]), _half(blocks[:, 2:4]), _nibbles(blocks[:, 4:], 16)
    return qs.astype(np.int8), d, m, 32


def _codes_q8_0(blocks):  # d * q
    d = _half(blocks[:, :2])
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8), d, np.zeros_like(d), 32


def _five_bits(blocks, qh_at: int) -> np.ndarray:
    """Q5_0 / Q5_1 codes: 4 low bits from the nibbles after the 32 high bits at `qh_at`."""
    n = blocks.shape[0]
    qh = np.ascontiguousarray(blocks[:, qh_at:qh_at + 4]).view(np.uint32).reshape((n, 1))
    qh = ((qh >> np.arange(32, dtype=np.uint32).reshape((1, 32))) & np.uint32(0x01)).astype(np.uint8)
    return _nibbles(blocks[:, qh_at + 4:], 16) | (qh << np.uint8(4))


def _codes_q5_0(blocks):  # d * (q - 16)
    d = _half(blocks[:, :2])
    return _five_bits(blocks, 2).astype(np.int8) - np.int8(16), d, np.zeros_like(d), 32


def _codes_q5_1(blocks):  # d * q + m
    d, m = _half(blocks[:, :2]), _half(blocks[:, 2:4])
    return _five_bits(blocks, 4).astype(np.int8), d, m, 32


def _k_scales(blocks):  # per 32-element sub-block: d * sc, dmin * m (Q4_K and Q5_K)
    d, dmin = _half(blocks[:, :2]), _half(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:4 + Q4_K.K_SCALE_SIZE]))
    n = blocks.shape[0]
    return (d * sc.astype(np.float32)).reshape(n, -1), -(dmin * m.astype(np.float32)).reshape(n, -1)


def _codes_q4_k(blocks):  # d * sc * q - dmin * m, by sub-blocks of 32
    scales, offsets = _k_scales(blocks)
    return _nibbles(blocks[:, 4 + Q4_K.K_SCALE_SIZE:], 32).astype(np.int8), scales, offsets, 32


def _codes_q5_k(blocks):  # d * sc * q - dmin * m, q of 5 bits, by sub-blocks of 32
    scales, offsets = _k_scales(blocks)
    rest = blocks[:, 4 + Q4_K.K_SCALE_SIZE:]
    qh, qs = rest[:, :32], rest[:, 32:]
    n = blocks.shape[0]
    qh = (qh.reshape((n, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 8, 1))) & np.uint8(0x01)
    return (_nibbles(qs, 32) | (qh.reshape((n, -1)) << np.uint8(4))).astype(np.int8), scales, offsets, 32


def _codes_q6_k(blocks):  # d * sc * (q - 32), by sub-blocks of 16
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _half(blocks[:, 208:210])
    ql = _nibbles(ql, 64).reshape((n, -1, 32))
    qh = qh.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    qh = (qh & np.uint8(0x03)).reshape((n, -1, 32))
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = d * sc
    return q.reshape((n, -1)), scales, np.zeros_like(scales), 16


CODED_TYPES = {"Q4_0": _codes_q4_0, "Q4_1": _codes_q4_1, "Q5_0": _codes_q5_0, "Q5_1": _codes_q5_1,
               "Q8_0": _codes_q8_0, "Q4_K": _codes_q4_k, "Q5_K": _codes_q5_k, "Q6_K": _codes_q6_k}


def fix_tensor(arch: str, name: str, tensor: torch.Tensor, config: dict) -> torch.Tensor:
    """Undoes llama.cpp's conversion of one tensor (see the module docstring)."""
    if arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return _with_rows(unpermute_rope(tensor, config["num_attention_heads"]), tensor,
                          config["num_attention_heads"])
    if arch == "llama" and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return _with_rows(unpermute_rope(tensor, config["num_key_value_heads"]), tensor,
                          config["num_key_value_heads"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        return tensor.float() - 1
    return tensor


def _with_rows(fixed: torch.Tensor, tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`fixed` (`tensor`'s rows unpermuted) with `tensor`'s block codes, their rows moved alike."""
    codes = getattr(tensor, "block_codes", None)
    if codes is not None:
        fixed.block_codes = codes.rows(unpermute_rope(torch.arange(tensor.shape[0]), num_heads))
    return fixed


def unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's `permute` of q/k rows: per head, the rows that rotate
    together come back as first half / second half, as Hugging Face's RoPE pairs them."""
    head_rows = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, head_rows, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
