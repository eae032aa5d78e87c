"""A minimal safetensors reader and writer on numpy memory maps.

Reading maps the file and slices it, so a device that needs one shard of one tensor reads
only those bytes; bfloat16 works through `ml_dtypes` (the `safetensors` package's numpy
backend has no bfloat16). Writes are atomic (a temp file, then a rename). The format: an 8-byte
little-endian header size, a JSON header {name: {dtype, shape, data_offsets}}, then the data.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class File:
    """Tensors of one .safetensors file, as read-only memory-mapped numpy arrays."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        self.metadata = header.pop("__metadata__", {})
        self._header = header
        self._data_start = 8 + size

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def array(self, name: str) -> np.ndarray:
        info = self._header[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin,
                         shape=shape)


def write(path: str, tensors: Iterable[tuple[str, np.ndarray]], metadata=None) -> None:
    """Write (name, array) pairs into one file."""
    tensors = [(name, np.ascontiguousarray(a)) for name, a in tensors]
    header, offset = {}, 0
    for name, a in tensors:
        if a.dtype not in _NAMES:
            raise ValueError(f"cannot write tensor {name} of dtype {a.dtype}")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, a in tensors:
            f.write(a.tobytes())
    os.replace(tmp, path)
