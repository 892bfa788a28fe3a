"""The CPU matrix kernel (`layers/cpu_gemm.c`): right to float32 rounding, and bitwise the same
for a row whatever the batch around it, the thread split or the instruction set."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from specinfer.engine.layers import cpu_gemm
from specinfer.engine.layers import linear as linear_mod
from specinfer.engine.layers.linear import Panels, linear, pack

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="the CPU kernel is not built for this machine")

# (n, k): whole panels and a partial one; k below, at and off the vector widths.
SHAPES = [(64, 64), (40, 17), (100, 576), (16, 1), (3, 8), (257, 96)]


def raw_gemm(panels: torch.Tensor, x: torch.Tensor, n: int, isa: int, threads: int) -> torch.Tensor:
    lib, _ = cpu_gemm._library()
    out = torch.full((x.shape[0], n), float("nan"))
    lib.specinfer_gemm(panels.data_ptr(), cpu_gemm._FORMATS[panels.dtype], x.data_ptr(), out.data_ptr(), x.shape[0],
                       n, x.shape[1], isa, threads)
    return out


def test_kernel_is_built_where_it_can_be():
    """On x86-64 with AVX2 the package builds and loads the kernel, so this suite runs it: a silent
    fallback would leave every test below skipped and the engine on torch's kernels."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the kernel is x86-64 only")
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    if " avx2 " not in flags or " fma " not in flags:
        pytest.skip("this CPU has no AVX2 and FMA")
    assert cpu_gemm.available()


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_float64_reference(n, k):
    torch.manual_seed(n * 1000 + k)
    w = torch.randn(n, k)
    panels = cpu_gemm.pack(w)
    for m in (1, 2, 3, 4, 5, 6, 7, 12, 13, 40):
        x = torch.randn(m, k)
        got = cpu_gemm.gemm(x, panels, n)
        ref = (x.double() @ w.double().T).float()
        assert got.shape == (m, n)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_is_bitwise_the_same_in_any_batch_and_thread_split(n, k):
    """Every batch size from 1 to 33 walks the 6-, 4- (or 3-) and 1-row tiles; each row must equal
    the row computed alone, bit for bit, on 1 and 2 threads."""
    torch.manual_seed(7)
    w, x = torch.randn(n, k), torch.randn(33, k)
    panels = cpu_gemm.pack(w)
    _, isa = cpu_gemm._library()
    alone = torch.cat([raw_gemm(panels, x[i:i + 1].contiguous(), n, isa, 1) for i in range(33)])
    for m in range(1, 34):
        for threads in (1, 2):
            assert torch.equal(raw_gemm(panels, x[:m].contiguous(), n, isa, threads), alone[:m]), (m, threads)


@needs_kernel
def test_avx2_and_avx512_paths_agree_bitwise():
    _, isa = cpu_gemm._library()
    if isa < 2:
        pytest.skip("this CPU has no AVX-512 to compare with")
    torch.manual_seed(3)
    for n, k in SHAPES:
        w, x = torch.randn(n, k), torch.randn(9, k)
        panels = cpu_gemm.pack(w)
        assert torch.equal(raw_gemm(panels, x, n, 2, 2), raw_gemm(panels, x, n, 1, 2)), (n, k)


