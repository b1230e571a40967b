"""Checkpoints on disk that cannot be lost, torn or mixed up (issue 25, items 1-4 and 10): one
writer per directory, the new checkpoint written beside the old and renamed into place, only the
old checkpoint's files removed, the loader reading exactly the files the index names, and every
file, header and tensor checked before the first byte goes into the user's model."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import struct
import subprocess

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.export import ExportError, safetensors_io
from tqcompile.export import files as export_files

transformers = pytest.importorskip("transformers")
from test_export import _calibrated, tiny_llama  # noqa: E402

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _snapshot(path: str) -> dict[str, bytes]:
    """Every file in `path` (hidden ones included) with its bytes."""
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, f))}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -------------------------------------------------------------------------------------------
# 1. One writer per directory
# -------------------------------------------------------------------------------------------
def test_a_second_export_to_a_directory_being_written_is_refused(tmp_path):
    model = _calibrated("int8_static")
    path = str(tmp_path / "ckpt")
    held = export_files.Destination(path, overwrite=False)  # another export, mid-write
    try:
        with pytest.raises(ExportError, match=rf"another export is writing to '{path}' \(process {os.getpid()} on .*lock file"):
            tq.export(model, path)
        with pytest.raises(ExportError, match="another export is writing"):
            tq.export(model, path, overwrite=True)
    finally:
        held.close()
    assert os.listdir(path) == []  # the holder left nothing; its lock went with it
    report = tq.export(model, path)
    assert sorted(os.listdir(path)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert report.bytes_written > 0


def test_a_killed_export_leaves_no_lock_and_its_leftovers_go(tmp_path):
    """A process killed mid-export: the OS drops its lock; its staging directory is removed by the next export."""
    path = tmp_path / "ckpt"
    code = (
        "import os, sys; from tqcompile.export.files import Destination; "
        f"d = Destination({str(path)!r}, False); open(os.path.join(d.stage, 'model.safetensors'), 'wb').write(b'x' * 100); os._exit(0)"
    )
    subprocess.run([os.sys.executable, "-c", code], check=True, timeout=120)
    assert any(n.startswith(export_files.STAGE_PREFIX) for n in os.listdir(path))  # what the killed export left
    tq.export(_calibrated("int8_static"), str(path))  # not "another export", not "not empty"
    assert not any(n.startswith(".tq-") for n in os.listdir(path))


def _race(path: str, overwrite: bool, barrier, results, trials: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    tq.calibrate(model, tq.configs.int8(), lambda m: m(x), progress=False)
    for trial in range(trials):
        barrier.wait(timeout=120)
        try:
            report = tq.export(model, f"{path}/{trial}", overwrite=overwrite)
            results.put((trial, "ok", report.bytes_written))
        except ExportError as e:
            results.put((trial, "refused", str(e)))
        except Exception as e:  # noqa: BLE001 - anything else is the failure this test looks for
            results.put((trial, type(e).__name__, str(e)))
        barrier.wait(timeout=120)


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_processes_exporting_to_one_directory_never_tear_it(tmp_path, overwrite):
    """Was: both used the same spool name and opened the final file before their spool: one
    returned a report while model.safetensors was 0 bytes. Now one writes, the other is refused
    (or, with overwrite, replaces it after), and the checkpoint on disk is always whole."""
    ctx = multiprocessing.get_context("spawn")
    trials = 3
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), overwrite, barrier, results, trials)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=300) for _ in range(2 * trials)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    torch.manual_seed(0)
    reference = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    for trial in range(trials):
        outcomes = [o for t, *o in got if t == trial]
        kinds = sorted(o[0] for o in outcomes)
        assert kinds in (["ok", "refused"], ["ok", "ok"] if overwrite else ["ok", "refused"]), outcomes
        for o in outcomes:
            if o[0] == "refused":
                assert "another export is writing" in o[1] or "not empty" in o[1], o[1]
        ckpt = f"{tmp_path}/{trial}"
        size = os.path.getsize(f"{ckpt}/model.safetensors")
        written = next(o[1] for o in outcomes if o[0] == "ok")
        assert size > written  # the data plus its header: never a 0-byte or torn file
        loaded = tq.load_exported(ckpt, model=nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]))
        assert set(loaded.state_dict()) >= set(reference.state_dict())
        assert not any(n.startswith(".tq-") for n in os.listdir(ckpt))


# -------------------------------------------------------------------------------------------
# 2. overwrite=True: the previous checkpoint stays until the new one is complete
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["writing", "prepending", "renaming"])
def test_a_failed_overwrite_leaves_the_previous_checkpoint_as_it_was(tmp_path, monkeypatch, where):
    old = _calibrated("int8_static")
    path = str(tmp_path / "ckpt")
    tq.export(old, path, max_shard_size="40KB")
    before = _snapshot(path)
    full = OSError(errno.ENOSPC, "No space left on device")
    if where == "writing":  # the disk fills while a shard's tensors are written
        calls = {"n": 0}
        add = safetensors_io.ShardedWriter.add

        def failing_add(self, name, t):
            calls["n"] += 1
            if calls["n"] == 9:
                raise full
            return add(self, name, t)

        monkeypatch.setattr(safetensors_io.ShardedWriter, "add", failing_add)
    elif where == "prepending":  # ... or while a header goes in front
        monkeypatch.setattr(safetensors_io, "_prepend", lambda *a, **k: (_ for _ in ()).throw(full))
    else:  # the new data complete, the first rename fails
        real = os.replace
        monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(full) if os.path.dirname(b) == path else real(a, b))
    new = _calibrated("int8_static", tiny_llama(seed=3))
    with pytest.raises(OSError, match="No space left"):
        tq.export(new, path, overwrite=True, max_shard_size="40KB")
    assert _snapshot(path) == before  # every old file, byte for byte; no staging directory, no lock
    monkeypatch.undo()
    assert torch.equal(_logits(tq.load_exported(path)), _logits(old))


def test_overwrite_removes_only_the_previous_checkpoints_files(tmp_path):
    old, new = _calibrated("int8_static"), _calibrated("int8_static", tiny_llama(seed=3))
    path = str(tmp_path / "ckpt")
    tq.export(old, path)  # one file
    extra = {"foo": torch.ones(3)}
    safetensors_io_write(os.path.join(path, "extra.safetensors"), extra)
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    tq.export(new, path, overwrite=True, max_shard_size="40KB")  # sharded: model.safetensors must go (transformers prefers it)
    names = sorted(os.listdir(path))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert "extra.safetensors" in names and "tokenizer.json" in names
    assert torch.equal(_logits(tq.load_exported(path)), _logits(new))
    n_shards = sum(n.startswith("model-") for n in names)
    tq.export(old, path, overwrite=True, max_shard_size="5GB")  # back to one file: the shards and index go
    names = sorted(os.listdir(path))
    assert not any(n.startswith("model-") for n in names) and "model.safetensors.index.json" not in names and n_shards > 1
    assert {"extra.safetensors", "tokenizer.json", "model.safetensors"} <= set(names)
    assert torch.equal(_logits(tq.load_exported(path)), _logits(old))


def safetensors_io_write(path: str, tensors: dict) -> None:
    """A plain safetensors file, written as a user (or another tool) would."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, ".w")
    os.makedirs(tmp)
    w = safetensors_io.ShardedWriter(tmp, 2**30)
    for k, v in tensors.items():
        w.add(k, v)
    (name,) = w.finish()
    os.replace(os.path.join(tmp, name), path)
    shutil.rmtree(tmp)


