"""Where an export's files go, so that a checkpoint on disk is never torn, mixed or lost.

An export writes into a directory that may hold a previous checkpoint, the user's other files
(a tokenizer, a README, an ``extra.safetensors``) and, at the same moment, another process's
export. The rules, in the order an export meets them:

- **One writer per directory.** `Destination` takes an exclusive lock (``.tq-export.lock``,
  ``flock`` on POSIX, ``msvcrt.locking`` on Windows) before it looks at the directory; a second
  exporter gets an `ExportError` naming the directory and the process that holds it. The
  operating system drops the lock when its process dies, so a killed export never leaves a lock
  that blocks the next one.
- **Write beside, then rename.** Every file of the new checkpoint (shards, index, configs) is
  written and flushed to disk in a private staging directory inside the destination
  (``.tq-export-<random>/``, on the same file system), then moved into place with `os.replace`,
  an atomic rename: a reader sees each file whole, old or new, never half written. Until the
  renames, the previous checkpoint is untouched, so a failure while writing (a full disk, an
  exception, a killed process) leaves it loadable; the renames of a few files take milliseconds.
- **Only the previous checkpoint goes.** With ``overwrite=True`` the files removed are those the
  previous checkpoint consists of — ``model.safetensors``, the index and the shards it names, a
  format's own config file (ModelOpt's ``hf_quant_config.json``) — and only once the new ones are in
  place; other files stay.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time

from tqcompile.export.safetensors_io import INDEX_NAME
from tqcompile.export.units import ExportError

__all__ = ["Destination", "check_destination", "LOCK_NAME", "STAGE_PREFIX", "INDEX_NAME", "SINGLE_NAME", "fsync_file"]

LOCK_NAME = ".tq-export.lock"
STAGE_PREFIX = ".tq-export-"  # staging directories (and, before they existed, spool files) of an export
SINGLE_NAME = "model.safetensors"


def fsync_file(path: str) -> None:
    """Flush a written file to disk, so the rename that publishes it publishes its bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    """Flush a directory's entries (its renames) to disk; Windows has no directory handles to flush."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Lock:
    """An exclusive, non-blocking lock on ``<directory>/.tq-export.lock`` held until `release`."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_NAME)
        for _ in range(8):  # the lock file can be replaced between open and lock (see below)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _try_lock(fd):
                holder = _read_holder(fd)
                os.close(fd)
                raise ExportError(
                    f"tq.export: another export is writing to {directory!r} ({holder}; lock file {self.path!r}); "
                    "wait for it to finish, or export to another directory"
                )
            # A releasing exporter removes the file: a lock taken on the removed file locks nothing.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
                return
            os.close(fd)
        raise ExportError(f"tq.export: could not lock {self.path!r}: other exports keep replacing it")

    def release(self) -> None:
        try:
            os.remove(self.path)  # removed while held: the next exporter creates a new one
        except OSError:
            pass
        os.close(self.fd)  # closing drops the lock


def _try_lock(fd: int) -> bool:
    if os.name == "nt":
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}") if hasattr(os, "pread") else {}
    except (OSError, ValueError):
        info = {}
    if "pid" not in info:
        return "a process that has not yet written its name"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"process {info['pid']} on {info.get('host', '?')}, since {since}"


def previous_checkpoint(directory: str, format_files: tuple[str, ...] = ()) -> set[str]:
    """The files of the checkpoint in `directory`: the single file, the index and the shards it
    names, and the `format_files` (the checkpoint formats' own config files, such as ModelOpt's
    hf_quant_config.json). (config.json and generation_config.json are replaced by name.)"""
    names = {n for n in (SINGLE_NAME, INDEX_NAME, *format_files) if os.path.isfile(os.path.join(directory, n))}
    if INDEX_NAME in names:
        try:
            with open(os.path.join(directory, INDEX_NAME)) as f:
                weight_map = json.load(f).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            weight_map = {}  # an unreadable index: its shards are unknown, so none is removed
        names.update(v for v in weight_map.values() if isinstance(v, str) and os.sep not in v and v not in ("", ".", ".."))
    return {n for n in names if os.path.isfile(os.path.join(directory, n))}


