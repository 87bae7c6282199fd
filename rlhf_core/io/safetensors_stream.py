"""Write a safetensors file tensor by tensor, hashing the bytes as they go to disk.

``safetensors.torch.save_file`` builds the whole file in one bytes object (a second copy of every
tensor in host memory) and a manifest then reads it back to hash it. Here the header is computed
from shapes and dtypes alone, then each tensor is copied to host memory (if it lives on a device),
written and fed to sha256 before the next one is touched: at most one tensor in flight, and the
digest is known the moment the file is closed. The output is an ordinary safetensors file (the
format: 8-byte little-endian header length, JSON header padded with spaces to 8 bytes, then the
raw little-endian tensor bytes at the header's ``data_offsets``), read by
``safetensors.torch.load_file`` and by Hugging Face ``from_pretrained``.

A value may be a tensor or a ``LazyTensor`` (dtype, shape and a function producing it), so a caller
can gather a ZeRO-3 parameter only when its turn comes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor produced only when the writer reaches it (e.g. a ZeRO-3 gather, a device copy)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


Source = Union[torch.Tensor, LazyTensor]


class HashingFile:
    """A binary file opened for writing whose bytes are hashed as they are written.
    ``close()`` flushes and fsyncs (the checkpoint is renamed into place only after), and sets
    ``digest`` = {"sha256": hex, "bytes": size}, the manifest entry of the file."""

    def __init__(self, path: str | Path, *, fsync: bool = True):
        self.path = Path(path)
        self._fh = open(self.path, "wb")
        self._sha = hashlib.sha256()
        self._bytes = 0
        self._fsync = fsync
        self.digest: Optional[dict[str, Any]] = None

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self._sha.update(view)  # hashlib and file writes release the GIL on large buffers
        self._fh.write(view)
        self._bytes += view.nbytes

    def close(self) -> dict[str, Any]:
        if self.digest is None:
            self._fh.flush()
            if self._fsync:
                os.fsync(self._fh.fileno())
            self._fh.close()
            self.digest = {"sha256": self._sha.hexdigest(), "bytes": self._bytes}
        return self.digest

    def __enter__(self) -> "HashingFile":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._fh.close()


def write_hashed_bytes(path: str | Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path``; returns its manifest entry {"sha256", "bytes"}."""
    with HashingFile(path) as f:
        f.write(data)
    return f.digest


def write_hashed_json(path: str | Path, obj: Any) -> dict[str, Any]:
    return write_hashed_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def _spec(value: Source) -> tuple[torch.dtype, tuple[int, ...]]:
    if isinstance(value, LazyTensor):
        return value.dtype, tuple(value.shape)
    return value.dtype, tuple(value.shape)


def _header(tensors: Mapping[str, Source], metadata: Optional[Mapping[str, str]]) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, value in tensors.items():
        dtype, shape = _spec(value)
        if dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        header[name] = {"dtype": _DTYPES[dtype], "shape": [int(d) for d in shape], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # tensor data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _host_bytes(name: str, value: Source) -> memoryview:
    t = value.produce() if isinstance(value, LazyTensor) else value
    dtype, shape = _spec(value)
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(f"tensor {name!r} is {t.dtype} {tuple(t.shape)}, announced as {dtype} {shape}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())  # a view of the tensor's bytes, no copy on CPU


def write_safetensors(path: str | Path, tensors: Mapping[str, Source], *,
                      metadata: Optional[Mapping[str, str]] = None, fsync: bool = True) -> dict[str, Any]:
    """Write ``tensors`` (name -> tensor or ``LazyTensor``, in this order) as a safetensors file at
    ``path``; returns the file's manifest entry {"sha256", "bytes"} computed while writing.
    Tensors must not share memory with one another in a way that matters: each is written as its
    own bytes (tied weights should be passed once)."""
    with HashingFile(path, fsync=fsync) as f:
        f.write(_header(tensors, metadata))
        for name, value in tensors.items():
            f.write(_host_bytes(name, value))
    return f.digest
