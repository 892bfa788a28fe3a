"""Loads model weights from a local Hugging Face checkpoint directory (safetensors only) or a
GGUF file (`specinfer.model_source` says which a path is).

Both a single `model.safetensors` and a sharded `model.safetensors.index.json` are read. Pickled
`.bin` checkpoints are refused: loading them would execute arbitrary code. A GGUF's tensors are
dequantized from the file as they are read (`gguf.py`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import torch

from specinfer.engine.models.config import ModelConfig, family_of
from specinfer.engine.models.gguf import GGUFTensors
from specinfer.engine.models.hf import check_layout, decoder_layout, decoder_weights, fuse
from specinfer.errors import UserError
from specinfer.limits import MODEL_DTYPES, Q8_DTYPE
from specinfer.model_source import ModelSource, resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own bound on its JSON header


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unsupported dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def compute_dtype(dtype: str, device) -> tuple[torch.dtype, bool]:
    """(the dtype a model computes in, whether its matrices are 8-bit block codes) for a dtype name:
    `limits.Q8_DTYPE` computes in float32 over codes, on the CPU only."""
    if dtype == Q8_DTYPE:
        if torch.device(device).type != "cpu":
            raise UserError(f"dtype {Q8_DTYPE} runs on the CPU only: choose one of {', '.join(MODEL_DTYPES)} "
                            f"on {device}")
        return torch.float32, True
    return parse_dtype(dtype), False


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise UserError(f"malformed {index}: {exc}") from exc
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise UserError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise UserError(f"{model_dir} holds only pickle checkpoints (.bin/.pt); convert them to safetensors")
    raise UserError(f"no *.safetensors weights in {model_dir}")


class SafetensorsFile:
    """A safetensors file read tensor by tensor into memory of its own, with plain reads: the
    interface of safetensors' `safe_open` (`keys()`, `get_tensor(name)`, `get_slice(name)[rows]`
    and `[:, columns]`), without its memory map.
    A mapped file stays resident as long as any tensor read from it lives, so the tensors the
    loader fuses (qkv, gate/up: half of a checkpoint) or casts to another dtype would stay in
    memory twice, as their copy and as pages of the file; read this way, each is freed with its
    last reference."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = None
        self._entries: dict[str, dict] = {}
        self._data_start = 0

    def __enter__(self) -> "SafetensorsFile":
        self._file = open(self.path, "rb")
        try:
            (size,) = struct.unpack("<Q", self._file.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(self._file.read(size))
            self._entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            self._file.close()
            raise UserError(f"{self.path} is not a readable safetensors file ({exc})") from None
        self._data_start = 8 + size
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._read(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get_slice(self, name: str) -> "_Slice":
        return _Slice(self, name)

    def _read(self, name: str, rows: slice = slice(None)) -> torch.Tensor:
        """The tensor, or the rows `rows` of it (only their bytes are read)."""
        entry = self._entries[name]
        dtype = _STORED_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise UserError(f"{self.path}: tensor {name!r} has dtype {entry.get('dtype')!r}, which is not supported")
        start, end = entry["data_offsets"]
        shape = list(entry["shape"])
        row_bytes = (end - start) // shape[0] if shape and shape[0] else 0
        if math.prod(shape) * dtype.itemsize != end - start:
            raise UserError(f"{self.path}: tensor {name!r} holds {end - start} bytes for shape {shape}")
        if shape:
            first, last, _ = rows.indices(shape[0])
            shape[0] = max(0, last - first)
            start, end = start + first * row_bytes, start + max(first, last) * row_bytes
        tensor = torch.empty(shape, dtype=dtype)
        if end > start:
            self._file.seek(self._data_start + start)
            if self._file.readinto(tensor.view(-1).view(torch.uint8).numpy()) != end - start:
                raise UserError(f"{self.path} is truncated (tensor {name!r})")
        return tensor


class _Slice:
    """`get_slice(name)[lo:hi]` (rows: only their bytes are read) or `[:, lo:hi]` (columns: the
    tensor is read, and the columns copied out of it)."""

    def __init__(self, f: SafetensorsFile, name: str):
        self.f, self.name = f, name

    def __getitem__(self, key) -> torch.Tensor:
        rows, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("rows must be a contiguous slice")
        tensor = self.f._read(self.name, rows)
        return tensor[(slice(None), *rest)].contiguous() if rest else tensor


def open_checkpoint(model: str | Path | ModelSource, dtype: torch.dtype | None = None) -> Iterator:
    """The checkpoint's tensor files, each open while it is iterated: handles with `keys()`,
    `get_tensor(name)` and `get_slice(name)` (`SafetensorsFile`, or `GGUFTensors`, which
    dequantizes a GGUF's tensors to `dtype` as they are read)."""
    source = resolve(model)
    if source.is_gguf:
        with GGUFTensors(source, dtype) as f:
            yield f
        return
    for path in safetensors_files(source.path):
        with SafetensorsFile(path) as f:
            yield f


def load_state_dict(model: str | Path | ModelSource, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, on CPU, under their Hugging Face names: a checkpoint
    directory's in their stored dtype; a GGUF's dequantized to `dtype` (None: block types to
    float32, float types as stored)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in open_checkpoint(model, dtype):
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    return tensors


def _prefixed(keys) -> dict[str, str]:
    """Each stored tensor name under the name with the `model.` prefix (some exports drop it)."""
    keys = list(keys)
    if "model.embed_tokens.weight" not in keys and "embed_tokens.weight" in keys:
        return {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): k for k in keys}
    return {k: k for k in keys}


def engine_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames HF tensors to the runner's fused layout (`hf.py`), by the checkpoint's family,
    and checks that nothing is missing."""
    state = {name: state[stored] for name, stored in _prefixed(state).items()}
    return decoder_weights(cfg, state, family_of(cfg).tensors)


class StreamedWeights(Mapping):
    """A checkpoint's weights in the runner's fused layout, each read (a GGUF's dequantized) when
    it is asked for and not kept: a model that lays each weight out as it takes it
    (`DecoderModel`) holds at most one of them beyond its own at a time, where a state dict holds
    them all (for a quantized GGUF, all in float32). A tensor that serves two weights (a tied
    head) is read once and kept until both have taken it."""

    def __init__(self, cfg: ModelConfig, handles: dict[str, object]):
        self.handles = handles
        self.stored = _prefixed(handles)
        self.layout = decoder_layout(cfg, self.stored, family_of(cfg).tensors)
        check_layout(cfg, self.layout, lambda name: self._handle(name).shape(self.stored[name]))
        uses: dict[tuple[str, ...], int] = {}
        for hf_names in self.layout.values():
            uses[hf_names] = uses.get(hf_names, 0) + 1
        self._shared = {hf_names: [n, None] for hf_names, n in uses.items() if n > 1}  # [takers left, tensor]

    def _handle(self, name: str):
        return self.handles[self.stored[name]]

    def __getitem__(self, engine_name: str) -> torch.Tensor:
        hf_names = self.layout[engine_name]
        shared = self._shared.get(hf_names)
        if shared is not None and shared[1] is not None:
            tensor = shared[1]
        else:
            tensor = fuse([self._handle(name).get_tensor(self.stored[name]) for name in hf_names])
        if shared is not None:
            shared[0] -= 1
            shared[1] = tensor if shared[0] > 0 else None
        return tensor

    def __iter__(self):
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)


@contextmanager
def stream_weights(model: str | Path | ModelSource, cfg: ModelConfig,
                   dtype: torch.dtype | None = None) -> Iterator[StreamedWeights]:
    """The checkpoint's weights as `StreamedWeights`, its files open while the block runs: a
    GGUF's tensors dequantized to `dtype` (see `load_state_dict`), a checkpoint directory's in
    their stored dtype."""
    source = resolve(model)
    with ExitStack() as stack:
        if source.is_gguf:
            files = [stack.enter_context(GGUFTensors(source, dtype))]
        else:
            files = [stack.enter_context(SafetensorsFile(path)) for path in safetensors_files(source.path)]
        yield StreamedWeights(cfg, {name: f for f in files for name in f.keys()})
