"""Safetensors files written one tensor at a time, and read one slice at a time.

safetensors' `save_file` serializes a whole dict of tensors at once, so the writer would hold
a whole shard (by default the whole model). The format is an 8-byte little-endian header
length, a JSON header ({name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}) and
the raw bytes, so with every tensor's shape and dtype known up front the header is written
first and each tensor's bytes land at their offset when they arrive:

    w = SafetensorsWriter(path, {"a": ((2, 3), torch.float32), "b": ((4,), torch.bfloat16)})
    w.write("b", b); w.write("a", a); w.commit()      # `path` appears only now, complete

Reading goes through safetensors' own `safe_open` (lazy: `get_slice` reads only the rows and
columns asked for); `read_header` checks a file's header and size first, so a truncated or
foreign file is a CheckpointError naming it.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path

import torch

from nncompile.errors import CheckpointError

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
BY_NAME = {v: k for k, v in DTYPES.items()}
_ALIGN = 8          # the header is padded with spaces to a multiple of 8 bytes, as safetensors does


def nbytes(shape, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """A safetensors file whose tensors are written one by one (any order), under a temporary
    name in the same directory; `commit` renames it into place once every tensor is in,
    `abort` removes it."""

    def __init__(self, path: str | os.PathLike, specs: dict[str, tuple[tuple, torch.dtype]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, dict] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self.spans: dict[str, tuple[int, int, tuple, torch.dtype]] = {}
        for name, (shape, dtype) in specs.items():
            if dtype not in DTYPES:
                raise CheckpointError(f"{name!r} is {dtype}, which safetensors cannot store")
            size = nbytes(shape, dtype)
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self.spans[name] = (offset, size, tuple(shape), dtype)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % _ALIGN)
        self.start = 8 + len(text)
        self.missing = set(specs)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.file = open(self.tmp, "wb")
        try:
            self.file.write(struct.pack("<Q", len(text)) + text)
            self.file.truncate(self.start + offset)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, size, shape, dtype = self.spans[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(f"{name!r} is {tuple(tensor.shape)} {tensor.dtype}, but the "
                                  f"file's header says {shape} {dtype}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.seek(self.start + offset)
        self.file.write(memoryview(data))
        self.missing.discard(name)

    def commit(self) -> Path:
        """Flush, check every tensor was written, rename to the final name."""
        if self.missing:
            self.abort()
            raise CheckpointError(f"{self.path.name}: {sorted(self.missing)[:3]} were never "
                                  "written; nothing was saved under that name")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def read_header(path: str | os.PathLike) -> dict[str, tuple[tuple, torch.dtype]]:
    """{tensor name: (shape, dtype)} of a safetensors file, after checking that the header
    parses and the file holds every byte it announces (a truncated download or an
    interrupted copy is an error naming the file)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"the header announces {n} bytes but the file has {size}")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); it may be "
                              "truncated: copy or download it again") from None
    out: dict[str, tuple[tuple, torch.dtype]] = {}
    end = 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if spec.get("dtype") not in BY_NAME:
            raise CheckpointError(f"{path}: {name!r} has dtype {spec.get('dtype')!r}, which "
                                  "nncompile does not load")
        out[name] = (tuple(spec["shape"]), BY_NAME[spec["dtype"]])
        end = max(end, spec["data_offsets"][1])
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: its header describes {8 + n + end} bytes "
                              f"but the file has {size}; copy or download it again")
    return out
