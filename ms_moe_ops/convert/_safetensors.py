"""Reading and writing safetensors files one tensor at a time.

Reading: the `safetensors` library opens and validates each file (header, offsets, sizes) and
lists its tensors; the data of one tensor is then read with a positioned read of its validated
byte range into a fresh array. No memory map stays open (the pages of a mapped file count toward
the process's resident memory as they are read), and bfloat16, which numpy lacks, is widened to
float32 exactly.

Writing: the header of every tensor is known before any data (shapes and dtypes come from the
plan), so a file is written header first and each tensor at its own offset, whenever it is ready.
"""
import json
import os
import struct

import numpy as np
from safetensors import SafetensorError, safe_open

__all__ = ["SafetensorsFile", "SafetensorsWriter", "cast", "DTYPE_BYTES"]

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
ALIGN = 8


class SafetensorsFile:
    """The tensors of one safetensors file: `names`, `shape(name)`, `dtype(name)` (safetensors'
    names: "F32", "BF16", ...), `nbytes(name)`, `read(name)` and `read_into(name, out)`
    (float32), `read_raw(name)` (the stored bytes as a uint8 array)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{self.path}: no such file")
        try:
            with safe_open(self.path, framework="numpy") as f:
                self.metadata = f.metadata() or {}
                listed = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()))
                          for n in f.keys()}
        except SafetensorError as err:
            raise ValueError(f"{self.path}: not a valid safetensors file ({err})") from None
        with open(self.path, "rb") as f:  # validated above: offsets come from the same header
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        self._base = 8 + size
        self._entries = {}
        for name, (dtype, shape) in listed.items():
            begin, end = header[name]["data_offsets"]
            self._entries[name] = (dtype, shape, self._base + begin, end - begin)

    @property
    def names(self):
        return list(self._entries)

    def dtype(self, name):
        return self._entries[name][0]

    def shape(self, name):
        return self._entries[name][1]

    def nbytes(self, name):
        return self._entries[name][3]

    def read_raw(self, name):
        raw = np.empty(self._entries[name][3], np.uint8)
        self._pread(name, raw)
        return raw

    def read(self, name):
        """The tensor as float32 (float16 and bfloat16 widened exactly; float64 rounded)."""
        out = np.empty(self.shape(name), np.float32)
        self.read_into(name, out)
        return out

    def read_into(self, name, out):
        """Reads the tensor into out, a C-contiguous float32 array (or slice) of its shape."""
        dtype, shape, _, size = self._entries[name]
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.path}: tensor '{name}' has dtype {dtype}, a float tensor "
                             f"(F32, F16, BF16, F64) was expected")
        if tuple(out.shape) != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"{self.path}: tensor '{name}' is {list(shape)} {dtype}, cannot be "
                             f"read into a {list(out.shape)} {out.dtype} array")
        raw = out.reshape(-1).view(np.uint8) if dtype == "F32" else np.empty(size, np.uint8)
        self._pread(name, raw)
        if dtype == "BF16":  # the high half of a float32: widening is exact
            np.left_shift(raw.view("<u2"), 16, out=out.reshape(-1).view(np.uint32),
                          dtype=np.uint32)
        elif dtype != "F32":
            out.reshape(-1)[...] = raw.view(np.dtype(_NUMPY[dtype]).newbyteorder("<"))

    def _pread(self, name, buffer):
        """The stored bytes of tensor `name` into buffer (a uint8 array of their size)."""
        offset = self._entries[name][2]
        view = memoryview(buffer)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise ValueError(f"{self.path}: tensor '{name}' ends past the end of the file")
                done += n
        finally:
            os.close(fd)


def cast(array, dtype):
    """A float array as the bytes of safetensors dtype `dtype` (a uint8 view of a new or the same
    array): float32 -> bfloat16 rounds to nearest-even (NaN stays NaN), so a bfloat16 value
    widened to float32 comes back unchanged."""
    array = np.ascontiguousarray(array)
    if dtype == "BF16":
        bits = np.ascontiguousarray(array, np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
        nan = np.isnan(array.astype(np.float32, copy=False))
        out = np.where(nan, (bits >> 16) | np.uint32(0x40), rounded).astype("<u2")
        return out.reshape(-1).view(np.uint8)
    return np.ascontiguousarray(array, np.dtype(_NUMPY[dtype]).newbyteorder("<")).reshape(-1).view(
        np.uint8)


class SafetensorsWriter:
    """A safetensors file of known tensors [(name, dtype, shape)], written header first; then
    `write(name, array)` in any order (the array is cast to the tensor's dtype); `close()`
    checks that every tensor was written."""

    def __init__(self, path, tensors, metadata=None):
        self.path = os.fspath(path)
        self._entries = {}
        header = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name, dtype, shape in tensors:
            size = int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": [int(s) for s in shape],
                            "data_offsets": [offset, offset + size]}
            self._entries[name] = (dtype, tuple(int(s) for s in shape), offset, size)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % ALIGN)  # the data starts aligned, as safetensors writes it
        self._base = 8 + len(text)
        self._pending = set(self._entries)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self._fd, self._base + offset)
            _pwrite(self._fd, struct.pack("<Q", len(text)) + text, 0)
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, name, array):
        dtype, shape, offset, _ = self._entries[name]
        if tuple(array.shape) != shape:
            raise ValueError(f"{self.path}: tensor '{name}' must be {list(shape)}, got "
                             f"{list(array.shape)}")
        data = cast(array, dtype)  # exactly `size` bytes: the shape was checked
        _pwrite(self._fd, memoryview(data), self._base + offset)
        self._pending.discard(name)

    def close(self, check=True):
        os.close(self._fd)
        if check and self._pending:
            raise RuntimeError(f"{self.path}: tensors never written: {sorted(self._pending)[:5]}")


def _pwrite(fd, data, offset):
    data = memoryview(data).cast("B")
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
