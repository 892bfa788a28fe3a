"""The decoder's matrix products, with each weight laid out once for the CPU's kernels.

A verification pass (SpecInfer Section 4.2) multiplies a few to a few dozen rows, a token tree's
nodes, by every weight matrix. On a CPU, torch's default float32 linear re-lays each weight out for
its kernels on every call, which makes such a pass cost about twice a one-token pass: the tree's
price, not its arithmetic, decides whether speculation pays. oneDNN can lay every weight out once,
when the model loads (`pack`), for kernels that then read it as they are; a pass over a tree of 4
to 16 nodes costs about 0.6-0.7 of what it did, at the same memory. The products are the same
float32 (or bfloat16) arithmetic in another summation order, as any other GEMM kernel's.

Float32 weights go to the project's own kernel where it is built (`layers/cpu_gemm.c`): panels of
16 output features, streamed once a pass, which read the weights 1.4-2x faster than oneDNN at one
row and match it to a few dozen rows. Its sums do not depend on the number of rows, so a tree
pass's rows are bitwise what one-token passes give. A weight that a bfloat16 (or float16)
checkpoint gave, every element exactly a 16-bit value, stays in 16 bits there and is widened in
registers: the same float32 products from half the bytes a pass streams. A weight dequantized
from a GGUF's integer block codes (it carries them as `block_codes`, `cpu_gemm.BlockCodes`) stays
as those codes, rebuilt in registers by the fused multiply-add that defines each element: the same
float32 products again, from a fifth (4-bit codes, two to a byte) to a third of float32's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specinfer.engine.layers import cpu_gemm

PACK_ROWS = 8  # the rows oneDNN is told to expect; the layout serves every row count
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `pack` applies to weights of `dtype` on `device`: a CPU with oneDNN, and for
    bfloat16 one whose instructions oneDNN's bfloat16 kernels need (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT); elsewhere bfloat16 weights stay as they are."""
    if device.type != "cpu" or dtype not in _PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass(frozen=True)
class Panels:
    """A float32 weight (num_out, in) laid out for `cpu_gemm` (`cpu_gemm.pack`), stored in float32
    or, where it holds every element exactly, in bfloat16 or float16; or as the block codes it was
    dequantized from (`cpu_gemm.pack_codes`)."""

    data: torch.Tensor | cpu_gemm.CodePanels
    num_out: int

    def numel(self) -> int:
        """Elements, or for block codes bytes (`element_size` 1): numel() * element_size() is the memory."""
        return self.data.nbytes() if isinstance(self.data, cpu_gemm.CodePanels) else self.data.numel()

    def element_size(self) -> int:
        return 1 if isinstance(self.data, cpu_gemm.CodePanels) else self.data.element_size()

    def to(self, device) -> "Panels":
        """The panels themselves on the CPU; they go nowhere else (build such a model unpacked)."""
        if torch.device(device).type != "cpu":
            raise ValueError("CPU kernel panels cannot move to another device: build the model with is_packed=False")
        return self


def pack(weight: torch.Tensor) -> torch.Tensor | Panels:
    """`weight` (out, in) laid out once for the CPU's kernels; `linear` takes it as it takes `weight`."""
    if weight.dtype == torch.float32 and cpu_gemm.available():
        codes = getattr(weight, "block_codes", None)
        if codes is not None and codes.codes.shape == weight.shape and _defines(codes, weight):
            return Panels(cpu_gemm.pack_codes(codes), weight.shape[0])
        return Panels(cpu_gemm.pack(weight, cpu_gemm.exact_storage(weight)), weight.shape[0])
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def _defines(codes: cpu_gemm.BlockCodes, weight: torch.Tensor) -> bool:
    """Whether `codes` give every element of `weight`, bit for bit (checked, never assumed), a
    few million elements at a time: the check of a large embedding's tied head holds no second
    copy of it."""
    step = max(1, cpu_gemm.CHUNK_ELEMENTS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], step):
        values = codes.rows(slice(start, start + step)).values()
        if values is None or not torch.equal(values, weight[start:start + step]):
            return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor | Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, for a plain or a `pack`ed weight."""
    if isinstance(weight, Panels):
        if isinstance(weight.data, cpu_gemm.CodePanels):
            out = cpu_gemm.gemm_codes(x, weight.data, weight.num_out)
        else:
            out = cpu_gemm.gemm(x, weight.data, weight.num_out)
        return out if bias is None else out.add_(bias)
    if weight.layout == torch._mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
