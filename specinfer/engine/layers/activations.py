"""The gated MLP's activations, as transformers' ACT2FN computes them: SwiGLU (silu) for
Llama, Mistral, Qwen and Phi-3, GeGLU with the tanh GELU for Gemma 3."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}
