"""Offloading inference: the LLM's layer weights live in CPU memory and stream to the GPU.

SpecInfer also targets offloading-based serving (its evaluation, Section 6, against FlexGen):
when the LLM does not fit in GPU memory, every LLM step has to move all layer weights over PCIe,
so the step's cost is dominated by that transfer and hardly depends on how many tokens the step
verifies. Tree-based parallel decoding (Section 4.2) then pays off most: one step verifies a
whole token tree for the price of one weight transfer. This module provides the offloaded LLM:

* `StreamedWeights` replaces `DecoderModel.w`. Layer weights stay in (pinned) CPU memory; two
  device buffers take turns. When the forward pass first touches layer i, the compute stream
  waits for layer i's copy, and a side stream starts copying layer i + 1 (wrapping to layer 0
  for the next step) into the other buffer, after waiting until the compute stream has finished
  with the layer that buffer held. Embeddings, the final norm and the LM head stay resident.
* `offload_model` turns a CPU-built `DecoderModel` into an offloaded one on `device`;
  `should_offload` decides from a GPU memory cap (`OffloadConfig.gpu_memory_cap`), or the mode
  is forced on/off explicitly.

On CPU (device=cpu) the "copies" are no-ops (the buffers alias the CPU tensors) and there are no
streams, but the bookkeeping and the order of fetches are the same and are logged in
`StreamedWeights.log`, so tests check the streaming order and that outputs equal the resident
model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer.engine.models.transformer import DecoderModel

RESIDENT = ("embed", "norm", "lm_head")


@dataclass(frozen=True)
class OffloadConfig:
    enabled: bool | None = None  # None: offload when the weights exceed the cap
    gpu_memory_cap: int | None = None  # bytes the LLM's weights (plus reserve) may use on the GPU
    reserve_bytes: int = 0  # e.g. the KV cache and activations, counted against the cap


def weight_bytes(weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> int:
    seen: set[int] = set()
    total = 0
    for t in weights.values():
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * (torch.empty((), dtype=dtype).element_size() if dtype else t.element_size())
    return total


def should_offload(model_bytes: int, config: OffloadConfig) -> bool:
    if config.enabled is not None:
        return config.enabled
    if config.gpu_memory_cap is None:
        return False
    return model_bytes + config.reserve_bytes > config.gpu_memory_cap


def _layer_of(key: str) -> int | None:
    head, _, _ = key.partition(".")
    return int(head) if head.isdigit() else None


class StreamedWeights:
    """A dict-like view of the model weights that streams layer tensors to the device on access."""

    def __init__(
        self, resident: dict[str, torch.Tensor], layers: list[dict[str, torch.Tensor]], device, pin: bool = True
    ):
        self.device = torch.device(device)
        self.resident = resident
        self.num_layers = len(layers)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and pin:
            layers = [{k: t.pin_memory() for k, t in layer.items()} for layer in layers]
        self.cpu_layers = layers
        self.log: list[tuple[str, int]] = []  # ("fetch", i) issued, ("use", i) first touched
        self.current: int | None = None
        if self.is_cuda:
            shapes = layers[0]  # every layer has the same tensors
            self.buffers = [{k: torch.empty_like(t, device=self.device) for k, t in shapes.items()} for _ in range(2)]
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self.ready = [torch.cuda.Event() for _ in range(2)]  # copy into buffer j finished
            self.freed = [torch.cuda.Event() for _ in range(2)]  # compute finished with buffer j
        else:
            self.buffers = [{}, {}]
        self.holds: list[int | None] = [None, None]  # layer each buffer holds (or is receiving)

    # dict-like surface used by DecoderModel.forward
    def __getitem__(self, key: str) -> torch.Tensor:
        layer = _layer_of(key)
        if layer is None:
            return self.resident[key]
        return self._layer(layer)[key.partition(".")[2]]

    def get(self, key: str, default=None):
        layer = _layer_of(key)
        if layer is None:
            return self.resident.get(key, default)
        return self._layer(layer).get(key.partition(".")[2], default)

    def __contains__(self, key: str) -> bool:
        layer = _layer_of(key)
        return key in self.resident if layer is None else key.partition(".")[2] in self.cpu_layers[layer]

    def _layer(self, layer: int) -> dict[str, torch.Tensor]:
        if layer != self.current:
            self._enter(layer)
        return self.buffers[self.holds.index(layer)]

    def _fetch(self, layer: int, buf: int) -> None:
        """Starts copying `layer` into buffer `buf` (side stream, after compute is done with it)."""
        self.log.append(("fetch", layer))
        self.holds[buf] = layer
        if not self.is_cuda:
            self.buffers[buf] = self.cpu_layers[layer]  # degenerate mode: alias, no copy
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[buf])
            dst, src = self.buffers[buf], self.cpu_layers[layer]
            for k, t in src.items():
                dst[k].copy_(t, non_blocking=True)
            self.ready[buf].record(self.copy_stream)

    def _enter(self, layer: int) -> None:
        if self.current is not None and self.is_cuda:
            # Everything the compute stream queued so far used the current layer's buffer.
            self.freed[self.holds.index(self.current)].record(torch.cuda.current_stream(self.device))
        if layer not in self.holds:  # not prefetched (first step, or out of order): fetch now
            buf = 0 if self.current is None else 1 - self.holds.index(self.current)
            self._fetch(layer, buf)
        buf = self.holds.index(layer)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[buf])
        self.log.append(("use", layer))
        self.current = layer
        nxt = (layer + 1) % self.num_layers
        if nxt != layer:
            self._fetch(nxt, 1 - buf)


def offload_model(model: DecoderModel, device, pin: bool = True) -> DecoderModel:
    """Makes a CPU-built model compute on `device` with its layer weights streamed from CPU memory.

    Build the model with device="cpu" (so the full weights never touch the GPU), then call this.
    """
    if model.device.type != "cpu":
        raise ValueError("build the model on the CPU before offloading it")
    dev = torch.device(device)
    if dev.type != "cpu" and any(not isinstance(t, torch.Tensor) or t.layout != torch.strided for t in model.w.values()):
        raise ValueError("the model's weights are laid out for the CPU's kernels: build it with is_packed=False "
                         "before offloading it")
    w = model.w
    resident = {}
    for name in RESIDENT:
        if name == "lm_head" and w["lm_head"] is w["embed"]:
            resident["lm_head"] = resident["embed"]
        else:
            resident[name] = w[name].to(dev)
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(model.cfg.num_layers)]
    for name, t in w.items():
        layer = _layer_of(name)
        if layer is not None:
            layers[layer][name.partition(".")[2]] = t
    model.w = StreamedWeights(resident, layers, dev, pin=pin)
    model.device = dev
    model.rope = [(cos.to(dev), sin.to(dev)) for cos, sin in model.rope]
    if model.embed_scale is not None:
        model.embed_scale = model.embed_scale.to(dev)
    return model
