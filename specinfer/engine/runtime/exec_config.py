"""How a model executes on its device (`ExecConfig`) and the switches that set it. No torch here:
the command line and the services parse these before any model code loads."""

from __future__ import annotations

from dataclasses import dataclass

from specinfer.errors import UserError
from specinfer.limits import ATTENTION_BACKENDS


@dataclass(frozen=True)
class ExecConfig:
    """How a model executes on its device, chosen once at load time and passed down.

    `attention`: "triton" runs every request's prefill chunk and token tree of a step in one
    kernel launch per layer, reading K/V in place from the paged cache, and commits accepted
    paths with one fused launch (SpecInfer Section 4.2); "sdpa" is attention per request with a
    dense topology-aware mask (torch's SDPA; a float32 model on a CPU uses the CPU kernel's,
    `layers/cpu_attention.c`, where it is built); "auto" is Triton on CUDA when it is importable,
    else SDPA.
    `cuda_graphs`: replay captured decode/verify steps for bucketed batch and tree sizes (eager
    outside the buckets); None = on wherever it can be (CUDA with the Triton backend).
    `offload`: keep the layer weights in pinned host memory and stream them to the GPU layer by
    layer with prefetch (the offloading setting of the paper's evaluation, Section 6).
    """

    attention: str = "auto"
    cuda_graphs: bool | None = None
    offload: bool = False

    def __post_init__(self):
        if self.attention not in ATTENTION_BACKENDS:
            raise UserError(f"unknown attention backend {self.attention!r}: use {', '.join(ATTENTION_BACKENDS)}")


def parse_auto_switch(text: str, what: str) -> bool | None:
    """A switch whose default depends on the host: auto (None), on or off."""
    value = str(text).strip().lower()
    choices = {"auto": None, "on": True, "1": True, "true": True, "off": False, "0": False, "false": False}
    if value not in choices:
        raise UserError(f"{what} {text!r}: use auto, on or off")
    return choices[value]


def parse_cuda_graphs(text: str) -> bool | None:
    """A service's --cuda-graphs value: auto (None: on wherever it can be), on or off."""
    return parse_auto_switch(text, "CUDA graphs")