def test_an_export_needs_the_checkpoints_size_once_not_twice(tmp_path, monkeypatch):
    """Was: each shard was spooled, then copied into its final file: twice its size on disk. Now
    the header goes in front in place: the staged bytes never exceed the checkpoint's."""
    model = _calibrated("int8_static")
    path = str(tmp_path / "ckpt")
    peak = {"bytes": 0}
    real = safetensors_io._prepend

    def spy(file, prefix, chunk=16 * 2**20):
        real(file, prefix, chunk=4096)  # small chunks: the in-place move is exercised across many
        staged = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs if f != export_files.LOCK_NAME)
        peak["bytes"] = max(peak["bytes"], staged)

    monkeypatch.setattr(safetensors_io, "_prepend", spy)
    report = tq.export(model, path, max_shard_size="100KB")
    final = sum(os.path.getsize(os.path.join(path, f)) for f in report.files)
    assert 0 < peak["bytes"] <= final
    monkeypatch.undo()
    assert torch.equal(_logits(tq.load_exported(path)), _logits(model))  # the moved bytes are the right ones


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path):
    """The measured case: a tmpfs 1.5x the checkpoint, overwrite=True. Needs root to mount one."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    old = _calibrated("int8_static")
    probe = str(tmp_path / "probe")
    size = tq.export(old, probe).bytes_written
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        path = str(mnt / "ckpt")
        shutil.copytree(probe, path)
        before = _snapshot(path)
        with pytest.raises(OSError) as err:
            tq.export(_calibrated("int8_static", tiny_llama(seed=3)), path, overwrite=True)
        assert err.value.errno == errno.ENOSPC
        assert _snapshot(path) == before
        assert torch.equal(_logits(tq.load_exported(path)), _logits(old))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# -------------------------------------------------------------------------------------------
# 3. The loader reads the files the index names, and nothing else
# -------------------------------------------------------------------------------------------
def test_a_stale_single_file_beside_a_sharded_checkpoint_is_refused_not_loaded(tmp_path):
    old, new = _calibrated("int8_static"), _calibrated("int8_static", tiny_llama(seed=3))
    tq.export(old, str(tmp_path / "old"))
    path = str(tmp_path / "new")
    tq.export(new, path, max_shard_size="40KB")
    shutil.copy(tmp_path / "old" / "model.safetensors", os.path.join(path, "model.safetensors"))
    with pytest.raises(ExportError, match=r"model.safetensors' is not part of the checkpoint \(model.safetensors.index.json is\) but holds"):
        tq.load_exported(path)
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "backup.safetensors"))
    with pytest.raises(ExportError, match="backup.safetensors' is not part of the checkpoint"):
        tq.load_exported(path)
    os.remove(os.path.join(path, "backup.safetensors"))
    safetensors_io_write(os.path.join(path, "extra.safetensors"), {"unrelated": torch.ones(2)})
    assert torch.equal(_logits(tq.load_exported(path)), _logits(new))  # a file of other tensors is left alone


def test_index_and_shards_must_agree(tmp_path):
    model = _calibrated("int8_static")
    path = str(tmp_path / "ckpt")
    tq.export(model, path, max_shard_size="40KB")
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shards = sorted(set(index["weight_map"].values()))
    # A shard missing: named as such, not blamed on the architecture.
    os.rename(os.path.join(path, shards[1]), os.path.join(tmp_path, "aside"))
    with pytest.raises(ExportError, match=rf"is incomplete: its model.safetensors.index.json names {len(shards)} shards and '{shards[1]}' is missing"):
        tq.load_exported(path)
    os.rename(os.path.join(tmp_path, "aside"), os.path.join(path, shards[1]))
    # A tensor the index maps to another shard than the one holding it (two checkpoints' files mixed).
    held = {s: [k for k, v in index["weight_map"].items() if v == s] for s in shards}
    src = next(s for s in shards if len(held[s]) > 1)  # stays in the index after one of its tensors moves
    dst = next(s for s in shards if s != src)
    name = held[src][0]
    json.dump({**index, "weight_map": {**index["weight_map"], name: dst}}, open(index_path, "w"))
    with pytest.raises(ExportError, match=rf"holds tensor '{name}' but model.safetensors.index.json maps it to '{dst}'"):
        tq.load_exported(path)
    # A shard holding a tensor its index does not name at all.
    json.dump({**index, "weight_map": {k: v for k, v in index["weight_map"].items() if k != name}}, open(index_path, "w"))
    with pytest.raises(ExportError, match=rf"holds tensor '{name}' but model.safetensors.index.json does not name it"):
        tq.load_exported(path)
    # An index naming a file outside the directory, or one that is not JSON.
    json.dump({**index, "weight_map": {**index["weight_map"], name: "../x.safetensors"}}, open(index_path, "w"))
    with pytest.raises(ExportError, match="names files outside its directory"):
        tq.load_exported(path)
    open(index_path, "w").write("{not json")
    with pytest.raises(ExportError, match="is not a safetensors index"):
        tq.load_exported(path)


# -------------------------------------------------------------------------------------------
# 4. Nothing is written into the model before everything is checked
# -------------------------------------------------------------------------------------------
def _corrupt_last_scale(path: str, value: float) -> None:
    """Set the weight_scale of the checkpoint's last quantized layer (in file order) to `value`."""
    f = os.path.join(path, "model.safetensors")
    header, start = safetensors_io.read_safetensors_header(f)
    name = max((k for k in header if k.endswith(".weight_scale")), key=lambda k: header[k]["data_offsets"][0])
    begin, _ = header[name]["data_offsets"]
    with open(f, "r+b") as fh:
        fh.seek(start + begin)
        fh.write(struct.pack("<f", value))
    return name


