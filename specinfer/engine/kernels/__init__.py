"""Optional GPU kernels for SpecInfer's tree-based parallel decoding (Section 4.2).

`tree_attention`: Triton tree attention over the paged KV cache (`TritonAttention` backend).
`commit`: one-launch commit of the accepted path's K/V for all layers.
`cuda_graphs`: captured verification/decode steps for bucketed batch and tree sizes.

Everything imports without triton or CUDA, and importing changes nothing in the process;
`HAS_TRITON` says whether the kernels can run. On a machine without CUDA they can run in
Triton's CPU interpreter (slow; the tests use it): call `use_interpreter()` first, before
anything imports the kernel modules.
"""

from __future__ import annotations

import os
import sys

__all__ = ["HAS_TRITON", "enable_triton", "is_interpreted", "use_interpreter"]

_KERNEL_MODULE = "specinfer.engine.kernels.tree_attention"


def use_interpreter() -> None:
    """Opts this process into Triton's CPU interpreter (``TRITON_INTERPRET=1``).

    Triton decides between compiled and interpreted kernels when a kernel is defined, that is
    when the kernel modules are imported, so this must come first; afterwards it raises unless
    the kernels are already interpreted.
    """
    if _KERNEL_MODULE in sys.modules:
        if not is_interpreted():
            raise RuntimeError("use_interpreter() must be called before the kernel modules are imported")
        return
    os.environ["TRITON_INTERPRET"] = "1"


def _tree_attention():
    """The kernel module, imported on first use: it imports triton, which `use_interpreter` must precede."""
    from specinfer.engine.kernels import tree_attention  # triton: on first use

    return tree_attention


def is_interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (tensors on CPU)."""
    return _tree_attention().is_interpreted()


def __getattr__(name: str):
    if name == "HAS_TRITON":
        return _tree_attention().HAS_TRITON
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def enable_triton(runner, fused_commit: bool = True, **attention_kwargs):
    """Switches a `ModelRunner` to Triton tree attention (and the fused commit); returns the backend.

    Sets `runner.model.attention_backend` and `runner.tree_backend` (the runner then hands each
    step's tree metadata straight to the backend, no dense masks); with `fused_commit`, rewraps
    `runner.kv` (same tensors) so that `ModelRunner.commit` moves the accepted path with one
    launch for all layers.
    """
    from specinfer.engine.kernels.commit import FusedCommitKVCache  # triton: as in _tree_attention

    backend = _tree_attention().TritonAttention.for_config(runner.cfg, **attention_kwargs)
    runner.model.attention_backend = backend
    runner.tree_backend = backend
    if fused_commit:
        runner.kv = FusedCommitKVCache(runner.kv.k, runner.kv.v)
    return backend
