"""Flags that more than one command defines: the model-free speculators and how the models execute.

A leaf module: the commands' parsers import it, and it imports none of them.
"""

from __future__ import annotations

import argparse

from specinfer.engine.config import ATTENTION_BACKENDS


def add_model_free_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-free", action=argparse.BooleanOptionalAction, default=True,
                   help="lookup and suffix join the SSM pool (default; a pool naming either is taken as given)")


def add_exec_flags(p: argparse.ArgumentParser) -> None:
    """How the models execute (engine.config.ExecConfig): attention backend, CUDA graphs, offloading."""
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="triton: one fused tree-attention launch per layer over the paged KV cache; sdpa: torch "
                        "per request with a dense mask; auto (default): triton on CUDA when importable, else sdpa")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay captured decode/verify steps (default: on with CUDA and the Triton backend)")
    p.add_argument("--offload", action="store_true",
                   help="keep the LLM's layer weights in pinned host memory, streamed to the GPU per layer")