@pytest.mark.parametrize("damage", ["truncated", "nan_scale"])
def test_a_bad_checkpoint_changes_nothing_in_the_model(tmp_path, damage):
    """Was: a truncated checkpoint overwrote 15 of the model's 21 tensors before raising."""
    tq.export(_calibrated("int8_static"), str(tmp_path / "ckpt"))
    f = tmp_path / "ckpt" / "model.safetensors"
    if damage == "truncated":
        data = f.read_bytes()
        f.write_bytes(data[: len(data) - 100])
        match = r"model.safetensors' is not a valid safetensors file: its tensors end at byte \d+ but the file has \d+ bytes \(truncated\)"
    else:
        name = _corrupt_last_scale(str(tmp_path / "ckpt"), float("nan"))
        match = rf"{name} holds 1 NaN value"
    target = tiny_llama(seed=9)
    before = _state(target)
    with pytest.raises(ExportError, match=match):
        tq.load_exported(str(tmp_path / "ckpt"), model=target)
    assert _same_state(_state(target), before)
    assert not any(hasattr(m, "weight_quantizer") for m in target.modules())


# -------------------------------------------------------------------------------------------
# 5. Values that would load silently wrong
# -------------------------------------------------------------------------------------------
def _overwrite(path: str, name: str, fill) -> None:
    """Overwrite the checkpoint tensor `name` in place with `fill(tensor)` (same dtype and shape)."""
    f = os.path.join(path, "model.safetensors")
    header, start = safetensors_io.read_safetensors_header(f)
    t = safetensors_io.load_tensor(f, header[name], start)
    new = fill(t).to(t.dtype).contiguous()
    with open(f, "r+b") as fh:
        fh.seek(start + header[name]["data_offsets"][0])
        fh.write(new.reshape(-1).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize(
    "config, tensor, value, match",
    [
        ("int8_static", "mlp.down_proj.weight_scale", float("nan"), "1 NaN value"),
        ("int8_static", "mlp.down_proj.weight_scale", float("inf"), "1 infinite value"),
        ("int8_static", "mlp.down_proj.weight_scale", 0.0, "1 zero value"),
        ("int8_static", "mlp.down_proj.weight_scale", -0.01, "1 negative value"),
        ("int8_static", "mlp.down_proj.input_scale", float("nan"), "1 NaN value"),
        ("int8_dynamic_token", "self_attn.q_proj.weight_scale", -1.0, "1 negative value"),
        ("nvfp4", "mlp.down_proj.weight_global_scale", 0.0, "1 zero value"),
        ("nvfp4", "mlp.down_proj.weight_scale", -1.0, "1 negative value"),
        ("mxfp8", "mlp.down_proj.weight_scale", 255, r"1 NaN E8M0 exponent\(s\) \(0xFF\)"),
    ],
)
def test_corrupt_scales_are_refused_naming_the_tensor(tmp_path, config, tensor, value, match):
    """Was: a NaN/inf/zero/negative scale loaded (a weight row became 3.4e38, an input amax NaN)."""
    path = str(tmp_path / "ckpt")
    tq.export(_calibrated(config), path)
    name = f"model.layers.0.{tensor}"
    _overwrite(path, name, lambda t: torch.where(torch.arange(t.numel()).reshape(t.shape) == 0, torch.tensor(value).to(t.dtype), t))
    with pytest.raises(ExportError, match=rf"{name} holds {match}.*the checkpoint is corrupt"):
        tq.load_exported(path)


def test_a_config_that_contradicts_the_payload_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    tq.export(_calibrated("int8_static"), path)
    cfg_path = os.path.join(path, "config.json")
    good = json.load(open(cfg_path))
    # INT8 codes read as INT4 (was: logits off by 0.58, no word).
    cfg = json.loads(json.dumps(good))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ExportError, match=r"weight holds codes from -\d+ to \d+, beyond num_bits=4's -8..7: the config's num_bits contradicts the payload"):
        tq.load_exported(path)
    # A static input scale under a config that says the input is dynamic (was: dropped without a word).
    cfg = json.loads(json.dumps(good))
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = True
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ExportError, match=r"input_scale is in the checkpoint but the config says its inputs are dynamic"):
        tq.load_exported(path)
    # Packed INT4 words read with num_bits=8.
    path4 = str(tmp_path / "int4")
    tq.export(_calibrated("int4_g32"), path4)
    cfg = json.load(open(os.path.join(path4, "config.json")))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    json.dump(cfg, open(os.path.join(path4, "config.json"), "w"))
    with pytest.raises(ExportError, match=r"weight_packed is \[\d+, \d+\] int32 words for a \[\d+, \d+\] weight; num_bits=8 packs it in"):
        tq.load_exported(path4)


