"""Streaming safetensors writing (and reading, for `tq.load_exported`), in plain Python.

A shard is written tensor by tensor: each tensor's bytes go to a spool file as soon as it is
made, and the header (names, dtypes, shapes, offsets) goes in front when the shard closes, so an
export holds one layer's tensors in memory at a time, whatever the model's size. The layout is
the safetensors format: an 8-byte little-endian header length, the JSON header, the raw bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import torch

__all__ = ["ShardedWriter", "parse_size", "read_safetensors_header", "load_tensor"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` / ``"500MiB"`` (what `save_pretrained` takes)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        s = size.strip().upper()
        for unit in sorted(_UNITS, key=len, reverse=True):
            if s.endswith(unit) and s[: -len(unit)].strip().replace(".", "", 1).isdigit():
                return int(float(s[: -len(unit)]) * _UNITS[unit])
    raise ValueError(f"max_shard_size={size!r} is not allowed; allowed: a positive int (bytes) or a string like '5GB', '500MiB'")


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


class ShardedWriter:
    """Writes named tensors into shards of at most `max_bytes` (a tensor larger than that gets a
    shard of its own), then names them as `save_pretrained` does: ``model.safetensors``, or
    ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``."""

    def __init__(self, directory: str, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.shards: list[tuple[str, dict]] = []  # (spool path, header)
        self.weight_map: dict[str, int] = {}
        self.total = 0
        self._spool = None

    def _open(self) -> None:
        path = os.path.join(self.directory, f".tq-export-spool-{len(self.shards)}")
        self._spool = open(path, "wb")  # noqa: SIM115 (closed in _close / finish)
        self.shards.append((path, {}))
        self._offset = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.weight_map:
            raise ValueError(f"tq.export: two tensors named {name!r}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"tq.export: tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        data = _bytes(t)
        if self._spool is None or (self._offset and self._offset + len(data) > self.max_bytes):
            self._close()
            self._open()
        self._spool.write(data)
        header = self.shards[-1][1]
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [self._offset, self._offset + len(data)]}
        self._offset += len(data)
        self.weight_map[name] = len(self.shards) - 1
        self.total += len(data)

    def _close(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None

    def finish(self) -> list[str]:
        """Write the shards (and the index for more than one); returns the file names."""
        self._close()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for (spool, header), name in zip(self.shards, names):
            head = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
            head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
            with open(os.path.join(self.directory, name), "wb") as out, open(spool, "rb") as src:
                out.write(struct.pack("<Q", len(head)))
                out.write(head)
                shutil.copyfileobj(src, out, 16 * 2**20)
            os.remove(spool)
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())}}
            with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        return names

    def abort(self) -> None:
        self._close()
        for spool, _ in self.shards:
            if os.path.exists(spool):
                os.remove(spool)


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """(header, data start) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def load_tensor(path: str, entry: dict, start: int) -> torch.Tensor:
    """One tensor of a safetensors file (read on its own: memory holds only that tensor)."""
    begin, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + begin)
        raw = bytearray(f.read(end - begin))
    dtype = _FROM_NAME[entry["dtype"]]
    t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(entry["shape"]).clone()
