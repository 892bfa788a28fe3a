"""Token embeddings looked up from block codes: bit for bit the float32 rows they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specinfer.engine.layers.cpu_gemm import BlockCodes
from specinfer.engine.layers.embedding import CodedTable, coded_table, embedding


def coded_weight(num_tokens: int = 64, hidden: int = 96, block: int = 32, seed: int = 0) -> torch.Tensor:
    """A float32 table dequantized from random 4-bit codes with float16 scales and offsets,
    carrying its codes as a GGUF tensor does."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-8, 8, (num_tokens, hidden), generator=g).to(torch.int8)
    scales = (torch.rand(num_tokens, hidden // block, generator=g) * 0.1).half().float()
    offsets = (torch.randn(num_tokens, hidden // block, generator=g) * 0.05).half().float()
    block_codes = BlockCodes(codes, scales, offsets, block)
    weight = block_codes.values()
    weight.block_codes = block_codes
    return weight


def test_rows_equal_the_float32_table_s_bit_for_bit():
    weight = coded_weight()
    table = coded_table(weight)
    assert isinstance(table, CodedTable) and table.shape == weight.shape
    ids = torch.tensor([[0, 5, 63, 5], [17, 1, 2, 40]])
    assert torch.equal(embedding(ids, table), F.embedding(ids, weight))
    assert torch.equal(embedding(ids[0], table), F.embedding(ids[0], weight))
    assert table.nbytes() < weight.numel() * 4 / 3  # a byte a weight and a little


def test_codes_that_do_not_define_the_table_are_not_used():
    weight = coded_weight()
    changed = weight.clone()
    changed[3, 7] = torch.nextafter(changed[3, 7], torch.tensor(1.0))  # one element one ulp off its codes
    changed.block_codes = weight.block_codes
    assert coded_table(changed) is None
    assert coded_table(weight.clone()) is None  # no codes at all
    assert coded_table(weight.double()) is None


def test_a_q8_0_draft_looks_its_embedding_up_from_codes(tmp_path):
    """A q8_0 SSM rounds its embedding to 8-bit codes as it does its matrices (a draft only
    proposes); a float32 checkpoint's embedding stays the float32 table."""
    from specinfer.engine.layers import cpu_gemm
    from specinfer.engine.runtime.runner import ModelRunner
    from util import save_tiny_llama

    if not cpu_gemm.available():
        pytest.skip("the CPU kernel is not built here")
    model_dir = save_tiny_llama(tmp_path / "m", tie=True)
    full = ModelRunner.from_dir(model_dir, "float32", "cpu", 64).model.w["embed"]
    table = ModelRunner.from_dir(model_dir, "q8_0", "cpu", 64).model.w["embed"]
    assert isinstance(full, torch.Tensor) and isinstance(table, CodedTable)
    rounded = BlockCodes.q8_0(full).values()
    assert not torch.equal(rounded, full)  # the rounding is there to see
    assert torch.equal(table.rows(torch.arange(full.shape[0])), rounded)
