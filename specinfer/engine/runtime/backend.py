"""Execution backends of a model runner: attention kernel, CUDA graphs, weight offloading.

An `ExecConfig` is resolved once, when a model loads, into concrete choices
(`resolve_exec`), then installed on the loaded `ModelRunner` (`apply_exec`). The Triton backend
verifies every request's token tree and prefill chunk of a step in one launch per layer, with
the topology-aware mask as ancestor bits and K/V read in place from the paged cache, and
commits accepted paths with one fused launch (SpecInfer Section 4.2). Offloading keeps layer
weights in host memory and streams them per layer (the paper's offloading setting, Section 6).
A choice that cannot apply on the device is a `UserError` naming the flag; "auto" choices never
are: they fall back to what the device supports.
"""

from __future__ import annotations

import torch

from specinfer.engine.runtime.exec_config import ExecConfig
from specinfer.errors import UserError
from specinfer.engine.kernels import enable_triton


def triton_unusable_reason(device) -> str | None:
    """None when Triton kernels can run for tensors on `device`, else why not."""
    from specinfer.engine.kernels.tree_attention import HAS_TRITON, is_interpreted  # triton: on choosing

    if not HAS_TRITON:
        return "triton is not installed"
    is_cuda = torch.device(device).type == "cuda"
    if is_interpreted():
        return "TRITON_INTERPRET=1 runs Triton kernels on CPU tensors only" if is_cuda else None
    if not is_cuda:
        return (f"Triton kernels need a CUDA device (the model is on {device}); "
                "TRITON_INTERPRET=1 runs them in Triton's CPU interpreter (slow)")
    return None


def resolve_exec(cfg: ExecConfig, device, is_parallel: bool = False) -> ExecConfig:
    """The concrete choices for a model on `device` (attention triton|sdpa, cuda_graphs a bool).

    Idempotent: a resolved config resolves to itself. Raises `UserError` for an explicit choice
    the device or the other choices cannot support.
    """
    is_cuda = torch.device(device).type == "cuda"
    attention = "sdpa"
    if cfg.attention == "triton" or (cfg.attention == "auto" and is_cuda):
        reason = triton_unusable_reason(device)
        if reason is None:
            attention = "triton"
        elif cfg.attention == "triton":
            raise UserError(f"--attention triton: {reason}")
    if cfg.offload:
        if not is_cuda:
            raise UserError(f"--offload streams layer weights from host memory to a GPU: it needs a CUDA device, "
                            f"not {device}")
        if is_parallel:
            raise UserError("--offload does not combine with --tensor-parallel: shard the LLM or offload it, not both")
    graphs = cfg.cuda_graphs
    if graphs:
        if not is_cuda:
            raise UserError(f"--cuda-graphs needs a CUDA device, not {device} (use --no-cuda-graphs)")
        if attention != "triton":
            raise UserError("--cuda-graphs replays the Triton attention path: use --attention triton or auto")
        if is_parallel:
            raise UserError("--cuda-graphs does not combine with --tensor-parallel (use --no-cuda-graphs)")
        if cfg.offload:
            raise UserError("--cuda-graphs does not combine with --offload (weights stream in outside the graph)")
    else:
        graphs = bool(graphs is None and is_cuda and attention == "triton" and not is_parallel and not cfg.offload)
    return ExecConfig(attention=attention, cuda_graphs=graphs, offload=cfg.offload)


def apply_exec(runner, cfg: ExecConfig) -> None:
    """Installs a resolved config's attention backend and CUDA graphs on a loaded one-process runner
    (offloading is applied while loading, see `ModelRunner.from_dir`)."""
    if cfg.attention == "triton":
        enable_triton(runner)
    if cfg.cuda_graphs:
        from specinfer.engine.kernels.cuda_graphs import GraphRunner  # triton: its graphs capture the kernels

        runner.graphs = GraphRunner(runner).install()
