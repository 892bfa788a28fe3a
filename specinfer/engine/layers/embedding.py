"""Token embeddings, looked up from a float32 table or from the block codes it was dequantized from.

A GGUF's token embedding is a block-quantized matrix (`models/gguf.py` carries its codes as
`cpu_gemm.BlockCodes`). Held in float32 for lookups it takes 4 bytes a weight, more than the rest of
a small model: SmolLM2-135M's 49,152 x 576 table is 113 MB in float32, Gemma 3 270M's 262,144 x 640
is 671 MB. A `CodedTable` keeps the codes instead (a byte each, with a float32 scale and offset per
block) and rebuilds only the rows a pass looks up, with the very arithmetic `BlockCodes.values`
uses: each row is bit for bit the float32 row it replaces (checked once, when it is made), so the
model's outputs, and the exactness of speculative decoding (SpecInfer, arXiv 2305.09781), are
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specinfer.engine.layers.cpu_gemm import BlockCodes


CHECK_ROWS = 2048  # rows rebuilt at a time while checking the codes against the table


@dataclass(frozen=True)
class CodedTable:
    """An embedding table (num_tokens, hidden) as int8 codes and per-block float32 scales and offsets."""

    codes: torch.Tensor  # (num_tokens, hidden) int8
    scales: torch.Tensor  # (num_tokens, hidden // block) float32
    offsets: torch.Tensor
    block: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows of `ids`: codes times scales (exact), plus offsets (one rounding)."""
        flat = ids.reshape(-1)
        codes = self.codes.index_select(0, flat).view(flat.numel(), -1, self.block)
        products = codes.float() * self.scales.index_select(0, flat).unsqueeze(-1)
        values = products + self.offsets.index_select(0, flat).unsqueeze(-1)
        return values.view(*ids.shape, self.codes.shape[1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))


def coded_table(weight: torch.Tensor) -> CodedTable | None:
    """`weight`'s block codes as a lookup table, where they give every element of the float32
    `weight` bit for bit (checked, never assumed); else None."""
    codes: BlockCodes | None = getattr(weight, "block_codes", None)
    if weight.dtype != torch.float32 or codes is None or codes.codes.shape != weight.shape:
        return None
    for start in range(0, weight.shape[0], CHECK_ROWS):  # a few MB at a time, not another table
        rows = slice(start, start + CHECK_ROWS)
        values = codes.rows(rows).values()
        if values is None or not torch.equal(values, weight[rows]):
            return None
    return CodedTable(codes.codes.to(torch.int8).contiguous(), codes.scales.float().contiguous(),
                      codes.offsets.float().contiguous(), codes.block)


def embedding(ids: torch.Tensor, table: torch.Tensor | CodedTable) -> torch.Tensor:
    """The rows of `ids` in `table`, as `F.embedding` gives them."""
    return table.rows(ids) if isinstance(table, CodedTable) else F.embedding(ids, table)
