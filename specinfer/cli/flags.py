"""Flags that more than one command defines: the models' dtypes, the model-free speculators, how
the models execute, prefix caching and the verifiers' KV cache.

Each is declared once, in `specinfer.serving.shared_flags`, for the services and the commands
alike; `main` resolves them after parsing (the flag, else its environment variable, else the
default). A leaf module: the commands' parsers import it, and it imports none of them.
"""

from __future__ import annotations

import argparse

from specinfer.serving.shared_flags import (
    add_declared, exec_flags, kv_flags, llm_dtype_flag, model_free_flag, prefix_caching_flag, ssm_dtype_flag,
)


def add_model_free_flag(p: argparse.ArgumentParser) -> None:
    add_declared(p, model_free_flag("the SSM pool"))


def add_dtype_flags(p: argparse.ArgumentParser) -> None:
    add_declared(p, llm_dtype_flag(), ssm_dtype_flag())


def add_exec_flags(p: argparse.ArgumentParser) -> None:
    """How the models execute (engine.config.ExecConfig): attention backend, CUDA graphs, offloading."""
    add_declared(p, *exec_flags(llm=True))


def add_prefix_caching_flag(p: argparse.ArgumentParser) -> None:
    add_declared(p, prefix_caching_flag())


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    """The verifiers' KV-cache size (`--kv-budget`, `--kv-memory-fraction`), as the verifier service takes them."""
    add_declared(p, *kv_flags())
