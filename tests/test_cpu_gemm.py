"""The CPU matrix kernel (`layers/cpu_gemm.c`): right to float32 rounding, and bitwise the same
for a row whatever the batch around it, the thread split or the instruction set."""

from __future__ import annotations

import platform

import pytest
import torch

from specinfer.engine.layers import cpu_gemm
from specinfer.engine.layers import linear as linear_mod
from specinfer.engine.layers.linear import Panels, linear, pack

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="the CPU kernel is not built for this machine")

# (n, k): whole panels and a partial one; k below, at and off the vector widths.
SHAPES = [(64, 64), (40, 17), (100, 576), (16, 1), (3, 8), (257, 96)]


def raw_gemm(panels: torch.Tensor, x: torch.Tensor, n: int, isa: int, threads: int) -> torch.Tensor:
    lib, _ = cpu_gemm._library()
    out = torch.full((x.shape[0], n), float("nan"))
    lib.specinfer_gemm(panels.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], n, x.shape[1], isa, threads)
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