def _refuse_a_file(path: str) -> None:
    if os.path.isfile(path):
        raise ExportError(f"tq.export: path {path!r} is a file; pass a directory (it is created if missing)")


def _refuse_occupied(path: str, entries: list[str], overwrite: bool) -> None:
    if entries and not overwrite:
        raise ExportError(
            f"tq.export: directory {path!r} exists and is not empty ({len(entries)} entries); "
            "pass an empty or new directory, or overwrite=True to replace its checkpoint files"
        )


def check_destination(path: str, overwrite: bool) -> None:
    """Raise the `ExportError` that `Destination(path, overwrite)` would raise for what `path`
    holds now (a file; a non-empty directory without `overwrite`), creating and locking nothing:
    for a caller with hours of work to do before it writes."""
    _refuse_a_file(path)
    if os.path.isdir(path):
        _refuse_occupied(path, [n for n in os.listdir(path) if n != LOCK_NAME and not n.startswith(STAGE_PREFIX)], overwrite)


class Destination:
    """The directory an export writes to, locked for this process from construction to `close`.

    `stage` is the private directory the new checkpoint's files are written in; `commit(names)`
    moves them into place and removes what is left of the previous checkpoint (`format_files`:
    the config files of its own that a checkpoint format writes, see `previous_checkpoint`)."""

    def __init__(self, path: str, overwrite: bool, format_files: tuple[str, ...] = ()):
        _refuse_a_file(path)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ExportError(f"tq.export: cannot create the directory {path!r}: {e}") from e
        self.path, self.stage = path, None
        try:
            self._lock = _Lock(path)
        except OSError as e:
            raise ExportError(f"tq.export: cannot write to the directory {path!r}: {e}") from e
        try:
            self._remove_dead_stages()  # under the lock: no export is writing them
            _refuse_occupied(path, [n for n in os.listdir(path) if n != LOCK_NAME], overwrite)
            self.previous = previous_checkpoint(path, format_files)
            self.stage = tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=path)
        except BaseException:
            self.close()
            raise

    def _remove_dead_stages(self) -> None:
        for name in os.listdir(self.path):
            if name.startswith(STAGE_PREFIX) and name != LOCK_NAME:
                full = os.path.join(self.path, name)
                shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)

    def commit(self, names: list[str]) -> None:
        """Move the staged files `names` into place (data first, config.json last: the index and
        config that name the new data appear after it), then remove the previous checkpoint's
        files that the new one did not replace."""
        for name in names:
            fsync_file(os.path.join(self.stage, name))
        order = sorted(names, key=lambda n: (n.endswith(".json"), n == "config.json", n))
        for name in order:
            os.replace(os.path.join(self.stage, name), os.path.join(self.path, name))
        for name in sorted(self.previous - set(names)):
            os.remove(os.path.join(self.path, name))
        _fsync_dir(self.path)

    def close(self) -> None:
        """Remove the staging directory (what a failed export wrote) and release the lock."""
        if self.stage is not None:
            shutil.rmtree(self.stage, ignore_errors=True)
            self.stage = None
        if getattr(self, "_lock", None) is not None:
            self._lock.release()
            self._lock = None