def exactly(w: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """`w` rounded to values `storage` holds exactly, as a checkpoint stored in it gives, in float32."""
    return w.to(storage).float()


@needs_kernel
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_16_bit_panels_multiply_bitwise_as_float32_ones(n, k, storage):
    """A weight of exact 16-bit values packed in 16 bits gives, for every batch size, thread split
    and instruction set, bit for bit what its float32 panels give (the widening in registers is
    exact), from half the bytes."""
    torch.manual_seed(n + k)
    w, x = exactly(torch.randn(n, k), storage), torch.randn(17, k)
    wide, narrow = cpu_gemm.pack(w), cpu_gemm.pack(w, storage)
    assert narrow.dtype == storage and narrow.shape == wide.shape
    assert narrow.numel() * narrow.element_size() * 2 == wide.numel() * wide.element_size()
    _, best = cpu_gemm._library()
    for isa in sorted({1, best}):
        for m in (1, 2, 3, 5, 7, 8, 9, 16, 17):
            for threads in (1, 2):
                got = raw_gemm(narrow, x[:m].contiguous(), n, isa, threads)
                assert torch.equal(got, raw_gemm(wide, x[:m].contiguous(), n, isa, threads)), (isa, m, threads)


def test_a_weight_is_stored_in_the_narrowest_type_that_holds_it_exactly():
    torch.manual_seed(11)
    w = torch.randn(48, 32)
    assert cpu_gemm.exact_storage(exactly(w, torch.bfloat16)) == torch.bfloat16
    assert cpu_gemm.exact_storage(exactly(w, torch.float16)) == torch.float16
    assert cpu_gemm.exact_storage(w) == torch.float32
    one_off = exactly(w, torch.bfloat16)
    one_off[5, 7] += 1e-7  # a single element off the 16-bit grid keeps the whole weight in float32
    assert cpu_gemm.exact_storage(one_off) == torch.float32
    big = exactly(w, torch.bfloat16) * 2.0 ** 20  # bfloat16 values past float16's range: bfloat16, not float16
    assert cpu_gemm.exact_storage(big) == torch.bfloat16
    nan = w.clone()
    nan[0, 0] = float("nan")
    assert cpu_gemm.exact_storage(nan) == torch.float32


@needs_kernel
def test_a_bfloat16_checkpoints_weights_are_packed_in_16_bits_and_multiply_as_before():
    torch.manual_seed(13)
    w, b = exactly(torch.randn(40, 24), torch.bfloat16), torch.randn(40)
    packed = pack(w)
    assert isinstance(packed, Panels) and packed.data.dtype == torch.bfloat16
    x = torch.randn(3, 24)
    assert torch.equal(linear(x, packed, b), linear(x, Panels(cpu_gemm.pack(w), 40), b))
    torch.testing.assert_close(linear(x, packed, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_linear_takes_panels_with_bias_and_leading_dims():
    torch.manual_seed(5)
    w, b = torch.randn(40, 24), torch.randn(40)
    packed = pack(w)
    assert isinstance(packed, Panels) and packed.num_out == 40
    x = torch.randn(2, 3, 24)
    torch.testing.assert_close(linear(x, packed, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a transposed view) is read as its values, not its storage
    xt = torch.randn(24, 5).T
    torch.testing.assert_close(linear(xt, packed), xt @ w.T, rtol=1e-5, atol=1e-5)


def test_without_the_kernel_weights_go_to_onednn(monkeypatch):
    monkeypatch.setattr(linear_mod.cpu_gemm, "available", lambda: False)
    w = torch.randn(32, 16)
    packed = pack(w)
    assert isinstance(packed, torch.Tensor) and packed.layout == torch._mkldnn
    x = torch.randn(3, 16)
    torch.testing.assert_close(linear(x, packed), x @ w.T, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_decoder_runs_on_the_kernel(pair_runners):
    """The model every exactness test decodes with multiplies through the kernel."""
    llm, _ = pair_runners
    weights = llm.model.w
    assert all(isinstance(weights[name], Panels) for name in weights if name.endswith((".qkv", ".o", ".gate_up",
                                                                                      ".down", "lm_head")))


def test_an_empty_pass_computes_nothing_and_does_not_crash():
    """Zero rows (a pass with nothing to compute) returns an empty result instead of dividing by zero."""
    if not cpu_gemm.available():
        pytest.skip("the kernel is not built here")
    panels = cpu_gemm.pack(torch.randn(40, 24))
    assert cpu_gemm.gemm(torch.empty(0, 24), panels, 40).shape == (0, 40)


# ---- block codes (a GGUF's quantized weights) ---------------------------------------------------------


def random_codes(n: int, k: int, block: int, seed: int, is_signed: bool = False) -> cpu_gemm.BlockCodes:
    """Codes as a Q4_1-like format gives: 4-bit codes, float16 scales and offsets (or signed codes
    and no offset, as Q8_0's)."""
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randint(-128, 128, (n, k), generator=gen) if is_signed
             else torch.randint(0, 16, (n, k), generator=gen)).to(torch.int8)
    scales = (torch.rand(n, k // block, generator=gen) * 0.02).half().float()
    offsets = (torch.zeros_like(scales) if is_signed
               else (torch.randn(n, k // block, generator=gen) * 0.1).half().float())
    return cpu_gemm.BlockCodes(codes, scales, offsets, block)


def raw_gemm_codes(coded: cpu_gemm.CodePanels, x: torch.Tensor, n: int, isa: int, threads: int) -> torch.Tensor:
    lib, _ = cpu_gemm._library()
    out = torch.full((x.shape[0], n), float("nan"))
    gemm = lib.specinfer_gemm_nibbles if coded.is_nibbles else lib.specinfer_gemm_codes
    gemm(coded.codes.data_ptr(), coded.scales.data_ptr(), None if coded.offsets is None else coded.offsets.data_ptr(),
         coded.block, int(coded.scales.dtype == torch.float16), x.data_ptr(), out.data_ptr(), x.shape[0], n,
         x.shape[1], isa, threads)
    return out


@needs_kernel
@pytest.mark.parametrize("block,is_signed", [(32, False), (32, True), (16, True)])
@pytest.mark.parametrize("n,k", [(64, 64), (40, 96), (257, 32), (3, 96)])
@pytest.mark.parametrize("is_nibbles", [True, False])
def test_code_panels_multiply_bitwise_as_the_float32_weight_they_define(n, k, block, is_signed, is_nibbles):
    """The kernel rebuilds each element with the fma that defines it: for every batch size, thread
    split and instruction set, bit for bit the float32 panels of the codes' values, whether 4-bit
    codes are kept two to a byte or one."""
    if k % block:
        pytest.skip("k is not a whole number of blocks")
    codes = random_codes(n, k, block, seed=n + k + block, is_signed=is_signed)
    w = codes.values()
    assert w is not None
    coded, wide = cpu_gemm.pack_codes(codes, is_nibbles=is_nibbles), cpu_gemm.pack(w)
    assert coded.is_nibbles == (is_nibbles and not is_signed)  # 256 signed values do not fit in 4 bits
    _, best = cpu_gemm._library()
    x = torch.randn(17, k)
    for isa in sorted({1, best}):
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17):
            for threads in (1, 2):
                rows = x[:m].contiguous()
                assert torch.equal(raw_gemm_codes(coded, rows, n, isa, threads),
                                   raw_gemm(wide, rows, n, isa, threads)), (isa, m, threads)


@needs_kernel
@pytest.mark.parametrize("low,has_offsets", [(-8, False), (0, True), (5, True), (-128, False), (112, False)])
def test_codes_spanning_16_values_are_kept_in_4_bits_wherever_they_start(low, has_offsets):
    """Q4_0's codes run -8 .. 7 (no offsets), Q4_1's and the 4-bit K-quants' 0 .. 15: any 16
    consecutive int8 values pack into half the bytes, their lowest folded into the offsets, and
    multiply bitwise as the float32 weight they define."""
    n, k, block = 40, 96, 32
    gen = torch.Generator().manual_seed(low + 200)
    scales = (torch.rand(n, k // block, generator=gen) * 0.02).half().float()
    offsets = (torch.randn(n, k // block, generator=gen) * 0.1).half().float() if has_offsets else torch.zeros_like(scales)
    codes = cpu_gemm.BlockCodes(torch.randint(low, low + 16, (n, k), generator=gen).to(torch.int8), scales, offsets,
                                block)
    nibbles, whole = cpu_gemm.pack_codes(codes), cpu_gemm.pack_codes(codes, is_nibbles=False)
    assert nibbles.is_nibbles and not whole.is_nibbles
    assert nibbles.codes.numel() * nibbles.codes.element_size() * 2 == whole.codes.numel()
    x = torch.randn(9, k)
    assert torch.equal(cpu_gemm.gemm_codes(x, nibbles, n), cpu_gemm.gemm_codes(x, whole, n))
    assert torch.equal(cpu_gemm.gemm_codes(x, nibbles, n), cpu_gemm.gemm(x, cpu_gemm.pack(codes.values()), n))
    wider = codes.codes.clone()
    wider[3, 5] = low + 16 if low < 112 else low - 1  # 17 values: one byte a code again
    assert not cpu_gemm.pack_codes(cpu_gemm.BlockCodes(wider, scales, offsets, block)).is_nibbles


@needs_kernel
def test_4_bit_codes_stay_bytes_where_their_lowest_would_not_fold_exactly():
    """Folding the lowest code into an offset, scale * lowest + offset, must be exact for the 4-bit
    layout to rebuild the same elements: with offsets of float32's full precision that sum rounds
    (and folding it anyway changes the products), so the codes stay one a byte."""
    gen = torch.Generator().manual_seed(4)
    codes = cpu_gemm.BlockCodes(torch.randint(5, 21, (16, 32), generator=gen).to(torch.int8),
                                (torch.rand(16, 1, generator=gen) * 0.02).half().float(),
                                torch.randn(16, 1, generator=gen) * 0.1, 32)
    assert codes.values() is not None  # the elements themselves are well defined
    assert not cpu_gemm.pack_codes(codes).is_nibbles
    x = torch.randn(3, 32)
    assert torch.equal(cpu_gemm.gemm_codes(x, cpu_gemm.pack_codes(codes), 16),
                       cpu_gemm.gemm(x, cpu_gemm.pack(codes.values()), 16))


@needs_kernel
@pytest.mark.parametrize("scales_kind", ["float16", "float32", "no offsets"])
@pytest.mark.parametrize("is_nibbles", [True, False])
def test_scales_are_kept_in_float16_and_zero_offsets_left_out_only_where_exact(scales_kind, is_nibbles):
    """Scales and offsets that are float16 values (a GGUF's Q4_0, Q4_1 and Q8_0 give such) are kept
    in float16, widened exactly in registers; finer ones stay float32; offsets that are all +0 are
    not stored. Each way, for either code width and instruction set, the products are bitwise the
    float32 weight's."""
    n, k, block = 40, 64, 32
    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 16, (n, k), generator=gen).to(torch.int8)
    scales = (torch.rand(n, k // block, generator=gen) * 0.02).half().float()
    offsets = (torch.randn(n, k // block, generator=gen) * 0.1).half().float()
    if scales_kind == "float32":  # 18 significant bits: products of 4-bit codes still exact
        scales = torch.randint(2 ** 17, 2 ** 18, scales.shape, generator=gen).float() * 2.0 ** -25
    elif scales_kind == "no offsets":
        offsets = torch.zeros_like(offsets)
    block_codes = cpu_gemm.BlockCodes(codes, scales, offsets, block)
    packed = cpu_gemm.pack_codes(block_codes, is_nibbles=is_nibbles)
    assert packed.is_nibbles == is_nibbles
    assert packed.scales.dtype == (torch.float32 if scales_kind == "float32" else torch.float16)
    assert (packed.offsets is None) == (scales_kind == "no offsets")
    wide = cpu_gemm.pack(block_codes.values())
    _, best = cpu_gemm._library()
    x = torch.randn(9, k)
    for isa in sorted({1, best}):
        for m in (1, 2, 3, 8, 9):
            rows = x[:m].contiguous()
            assert torch.equal(raw_gemm_codes(packed, rows, n, isa, 2), raw_gemm(wide, rows, n, isa, 2)), (isa, m)


def test_a_fold_is_exact_only_when_float64_held_the_sum_exactly():
    """The fold's float64 sum can itself round (a tiny offset beside a large product) and still look
    like a float32 value: the two-sum error catches it."""
    ones, five = torch.ones(1, 1), 5
    assert cpu_gemm._exact_fold(ones, torch.full((1, 1), 2.0 ** -60), five) is None  # 5 + 2^-60 rounds in float64
    assert cpu_gemm._exact_fold(ones, torch.full((1, 1), 2.0 ** -25), five) is None  # exact in float64, not in float32
    assert torch.equal(cpu_gemm._exact_fold(ones, torch.full((1, 1), 0.25), five), torch.full((1, 1), 5.25))


def test_negative_zero_offsets_are_kept():
    """fma(s, c, -0) and fma(s, c, +0) differ in the sign of a zero product: offsets of -0 stay."""
    offsets = torch.zeros(16, 1)
    offsets[3, 0] = -0.0
    packed = cpu_gemm.pack_codes(cpu_gemm.BlockCodes(torch.ones(16, 32, dtype=torch.int8), torch.ones(16, 1), offsets,
                                                     32))
    assert packed.offsets is not None


def test_codes_values_round_once_as_float32_fma_does():
    """`values` is fma(scale, code, offset) rounded once to float32: for float16 scales and offsets
    that is numpy's float32 `scale * code + offset` (the product is exact), as gguf-py dequantizes."""
    codes = random_codes(48, 64, 32, seed=1)
    expand = lambda t: t.numpy().repeat(32, axis=1)  # noqa: E731
    reference = expand(codes.scales) * codes.codes.numpy().astype("float32") + expand(codes.offsets)
    assert torch.equal(codes.values(), torch.from_numpy(reference))


def test_codes_whose_products_float32_cannot_hold_are_not_trusted():
    """A scale of 24 significant bits times a 4-bit code needs more bits than float32 has: the
    product would round before the offset is added, which the kernel's single fma does not do, so
    `values` refuses the codes. A float16 scale (11 bits) with the same codes is trusted."""
    codes = random_codes(16, 32, 32, seed=2)
    full = torch.full_like(codes.scales, 1 + 2.0 ** -23)  # 24 significant bits
    assert cpu_gemm.BlockCodes(codes.codes, full, codes.offsets, 32).values() is None
    assert codes.values() is not None
    # the bit length of a block's codes counts, not their largest one's significant bits: 16 has one,
    # yet 15 beside it needs four, and 15 times a 21-bit scale needs 25
    mixed = torch.tensor([[15, 16] * 16], dtype=torch.int8)
    scale_21 = torch.tensor([[1 + 2.0 ** -20]])
    assert cpu_gemm.BlockCodes(mixed, scale_21, torch.tensor([[0.5]]), 32).values() is None
    no_offset = cpu_gemm.BlockCodes(mixed, scale_21, torch.tensor([[0.0]]), 32)  # the product's rounding alone
    assert torch.equal(no_offset.values(), (mixed.double() * (1 + 2.0 ** -20)).float())
    tiny = torch.full_like(codes.offsets, 2.0 ** -80)  # exact products: any offset rounds once
    assert torch.equal(cpu_gemm.BlockCodes(codes.codes, codes.scales, tiny, 32).values(),
                       (codes.codes.double() * codes.scales.double().repeat_interleave(32, dim=1) + 2.0 ** -80).float())


@needs_kernel
def test_a_weight_is_packed_as_its_codes_only_where_they_define_it_exactly():
    codes = random_codes(40, 64, 32, seed=3)
    w = codes.values()
    w.block_codes = codes
    packed = pack(w)
    assert isinstance(packed.data, cpu_gemm.CodePanels)
    x = torch.randn(3, 64)
    assert torch.equal(linear(x, packed), linear(x, Panels(cpu_gemm.pack(w), 40)))
    wide = Panels(cpu_gemm.pack(w), 40)
    assert packed.numel() * packed.element_size() < wide.numel() * wide.element_size() / 5  # 4-bit codes two a byte
    changed = w.clone()
    changed[7, 9] += 1e-3  # one element no longer what the codes say: the codes are not used
    changed.block_codes = codes
    assert not isinstance(pack(changed).data, cpu_gemm.CodePanels)
    assert torch.equal(linear(x, pack(changed)), linear(x, Panels(cpu_gemm.pack(changed), 40)))


def test_codes_are_made_and_read_a_few_rows_at_a_time_with_the_whole_s_result(monkeypatch):
    """`BlockCodes.q8_0` and `.values` work through a few million elements at a time (so rounding
    a large embedding holds no temporaries of its size); with chunks of one row, the codes,
    scales and values are bitwise what whole-tensor arithmetic gives, and a block that float32
    cannot rebuild in its last row is still refused."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(37, 96, generator=gen)
    weight[5, :32] = 0.0  # a block of zeros: its scale is 0
    whole = cpu_gemm.BlockCodes.q8_0(weight)
    whole_values = whole.values()
    monkeypatch.setattr(cpu_gemm, "CHUNK_ELEMENTS", 1)
    chunked = cpu_gemm.BlockCodes.q8_0(weight)
    assert torch.equal(chunked.codes, whole.codes) and torch.equal(chunked.scales, whole.scales)
    assert torch.equal(chunked.values(), whole_values)
    blocks = whole.codes.view(37, -1, 32).float()
    manual = (blocks * whole.scales.unsqueeze(-1)).view(37, 96)  # the definition, all at once
    assert torch.equal(chunked.values(), manual)
    offsets = torch.zeros_like(whole.scales)
    offsets[-1, -1] = 0.5  # with an offset, a scale of 24 significant bits times a code is inexact
    scales = whole.scales.clone()
    scales[-1, -1] = 1.0 + 2.0 ** -23
    assert cpu_gemm.BlockCodes(whole.codes, scales, offsets, 32).values() is None


# ---- RMSNorm (cpu_norm.c) -----------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("size", [8, 20, 48, 64, 128, 576, 960, 2048, 4096, 8200])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_the_kernel_norm_gives_torch_s_bits_for_any_rows(size, eps):
    """Rows of any count, magnitude and size (the cascade of torch's float32 sum included: 8,200
    holds more than 16 groups of four vectors) equal F.rms_norm's bit for bit, and so does a row
    of a many-row call (threads) against the same row alone."""
    from specinfer.engine.layers.norms import is_kernel_exact

    gen = torch.Generator().manual_seed(size)
    weight = torch.randn(size, generator=gen)
    for num_rows in (1, 2, 7, 300):
        x = torch.randn(num_rows, size, generator=gen) * torch.logspace(-6, 6, num_rows).unsqueeze(1)
        got = cpu_gemm.rms_norm(x, weight, eps)
        assert torch.equal(got, F.rms_norm(x, (size,), weight, eps))
        assert torch.equal(got[-1:], cpu_gemm.rms_norm(x[-1:].clone(), weight, eps))
    assert is_kernel_exact(size, eps)


def _lanes_reversed(x, weight, eps):
    """The same norm with the sum of squares taken in another order (float64, then rounded): as
    exact as the kernel's, but not torch's bits."""
    r = torch.rsqrt((x.double().pow(2).sum(-1, keepdim=True) / x.shape[-1]).float() + eps)
    return x * r * weight


@needs_kernel
def test_a_kernel_norm_that_is_not_torch_s_bits_is_not_used(monkeypatch):
    """The decoder takes the kernel's norm only for row sizes where it equals torch's on this
    machine; a kernel off by a rounding is caught by that check, and the model keeps torch's."""
    from specinfer.engine.layers import norms

    assert norms.norm_for(False, True, {576}, 1e-5) is not norms.rms_norm
    assert norms.norm_for(False, False, {576}, 1e-5) is norms.rms_norm
    assert norms.norm_for(True, False, {576}, 1e-5) is norms.offset_rms_norm
    monkeypatch.setattr(cpu_gemm, "rms_norm", _lanes_reversed)
    norms.is_kernel_exact.cache_clear()
    try:
        assert not norms.is_kernel_exact(576, 1e-5)
        assert norms.norm_for(False, True, {576}, 1e-5) is norms.rms_norm
    finally:
        norms.is_kernel_exact.cache_clear()


@needs_kernel
def test_the_kernel_norm_leaves_strided_rows_to_torch():
    """A norm over a view that is not contiguous (the per-head q/k norms' input) is torch's."""
    from specinfer.engine.layers import norms

    norm = norms.norm_for(False, True, {16}, 1e-6)
    qkv = torch.randn(3, 5 * 16)
    heads = qkv[:, : 3 * 16].view(3, 3, 16)
    assert not heads.is_contiguous()
    weight = torch.randn(16)
    assert torch.equal(norm(heads, weight, 1e-6), F.rms_norm(heads, (16,), weight, 1e-6))


# ---- RoPE (cpu_rope.c) --------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dim", [8, 40, 64, 80, 128, 256])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_the_kernel_rope_gives_apply_rope_s_bits(dim, num_tokens):
    """Rotating the heads of a fused qkv row's view (heads contiguous within a token, tokens a row
    apart) gives apply_rope's bits, for head sizes whose halves do and do not fill whole vectors."""
    from specinfer.engine.layers.rope import apply_rope, rope_for

    gen = torch.Generator().manual_seed(dim * 31 + num_tokens)
    num_heads = 5
    qkv = torch.randn(num_tokens, (num_heads + 2) * dim, generator=gen) * 100
    x = qkv[:, : num_heads * dim].view(num_tokens, num_heads, dim)
    cos = torch.randn(num_tokens, 1, dim, generator=gen)
    signed_sin = torch.randn(num_tokens, 1, dim, generator=gen)
    rope = rope_for(True, False)
    assert rope is not apply_rope
    got = rope(x, cos, signed_sin)
    assert got.is_contiguous() and torch.equal(got, apply_rope(x, cos, signed_sin))
    heads_apart = torch.randn(num_tokens, num_heads, 2 * dim, generator=gen)[..., :dim]  # heads apart: torch's operators
    assert torch.equal(rope(heads_apart, cos, signed_sin), apply_rope(heads_apart, cos, signed_sin))


def test_partial_rotary_and_other_dtypes_keep_torch_s_rope():
    from specinfer.engine.layers.rope import apply_rope, rope_for

    assert rope_for(True, True) is apply_rope
    assert rope_for(False, False) is apply_rope


@needs_kernel
def test_a_model_built_to_move_off_the_cpu_keeps_torch_s_operators(tiny_pair):
    """A float32 model built unpacked (to be moved to another device, as offloading does) must not
    hand that device's tensors to the CPU kernels: its norms, rotation and attention are torch's."""
    from specinfer.engine.layers.norms import rms_norm
    from specinfer.engine.layers.rope import apply_rope
    from specinfer.engine.models.checkpoint import engine_weights, load_state_dict
    from specinfer.engine.models.config import ModelConfig
    from specinfer.engine.models.transformer import DecoderModel

    cfg = ModelConfig.from_dir(tiny_pair.llm)
    weights = engine_weights(cfg, load_state_dict(tiny_pair.llm))
    unpacked = DecoderModel(cfg, weights, torch.float32, "cpu", is_packed=False)
    assert unpacked.norm is rms_norm and unpacked.apply_rope is apply_rope and unpacked.attention_name == "sdpa"
    packed = DecoderModel(cfg, weights, torch.float32, "cpu")
    assert packed.norm is not rms_norm and packed.apply_rope is not apply_rope
    assert packed.attention_name == "cpu-kernel"


# ---- attention (cpu_attention.c) ----------------------------------------------------------------------------


def _sdpa(q, k_cache, v_cache, context, mask, scale):
    """`DecoderModel.attention`'s SDPA path, bound to a stand-in holding only what it reads."""
    from types import SimpleNamespace

    from specinfer.engine.models.transformer import DecoderModel, SeqAttention

    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    fake = SimpleNamespace(cfg=SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads), q_size=heads * dim,
                           sm_scale=scale, is_kernel_attention=False)
    return DecoderModel.attention(fake, q, k_cache, v_cache, [SeqAttention(0, q.shape[0], context, mask)])


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 8), (6, 2, 72), (4, 1, 128), (2, 2, 256)])
@pytest.mark.parametrize("num_keys", [1, 5, 300])
def test_the_kernel_attention_is_sdpa_s_to_rounding(heads, kv_heads, dim, num_keys):
    """Query rows over a slice of the cache or scattered slots, under a mask, causally (the last
    row seeing every key, as the runner asks for a chain) or seeing every key: SDPA's result to
    float32 rounding."""
    gen = torch.Generator().manual_seed(heads * 1000 + dim + num_keys)
    k_cache, v_cache = (torch.randn(512, kv_heads, dim, generator=gen) for _ in range(2))
    num_rows = min(4, num_keys)
    q = torch.randn(num_rows, heads + 2 * kv_heads, dim, generator=gen)[:, :heads]  # a fused row's view
    mask = torch.rand(num_rows, num_keys, generator=gen) < 0.6
    mask[:, 0] = True
    scattered = torch.randperm(512, generator=gen)[:num_keys]
    for context in (slice(7, 7 + num_keys), scattered):
        for row_mask, is_causal in ((None, False), (mask, False), (None, True)):
            got = cpu_gemm.attention(q, k_cache, v_cache, context, row_mask, is_causal, dim ** -0.5)
            chain = torch.ones(num_rows, num_keys, dtype=torch.bool).tril(num_keys - num_rows)
            expected = _sdpa(q, k_cache, v_cache, context, chain if is_causal else row_mask, dim ** -0.5)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_a_tree_row_is_bitwise_the_row_of_a_pass_over_its_own_keys():
    """A tree node's row (a mask over the context) equals, bit for bit, a one-row pass over just
    the keys it sees, as plain decoding has them; and a causal chain's rows equal one-row passes
    over their prefixes: speculation does not change what attention computes for a token."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(2048, 3, 64, generator=gen) for _ in range(2))
    num_rows, num_keys = 6, 1030
    q = torch.randn(num_rows, 9, 64, generator=gen)
    context = slice(100, 100 + num_keys)
    mask = torch.rand(num_rows, num_keys, generator=gen) < 0.7
    together = cpu_gemm.attention(q, k_cache, v_cache, context, mask, False, 0.125)
    for i in range(num_rows):
        own_keys = torch.arange(100, 100 + num_keys)[mask[i]]
        alone = cpu_gemm.attention(q[i : i + 1].clone(), k_cache, v_cache, own_keys, None, False, 0.125)
        assert torch.equal(together[i : i + 1], alone)
    chain = cpu_gemm.attention(q, k_cache, v_cache, context, None, True, 0.125)
    for i in range(num_rows):
        prefix = slice(100, 100 + num_keys - num_rows + i + 1)
        assert torch.equal(chain[i : i + 1], cpu_gemm.attention(q[i : i + 1], k_cache, v_cache, prefix, None, False,
                                                                0.125))


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 64), (4, 1, 256), (14, 2, 16)])
def test_the_kernel_attention_is_the_same_on_any_number_of_threads(heads, kv_heads, dim):
    """How many threads share a call decides which query heads are taken together over a
    key-value head's cache; no head's floats may depend on it."""
    gen = torch.Generator().manual_seed(heads + dim)
    k_cache, v_cache = (torch.randn(1500, kv_heads, dim, generator=gen) for _ in range(2))
    threads = torch.get_num_threads()
    for num_rows in (1, 3):
        q = torch.randn(num_rows, heads, dim, generator=gen)
        outs = []
        try:
            for num_threads in (1, 2, 3, 8):
                torch.set_num_threads(num_threads)
                outs.append(cpu_gemm.attention(q, k_cache, v_cache, slice(0, 1400), None, True, dim ** -0.5))
        finally:
            torch.set_num_threads(threads)
        assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
def test_the_kernel_attention_s_avx512_path_is_its_avx2_path_bit_for_bit():
    """On AVX-512 two query heads share a register; every lane must still do what the AVX2 code
    does for its head, so a machine of either kind attends to the same floats."""
    lib, isa = cpu_gemm._library()
    if isa < 2 or not hasattr(lib, "specinfer_attention_isa"):
        pytest.skip("no AVX-512 on this CPU")
    gen = torch.Generator().manual_seed(11)
    try:
        for heads, kv_heads, dim in ((9, 3, 64), (8, 2, 128), (4, 1, 256), (6, 2, 72), (2, 1, 16)):
            k_cache, v_cache = (torch.randn(700, kv_heads, dim, generator=gen) for _ in range(2))
            q = torch.randn(5, heads, dim, generator=gen)
            mask = torch.rand(5, 650, generator=gen) < 0.7
            for context, row_mask, is_causal in ((slice(3, 653), None, True), (torch.randperm(700, generator=gen)[:650],
                                                                                mask, False)):
                outs = []
                for path in (1, 0):  # AVX2, then what the CPU has
                    lib.specinfer_attention_isa(path)
                    outs.append(cpu_gemm.attention(q, k_cache, v_cache, context, row_mask, is_causal, dim ** -0.5))
                assert torch.equal(outs[0], outs[1]), (heads, kv_heads, dim)
    finally:
        lib.specinfer_attention_isa(0)


@needs_kernel
def test_a_row_that_sees_no_key_is_zeros():
    q = torch.randn(2, 2, 8)
    k_cache = v_cache = torch.randn(16, 2, 8)
    mask = torch.tensor([[True, False], [False, False]])
    out = cpu_gemm.attention(q, k_cache, v_cache, slice(0, 2), mask, False, 0.3)
    assert torch.equal(out[1], torch.zeros(16)) and bool(out[0].ne(0).any())


@needs_kernel
def test_the_decoder_attends_through_the_kernel_on_a_cpu(pair_runners):
    llm, _ = pair_runners
    assert llm.model.attention_name == "cpu-kernel"
