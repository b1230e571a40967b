"""Streaming safetensors writing (and reading, for `tq.load_exported`), in plain Python.

A shard is written tensor by tensor: each tensor's bytes go to its file as soon as it is made,
and the header (names, dtypes, shapes, offsets) goes in front when the shard closes, so an export
holds one layer's tensors in memory at a time, whatever the model's size. The layout is
the safetensors format: an 8-byte little-endian header length, the JSON header, the raw bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

__all__ = ["ShardedWriter", "parse_size", "read_safetensors_header", "load_tensor", "dtype_name", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"

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


def dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype ("F8_E4M3" for float8_e4m3fn), or None if it has none."""
    return _DTYPES.get(dtype)


_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` / ``"500MiB"`` (what `save_pretrained` takes)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        s = size.strip().upper()
        for unit in sorted(_UNITS, key=len, reverse=True):
            if s.endswith(unit) and s[: -len(unit)].strip().replace(".", "", 1).isdigit():
                n = int(float(s[: -len(unit)]) * _UNITS[unit])
                if n > 0:  # "0GB" would put every tensor in a shard of its own
                    return n
    raise ValueError(f"max_shard_size={size!r} is not allowed; allowed: a positive int (bytes) or a string like '5GB', '500MiB'")


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


class ShardedWriter:
    """Writes named tensors into shards of at most `max_bytes` (a tensor larger than that gets a
    shard of its own) in `directory` (an export's private staging directory: see
    `tqcompile.export.files`), named as `save_pretrained` names them: ``model.safetensors``, or
    ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``.

    A shard's tensor bytes are written as they come, from the start of its file; when it closes,
    they move forward in place, from the end back, by the size of the header, which is then
    written in front. That costs one more read and write of the shard, and no disk beyond it
    (a copy into a second file would need the shard's size twice)."""

    def __init__(self, directory: str, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.shards: list[tuple[str, dict]] = []  # (data file, header)
        self.weight_map: dict[str, int] = {}
        self.total = 0
        self._file = None

    def _open(self) -> None:
        path = os.path.join(self.directory, f"shard-{len(self.shards)}.data")
        self._file = open(path, "wb")  # noqa: SIM115 (closed in _close / finish / abort)
        self.shards.append((path, {}))
        self._offset = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.weight_map:
            raise ValueError(f"tq.export: two tensors named {name!r}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"tq.export: tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        data = _bytes(t)
        if self._file is None or (self._offset and self._offset + len(data) > self.max_bytes):
            self._close()
            self._open()
        self._file.write(data)
        header = self.shards[-1][1]
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [self._offset, self._offset + len(data)]}
        self._offset += len(data)
        self.weight_map[name] = len(self.shards) - 1
        self.total += len(data)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> list[str]:
        """Give every shard its header and its name (and write the index for more than one);
        returns the shards' file names, in `directory`."""
        self._close()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for (data, header), name in zip(self.shards, names):
            head = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
            head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
            _prepend(data, struct.pack("<Q", len(head)) + head)
            os.replace(data, os.path.join(self.directory, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())}}
            with open(os.path.join(self.directory, INDEX_NAME), "w") as f:
                json.dump(index, f, indent=2)
        return names

    def abort(self) -> None:
        self._close()


def _prepend(path: str, prefix: bytes, chunk: int = 16 * 2**20) -> None:
    """Insert `prefix` at the start of the file `path`, moving its bytes forward in place (from
    the end back, so no byte is overwritten before it is read)."""
    size, shift = os.path.getsize(path), len(prefix)
    with open(path, "r+b") as f:
        pos = size
        while pos > 0:
            n = min(chunk, pos)
            pos -= n
            f.seek(pos)
            block = f.read(n)
            f.seek(pos + shift)
            f.write(block)
        f.seek(0)
        f.write(prefix)


_MAX_HEADER = 100_000_000  # the safetensors library's own limit on a header's length


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """(header, data start) of a safetensors file, checked as the safetensors library checks it
    before it reads a byte of data: a header that is JSON of known dtypes and whole shapes, and
    tensors that tile the data exactly (no overlap, no gap, nothing missing at the end: a
    truncated file). Raises `ExportError` naming the file and what is wrong."""
    from tqcompile.export.units import ExportError

    def bad(what: str) -> ExportError:
        return ExportError(f"tq.load_exported: {path!r} is not a valid safetensors file: {what}")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            raise bad(f"it has {size} bytes, fewer than the 8 that give its header's length (truncated?)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, _MAX_HEADER):
            raise bad(f"its header length {n} exceeds the file ({size} bytes) or the format's limit ({_MAX_HEADER}) (truncated or not safetensors?)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    header.pop("__metadata__", None)
    spans = []
    for name, entry in header.items():
        where = f"tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise bad(f"{where} lacks dtype, shape or data_offsets")
        if entry["dtype"] not in _FROM_NAME:
            raise bad(f"{where} has dtype {entry['dtype']!r}; allowed: {', '.join(sorted(_FROM_NAME))}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise bad(f"{where} has shape {shape!r}; a shape is a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise bad(f"{where} has data_offsets {offsets!r}; they are [begin, end] integers")
        nbytes = math.prod(shape) * _FROM_NAME[entry["dtype"]].itemsize
        if offsets[0] < 0 or offsets[1] - offsets[0] != nbytes:
            raise bad(f"{where} ({entry['dtype']} {shape}) needs {nbytes} bytes; its data_offsets {offsets} give {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap of {begin - end} bytes before it"
            raise bad(f"tensor {name!r} at bytes {begin}..{stop} {what}")
        end = stop
    if 8 + n + end != size:
        raise bad(f"its tensors end at byte {8 + n + end} but the file has {size} bytes ({'truncated' if size < 8 + n + end else 'trailing bytes'})")
    return header, 8 + n


def load_tensor(path: str, entry: dict, start: int) -> torch.Tensor:
    """One tensor of a safetensors file whose header `read_safetensors_header` checked (read on
    its own: memory holds only that tensor)."""
    begin, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + begin)
        raw = bytearray(f.read(end - begin))
    if len(raw) != end - begin:  # the file shrank since its header was read
        from tqcompile.export.units import ExportError

        raise ExportError(f"tq.load_exported: {path!r} ended after {len(raw)} of the {end - begin} bytes of a tensor; it changed while loading")
    dtype = _FROM_NAME[entry["dtype"]]
    t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(entry["shape"]).clone()