class CheckpointFiles:
    """The tensors of the checkpoint in a directory, by name, from their checked headers (each
    tensor is read only when asked for: memory holds one layer's tensors at a time).

    Which files are the checkpoint is decided as the engines and transformers decide it: the
    shards ``model.safetensors.index.json`` names when it exists, else ``model.safetensors``, else
    the directory's one ``.safetensors`` file. A tensor must be in the file the index maps it to,
    and in no other; a file outside the checkpoint that holds one of its tensors (a stale
    ``model.safetensors`` left beside a sharded checkpoint) is refused, not merged."""

    def __init__(self, path: str):
        from tqcompile.export.safetensors_io import read_safetensors_header

        if not os.path.exists(path):
            raise ExportError(f"tq.load_exported: {path!r} does not exist; pass the directory tq.export or save_pretrained wrote")
        if not os.path.isdir(path):
            raise ExportError(f"tq.load_exported: {path!r} is not a directory; pass the directory tq.export or save_pretrained wrote")
        self.path = path
        present = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and not f.startswith("."))
        weight_map = self._index()
        if weight_map is not None:
            files = sorted(set(weight_map.values()))
            lost = [f for f in files if not os.path.isfile(os.path.join(path, f))]
            if lost:
                raise ExportError(
                    f"tq.load_exported: {path!r} is incomplete: its {INDEX_NAME} names {len(files)} shards and "
                    f"{', '.join(map(repr, lost))} {'is' if len(lost) == 1 else 'are'} missing; copy the whole checkpoint"
                )
        elif SINGLE_NAME in present or len(present) == 1:
            files = [SINGLE_NAME if SINGLE_NAME in present else present[0]]
        elif present:
            raise ExportError(
                f"tq.load_exported: {path!r} holds {len(present)} .safetensors files ({', '.join(present[:4])}"
                f"{', ...' if len(present) > 4 else ''}) but no {INDEX_NAME} or {SINGLE_NAME} saying which are the checkpoint"
            )
        else:
            raise ExportError(f"tq.load_exported: {path!r} holds no .safetensors file")
        self.entries: dict[str, tuple[str, dict, int]] = {}
        for f in files:
            full = os.path.join(path, f)
            header, start = read_safetensors_header(full)
            for name, e in header.items():
                if weight_map is not None and weight_map.get(name) != f:
                    where = f"maps it to {weight_map[name]!r}" if name in weight_map else "does not name it"
                    raise ExportError(
                        f"tq.load_exported: {full!r} holds tensor {name!r} but {INDEX_NAME} {where}: the files are of different checkpoints"
                    )
                self.entries[name] = (full, e, start)
        absent = sorted(set(weight_map or ()) - set(self.entries))
        if absent:
            raise ExportError(
                f"tq.load_exported: {INDEX_NAME} in {path!r} names {len(absent)} tensor(s) its shards do not hold "
                f"({', '.join(absent[:4])}{', ...' if len(absent) > 4 else ''}): the shards are of another checkpoint"
            )
        self.strays: dict[str, set[str]] = {}
        for f in sorted(set(present) - set(files)):
            try:
                header, _ = read_safetensors_header(os.path.join(path, f))
            except ExportError:
                continue  # not a readable checkpoint file: nothing of it could be mixed in
            self.strays[f] = set(header)
        self.refuse_strays(set(self.entries))

    def _index(self) -> dict[str, str] | None:
        full = os.path.join(self.path, INDEX_NAME)
        if not os.path.isfile(full):
            return None
        try:
            with open(full) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ExportError(f"tq.load_exported: {full!r} is not a safetensors index (JSON with a weight_map): {e!r}") from None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) and v.endswith(".safetensors") for v in weight_map.values())):
            raise ExportError(f"tq.load_exported: {full!r}'s weight_map does not map tensor names to .safetensors files")
        bad = sorted({v for v in weight_map.values() if os.path.basename(v) != v})
        if bad:
            raise ExportError(f"tq.load_exported: {full!r} names files outside its directory ({bad}); a shard is a file name")
        return weight_map

    def refuse_strays(self, names: set[str]) -> None:
        """Refuse a file outside the checkpoint that holds any of `names` (the checkpoint's
        tensors, or tensors the model needs): it is a stale or foreign copy, and loading either
        silently would be a guess."""
        for f, held in self.strays.items():
            clash = sorted(held & names)
            if clash:
                raise ExportError(
                    f"tq.load_exported: {os.path.join(self.path, f)!r} is not part of the checkpoint "
                    f"({INDEX_NAME if os.path.isfile(os.path.join(self.path, INDEX_NAME)) else SINGLE_NAME} is) but holds "
                    f"{len(clash)} of its tensors ({', '.join(clash[:3])}{', ...' if len(clash) > 3 else ''}); a file from "
                    "an earlier export? remove or move it"
                )

    def entry(self, name: str) -> dict | None:
        """A tensor's header entry (dtype, shape, data_offsets), or None."""
        found = self.entries.get(name)
        return None if found is None else found[1]

    def get(self, name: str):
        from tqcompile.export.safetensors_io import load_tensor

        if name not in self.entries:
            return None
        return load_tensor(*self.entries[name])

    def layer_prefixes(self) -> list[str]:
        """The quantized layers: every name that holds a ``weight_scale``."""
        return sorted(k[: -len(".weight_scale")] for k in self.entries if k.endswith(".weight_scale"))
