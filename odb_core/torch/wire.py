"""How a worker's records travel to the main process.

A DataLoader worker ships each tensor through its own shared-memory segment plus
a file-descriptor handoff, which costs far more than copying a small tensor. A
plain DataLoader pays that once per collated batch; a per-sample source would pay
it once per sample. So workers pickle small CPU tensors by value into one
bytes payload and leave large ones to the usual shared-memory path. The
main process gets back equal tensors (same dtype, shape and values).
"""

from __future__ import annotations

import io
import pickle
from typing import Any, NamedTuple

import torch

SMALL_TENSOR_BYTES = 128 * 1024


class Packed(NamedTuple):
    payload: bytes
    large: list[torch.Tensor]


def _rebuild(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, large: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.large = large

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is torch.Tensor and not _small(obj):
            self.large.append(obj)
            return len(self.large) - 1
        return None

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and _small(obj):
            t = obj.detach().contiguous()
            raw = (
                t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
            )
            return _rebuild, (raw.numpy().tobytes(), t.dtype, tuple(t.shape))
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, large: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.large = large

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.large[int(pid)]


def _small(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_quantized
        and t.numel() * t.element_size() <= SMALL_TENSOR_BYTES
    )


def pack(obj: Any) -> Packed:
    buf = io.BytesIO()
    large: list[torch.Tensor] = []
    _Pickler(buf, large).dump(obj)
    return Packed(buf.getvalue(), large)


def unpack(p: Packed) -> Any:
    return _Unpickler(io.BytesIO(p.payload), p.large).load()
