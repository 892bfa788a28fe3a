"""Optional GPU kernels for SpecInfer's tree-based parallel decoding (Section 4.2).

`tree_attention`: Triton tree attention over the paged KV cache (`TritonAttention` backend).
`commit`: one-launch commit of the accepted path's K/V for all layers.
`cuda_graphs`: captured verification/decode steps for bucketed batch and tree sizes.

Everything imports without triton or CUDA; `HAS_TRITON` says whether the kernels can run.
Without CUDA, Triton kernels run in its CPU interpreter (slow; used by the tests).
"""

from specinfer.engine.kernels.tree_attention import HAS_TRITON, is_interpreted

__all__ = ["HAS_TRITON", "enable_triton", "is_interpreted"]


def enable_triton(runner, fused_commit: bool = True, **attention_kwargs):
    """Switches a `ModelRunner` to Triton tree attention (and the fused commit); returns the backend.

    Sets `runner.model.attention_backend`; with `fused_commit`, rewraps `runner.kv` (same tensors)
    so that `ModelRunner.commit` moves the accepted path with one launch for all layers.
    """
    from specinfer.engine.kernels.commit import FusedCommitKVCache
    from specinfer.engine.kernels.tree_attention import TritonAttention

    backend = TritonAttention.for_config(runner.cfg, **attention_kwargs)
    runner.model.attention_backend = backend
    if fused_commit:
        runner.kv = FusedCommitKVCache(runner.kv.k, runner.kv.v)
    return backend