# -------------------------------------------------------------------------------------------
# 10. Malformed files, configs and arguments: errors that say what is wrong
# -------------------------------------------------------------------------------------------
def _header_file(path, header: dict, data: bytes, length: int | None = None) -> None:
    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head) if length is None else length) + head + data)


@pytest.mark.parametrize(
    "case, match",
    [
        ("short", r"it has 5 bytes, fewer than the 8"),
        ("huge_length", r"its header length 4611686018427387904 exceeds the file"),
        ("not_json", r"its header is not JSON"),
        ("bad_dtype", r"tensor 'a' has dtype 'F7'; allowed:"),
        ("bad_shape", r"tensor 'a' has shape \[-1\]"),
        ("size_mismatch", r"tensor 'a' \(F32 \[4\]\) needs 16 bytes; its data_offsets \[0, 12\] give 12"),
        ("overlap", r"tensor 'b' at bytes 8..24 overlaps the tensor before it"),
        ("gap", r"tensor 'b' at bytes 20..36 leaves a gap of 4 bytes"),
        ("truncated", r"its tensors end at byte \d+ but the file has \d+ bytes \(truncated\)"),
        ("trailing", r"its tensors end at byte \d+ but the file has \d+ bytes \(trailing bytes\)"),
    ],
)
def test_malformed_safetensors_files_are_named(tmp_path, case, match):
    f = tmp_path / "model.safetensors"
    a16 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    if case == "short":
        f.write_bytes(b"\x01\x02\x03\x04\x05")
    elif case == "huge_length":
        _header_file(f, {}, b"", length=2**62)
    elif case == "not_json":
        _header_file(f, {}, b"")
        raw = f.read_bytes()
        f.write_bytes(raw[:8] + b"{x" + raw[10:])
    elif case == "bad_dtype":
        _header_file(f, {"a": {**a16, "dtype": "F7"}}, bytes(16))
    elif case == "bad_shape":
        _header_file(f, {"a": {**a16, "shape": [-1]}}, bytes(16))
    elif case == "size_mismatch":
        _header_file(f, {"a": {**a16, "data_offsets": [0, 12]}}, bytes(12))
    elif case == "overlap":
        _header_file(f, {"a": a16, "b": {**a16, "data_offsets": [8, 24]}}, bytes(24))
    elif case == "gap":
        _header_file(f, {"a": a16, "b": {**a16, "data_offsets": [20, 36]}}, bytes(36))
    elif case == "truncated":
        _header_file(f, {"a": a16}, bytes(10))
    else:
        _header_file(f, {"a": a16}, bytes(20))
    with pytest.raises(ExportError, match=rf"'{f}' is not a valid safetensors file: {match}"):
        safetensors_io.read_safetensors_header(str(f))


def test_bad_directories_and_configs_are_named(tmp_path):
    with pytest.raises(ExportError, match=r"'/does/not/exist' does not exist"):
        tq.load_exported("/does/not/exist")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is not a directory"):
        tq.load_exported(str(tmp_path / "file"))
    model = _calibrated("int4_g32")
    path = str(tmp_path / "ckpt")
    tq.export(model, path)
    cfg_path = os.path.join(path, "config.json")
    good = open(cfg_path).read()
    open(cfg_path, "w").write(good[:-20])
    with pytest.raises(ExportError, match=r"config.json' is not JSON"):
        tq.load_exported(path)
    cfg = json.loads(good)
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64  # the tensors have groups of 32
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ExportError, match=r"weight_scale has shape \[\d+, \d+\]; .* has \[\d+, \d+\] scales: the config's strategy or group size contradicts"):
        tq.load_exported(path)
    cfg["quantization_config"] = "int4"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ExportError, match="quantization_config is a str, not an object"):
        tq.load_exported(path)


@pytest.mark.parametrize("size", ["0GB", "0", 0, -5, "5XB", True])
def test_max_shard_size_must_be_positive(tmp_path, size):
    with pytest.raises(ValueError, match=rf"max_shard_size={size!r} is not allowed"):
        tq.export(_calibrated("int8_static"), str(tmp_path / "x"), max_shard_size=size)
    assert not (tmp_path / "x").exists()


def test_collective_argument_is_checked(tmp_path):
    model = _calibrated("int8_static")
    with pytest.raises(ValueError, match="collective='yes' is not allowed"):
        tq.export(model, str(tmp_path / "x"), collective="yes")
    with pytest.raises(ExportError, match="collective=True needs an initialized process group"):
        tq.export(model, str(tmp_path / "x"), collective=True)
