"""`tq.export`: a quantized model to a checkpoint a serving engine loads."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re

import torch
import torch.distributed as dist
from torch import nn

from tqcompile.export.checkpoint_format import FORMATS, CheckpointFormat
from tqcompile.export.checks import (
    ExportWarning,
    check_experts,
    check_fused,
    check_scales,
    extra_targets,
    shared_global_amax,
)
from tqcompile.export.families import pack_int32_words
from tqcompile.export.files import Destination
from tqcompile.export.kv_cache import QUERY_QUANTIZER, QUERY_TENSOR, kv_cache_units, kv_scale
from tqcompile.export.names import Placement, is_hf_model, placements
from tqcompile.export.readers import safetensors_reader
from tqcompile.export.safetensors_io import ShardedWriter, parse_size
from tqcompile.export.units import ExportError, ExportUnit, collect_units, full_tensor, quantize_unit
from tqcompile.nn.histories import HISTORY_PREFIX
from tqcompile.surgery.checks import check_not_meta
from tqcompile.surgery.names import canonical_modules, unwrap

__all__ = ["export", "ExportReport", "ExportRow", "ExportWarning", "FORMATS"]


@dataclasses.dataclass(frozen=True)
class ExportRow:
    """One exported layer: its name in the model, the scheme written and where its scales came from."""

    layer: str
    scheme: str
    source: str
    tensors: int


@dataclasses.dataclass
class ExportReport:
    """What `tq.export` wrote: one row per quantized layer, the layers kept in high precision
    (listed in the format's ignore / exclude list), the files and their bytes."""

    path: str
    format: str
    rows: list[ExportRow]
    ignored: list[str]
    files: list[str]
    bytes_written: int

    def __str__(self) -> str:
        lines = [f"tq.export -> {self.path} ({self.format}): {len(self.rows)} quantized layers, "
                 f"{len(self.ignored)} kept in high precision, {len(self.files)} file(s), {self.bytes_written / 2**20:.1f} MiB"]
        width = max((len(r.layer) for r in self.rows), default=5)
        lines += [f"  {r.layer:<{width}}  {r.scheme}  ({r.source})" for r in self.rows]
        return "\n".join(lines)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sharded_device(model: nn.Module) -> torch.device | None:
    """The device of the model's DTensor parameters (where its collectives run), or None if it is not sharded."""
    from torch.distributed.tensor import DTensor

    return next((p.device for p in model.parameters() if isinstance(p, DTensor)), None)


def _same_path_everywhere(path: str) -> None:
    """Every rank called `tq.export` with this path. The handshake goes through the process
    group's store (`check_ranks_agree`), not a collective: a rank that calls it alone (``if rank
    == 0: tq.export(...)`` without ``collective=False``) gets an error after a minute instead of
    waiting in a collective for the process group's timeout."""
    from tqcompile.distributed.agreement import check_ranks_agree

    try:
        check_ranks_agree(
            dist.group.WORLD, "collective export", "tq.export", {"path": os.path.abspath(path)},
            advice="tq.export under torch.distributed is collective: call it on every rank with the same path (rank 0 "
            "writes), or pass collective=False where one process writes alone",
        )
    except ExportError:
        raise
    except ValueError as e:
        raise ExportError(str(e)) from e


def _format_files() -> tuple[str, ...]:
    """The config files of their own that the formats write: a previous checkpoint's is replaced."""
    return tuple(f.CONFIG_FILE for f in FORMATS.values() if f.CONFIG_FILE is not None)


def _open_on_rank0(path: str, overwrite: bool) -> Destination | None:
    """Rank 0 locks and checks `path` (`Destination`); every rank gets rank 0's refusal."""
    dest, refusal = None, [None]
    if dist.get_rank() == 0:
        try:
            dest = Destination(path, overwrite, _format_files())
        except ExportError as e:
            refusal[0] = str(e)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise ExportError(refusal[0])
    return dest


def _from_rank0(outcome: ExportReport | BaseException | None) -> ExportReport:
    """Rank 0's report (or failure), on every rank: the other ranks return the report of the one
    checkpoint written, or raise rank 0's error."""
    box = [outcome if dist.get_rank() == 0 else None]
    if isinstance(outcome, BaseException):
        box[0] = ExportError(f"tq.export: rank 0 failed writing the checkpoint: {type(outcome).__name__}: {outcome}")
    dist.broadcast_object_list(box, src=0)
    if isinstance(outcome, BaseException):
        raise outcome
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _checkpoint_reader(checkpoint, model: nn.Module):
    """The reader of a DCP checkpoint directory (its ``.metadata``), or of a safetensors one; a
    reader itself (``read(name, meta value)``: `tq.quantize_checkpoint`'s transformed weights over
    the checkpoint's) as it is."""
    if callable(checkpoint):
        return checkpoint
    if os.path.isfile(os.path.join(str(checkpoint), ".metadata")):
        return _dcp_reader(checkpoint)
    return safetensors_reader(str(checkpoint), unwrap(model))


def _dcp_reader(checkpoint):
    """Read one model tensor at a time from a DCP checkpoint written by
    `tq.distributed.checkpoint.save` (any number of ranks), in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tqcompile.distributed.checkpoint import FUSED_CHUNKS_KEY, dcp_call

    reader = dcp.FileSystemReader(str(checkpoint))
    meta = reader.read_metadata().state_dict_metadata
    fused = {}
    if FUSED_CHUNKS_KEY in meta:
        holder = {FUSED_CHUNKS_KEY: ""}
        dcp_call(dcp.load, holder, checkpoint)
        fused = json.loads(holder[FUSED_CHUNKS_KEY])

    def read(key: str, value: torch.Tensor) -> torch.Tensor:
        entry = meta.get(f"model.{key}")
        if not isinstance(entry, TensorStorageMetadata):
            raise ExportError(f"tq.export: the DCP checkpoint {str(checkpoint)!r} holds no model tensor {key!r}; was it saved from this model?")
        if f"model/{key}" in fused:
            raise ExportError(f"tq.export: {key!r} is saved as fused tensor-parallel chunks; load the checkpoint into the model and export that")
        holder = {"model": {key: torch.empty(entry.size, dtype=entry.properties.dtype)}}
        dcp_call(dcp.load, holder, checkpoint)
        return holder["model"][key]

    return read


def _split(t: torch.Tensor, kind, p: Placement, experts: bool, unit_name: str) -> torch.Tensor:
    if kind == "shape":
        return t  # rebuilt for each placement by the caller
    if experts and p.expert is not None:
        t = t[p.expert]
    if isinstance(kind, tuple) and kind[0] == "packed_rows":
        rows = t if p.rows is None else t[p.rows]
        return pack_int32_words(rows.transpose(-1, -2), kind[1]).transpose(-1, -2).contiguous()
    if p.rows is None or kind == "tensor":
        return t
    if kind == "rows":
        return t[p.rows]
    b = kind[1]  # ("blocks", b): one entry per b rows
    first, n = int(p.rows[0]), p.rows.numel()
    if first % b or n % b or not bool((p.rows == torch.arange(first, first + n)).all()):
        raise ExportError(
            f"tq.export: layer {unit_name!r} is written as separate weights of {n} rows from row {first}, which do not "
            f"align with its {b}x{b} scale blocks; use a quantizer with row or 1-D block scales for it"
        )
    return t[first // b : (first + n) // b]


def _prefix(key: str) -> str:
    return key[: -len(".weight")] if key.endswith(".weight") else key


def export(
    model: nn.Module,
    path: str,
    *,
    format: str = "compressed-tensors",
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    checkpoint: str | os.PathLike | None = None,
    collective: bool | None = None,
) -> ExportReport:
    """Write `model`'s quantized weights, scales and the rest of its state as a checkpoint that
    serving engines load: safetensors (sharded above `max_shard_size`, with the index file) and,
    for a Hugging Face model, `config.json` with its ``quantization_config`` (and, for
    ``format="modelopt"``, ``hf_quant_config.json``) and `generation_config.json`, as
    `save_pretrained` writes them; for any other module, the tensors and a `config.json` holding
    the ``quantization_config``.

    Args:
        model: calibrated (`tq.calibrate`), QAT, or converted for training (`tq.convert`: the
            recipe's weight format, activations dynamic). Layers kept in high precision are
            listed in the format's ``ignore`` / ``exclude_modules`` and carry no scales.
        path: a new or empty directory (`overwrite=True` replaces a checkpoint there).
        format: "compressed-tensors" (vLLM, SGLang, transformers), "modelopt" (vLLM, TensorRT-LLM) or
            "mxfp4" (GPT-OSS's own format: its MoE experts in MXFP4, nothing else quantized; vLLM, transformers).
        dtype: the dtype of the tensors kept in high precision (norms, embeddings, biases, the
            head); None keeps the model's. Scales keep the dtypes the format defines.
        max_shard_size: bytes, or a string such as "5GB".
        overwrite: replace the files of an existing checkpoint in `path`.
        checkpoint: a DCP checkpoint directory (`tq.distributed.checkpoint.save`, from any number of
            ranks), or a safetensors one (`save_pretrained`; `tq.quantize_checkpoint` uses it), to
            read the tensors from, one at a time, instead of from `model`, which then only gives
            the structure: build it on the meta device and convert it as it was trained
            (``with torch.device("meta"): model = ...; tq.convert(model, recipe)``). One process,
            no process group, memory for one layer.
        collective: under an initialized process group of more than one rank, None (the
            default) or True: the export is collective, as `torch.distributed.checkpoint.save`
            is; call it on every rank with the same path, rank 0 writes the one checkpoint and
            every rank returns its report (or raises its error). A sharded (FSDP2 / DTensor)
            model gathers one tensor at a time on every rank; a replicated one (DDP) is written
            from rank 0's copy while the others wait. False: this process writes alone, without
            any collective (``if rank == 0: tq.export(model, path, collective=False)``); a
            sharded model cannot.

    The checkpoint is written beside whatever `path` holds and moved into place when complete
    (atomic renames), under a lock: a second export to the same directory at the same time gets
    an `ExportError`, a failed export leaves the previous checkpoint as it was, and
    `overwrite=True` removes only the previous checkpoint's files (see docs/serving.md). Memory
    holds one layer's tensors at a time.

    Returns:
        An `ExportReport` (printable): one row per quantized layer with the scheme written.
    """
    if checkpoint is None:  # with a checkpoint, a meta model is the intended skeleton
        check_not_meta(
            model,
            "tq.export",
            "export the model with its weights loaded, or pass checkpoint=<a tq.distributed.checkpoint.save directory> "
            "to read the tensors from there (the model then only gives the structure)",
        )
    if format not in FORMATS:
        raise ValueError(f"tq.export: format={format!r} is not allowed; allowed: {', '.join(map(repr, FORMATS))}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"tq.export: dtype={dtype!r} is not allowed; allowed: None or a floating torch.dtype (torch.bfloat16)")
    fmt = FORMATS[format]
    limit = parse_size(max_shard_size)
    _check_not_compressed(model)
    units = collect_units(model)
    kv = kv_cache_units(model)
    if not units and kv[0] is None:  # a model quantizing only its KV cache exports its scales alone
        raise ExportError(
            "tq.export: nothing in the model is quantized; calibrate it first (tq.calibrate(model, tq.configs.int8(), "
            "forward_loop)) or convert it for training (tq.convert(model, recipe))"
        )
    if not units:
        fmt.check_kv_cache_only()
    fmt.check_experts_layout(model, units)
    schemes = {u.name: fmt.scheme_of(u) for u in units}  # refuses what the format cannot express, before writing
    if kv[0] is not None:
        fmt.kv_cache_config({"quantization": {}}, {}, kv[0])  # refuses a KV scheme the format cannot hold, before writing
    fmt.check_targets(extra_targets(model, units))
    check_fused(model, schemes)
    if collective not in (None, True, False):
        raise ValueError(f"tq.export: collective={collective!r} is not allowed; allowed: None (collective under torch.distributed), True, False")
    sharded = checkpoint is None and _sharded_device(model) is not None
    if sharded or (checkpoint is None and collective is not False and _world_size() > 1):
        if sharded and collective is False:
            raise ExportError("tq.export: the model's parameters are DTensors (sharded): its export is collective, every rank gathers; collective=False is not allowed")
        if not (dist.is_available() and dist.is_initialized()):
            raise ExportError("tq.export: the model's parameters are DTensors (sharded) but no process group is initialized")
        _same_path_everywhere(path)
        if not sharded:  # a replicated model: rank 0 writes from its copy, the others wait for its report
            outcome = None
            if dist.get_rank() == 0:
                try:
                    outcome = _write(model, units, schemes, fmt, path, format, dtype, limit, overwrite, None)
                except BaseException as e:  # every rank learns of it, then rank 0 raises it
                    outcome = e
            return _from_rank0(outcome)
        dest = _open_on_rank0(path, overwrite)
        try:
            outcome = _write_collectively(model, units, schemes, fmt, path, format, dtype, limit, dest)
        except BaseException as e:
            outcome = e
        return _from_rank0(outcome)
    if collective is True and not (dist.is_available() and dist.is_initialized()):
        raise ExportError("tq.export: collective=True needs an initialized process group (torch.distributed.init_process_group)")
    return _write(model, units, schemes, fmt, path, format, dtype, limit, overwrite, checkpoint)


def _check_not_compressed(model: nn.Module) -> None:
    from tqcompile.deploy.modules import deployed_layers

    packed = deployed_layers(model)
    if packed:
        first = packed[0]
        raise ExportError(
            f"tq.export: the model is compressed (tq.compress; layer {first.name!r} runs its {first.kernel} kernel, "
            f"{first.reason}); export the calibrated model before tq.compress, or load the checkpoint again "
            "(tq.load_exported) and compress that"
        )


def _write(model, units, schemes, fmt, path, format, dtype, limit, overwrite, checkpoint) -> ExportReport:
    """The export in this one process: lock and check `path`, write the checkpoint beside the
    previous one, move it into place (`Destination`)."""
    dest = Destination(path, overwrite, _format_files())
    try:
        return _write_collectively(model, units, schemes, fmt, path, format, dtype, limit, dest, checkpoint)
    finally:
        dest.close()


def _write_collectively(model, units, schemes, fmt, path, format, dtype, limit, dest, checkpoint=None) -> ExportReport | None:
    """One pass over the model's tensors. For a sharded model every rank takes part (each tensor
    is gathered in turn) and only the rank holding `dest` writes; otherwise one process does it all.
    Returns the report on the writing rank, None on the others."""
    writer = None
    try:
        read = (lambda key, value: full_tensor(value)) if checkpoint is None else _checkpoint_reader(checkpoint, model)
        state = _drop_tied(model, _canonical_state(model), units)
        lost = [u.weight_key for u in units if u.weight_key not in state]
        if lost:  # never write a quantized layer as float
            raise ExportError(f"tq.export: cannot find the weights {lost} among the model's parameters")
        model = unwrap(model)
        where = placements(model, {k: v.shape for k, v in state.items()})
        check_experts(model, schemes)
        shared = shared_global_amax(units, schemes, state, read)
        by_key = {u.weight_key: u for u in units}
        writer = ShardedWriter(dest.stage, limit) if dest is not None else None
        run = _Pass(fmt, read, dtype, where, shared, schemes, writer, None if checkpoint is not None else _sharded_device(model))
        for key, value in state.items():
            unit = by_key.get(key)
            if unit is None:
                run.float_tensor(key, value)
            else:
                run.quantized_weight(key, value, unit)
            run.agree()
        kv_q, kv_units = kv_cache_units(model)
        for u in kv_units:  # after the model's own tensors, as llmcompressor's checkpoints hold them
            for local, t in fmt.kv_cache_tensors(kv_q, kv_scale(u.key_amax, kv_q), kv_scale(u.value_amax, kv_q)).items():
                run.emit(f"{u.name}.{local}", t)
            if u.query_amax is not None:  # one per layer, shaped as the format's per-layer k_scale
                q_scale = kv_scale(u.query_amax, QUERY_QUANTIZER)
                run.emit(f"{u.name}.{QUERY_TENSOR}", fmt.kv_cache_tensors(QUERY_QUANTIZER, q_scale, q_scale)["k_scale"])
        ignored = _ignored(model, where, run.quantized, fmt.IGNORE_EXPERTS)
        targets = extra_targets(model, units)

        def finish() -> list[str]:
            shards = writer.finish()
            _write_configs(model, dest.stage, fmt, run.groups, ignored, targets, dtype, kv_q)
            dest.commit(sorted(os.listdir(dest.stage)))
            return shards

        files = run.final(finish)  # every rank learns whether the writing rank wrote the files
    finally:
        if writer is not None:
            writer.abort()
        if dest is not None:
            dest.close()
    if writer is None:
        return None
    return ExportReport(path, format, run.rows, ignored, files, writer.total)


@dataclasses.dataclass
class _Pass:
    """One pass over the model's tensors: each is read (gathered, for a sharded model), quantized
    where it is a unit's weight, split into the checkpoint's tensors, and written by the writing
    rank. `agree` after each tensor makes a failure on the writing rank (a full disk) stop every
    rank at the same tensor, instead of leaving the others waiting in the next gather."""

    fmt: CheckpointFormat
    read: object
    dtype: torch.dtype | None
    where: dict
    shared: dict
    schemes: dict
    writer: ShardedWriter | None
    collective_device: torch.device | None  # a sharded model's: every rank takes part in each step
    rows: list = dataclasses.field(default_factory=list)
    groups: dict = dataclasses.field(default_factory=dict)
    quantized: set = dataclasses.field(default_factory=set)
    error: BaseException | None = None

    def emit(self, name: str, t: torch.Tensor) -> None:
        if self.writer is not None and self.error is None:
            try:
                self.writer.add(name, t.clone())
            except Exception as e:  # raised by `agree`, on every rank
                self.error = e

    def float_tensor(self, key: str, value: torch.Tensor) -> None:
        t = self.read(key, value)
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        for p in self.where[key]:
            self.emit(p.name, _split(t, "rows", p, t.dim() == 3, key))

    def quantized_weight(self, key: str, value: torch.Tensor, unit: ExportUnit) -> None:
        w = self.read(key, value)
        if unit.transposed:  # experts stored (E, in, out): quantized in the GEMM view, (E, out, in)
            w = w.transpose(-1, -2)
        scheme = self.schemes[unit.name]
        tensors = self.fmt.layer_tensors(unit, scheme, quantize_unit(unit, w, self.shared.get(unit.name)), w.shape[-2], w.shape[-1])
        check_scales(unit, tensors)  # the same tensors on every rank: every rank raises
        for p in self.where[key]:
            prefix = _prefix(p.name)
            self.quantized.add(prefix)
            self.groups.setdefault(scheme, []).append(prefix)
            for local, (t, kind) in tensors.items():
                if kind == "shape" and p.rows is not None:
                    t = torch.tensor([p.rows.numel(), w.shape[-1]], dtype=torch.int64)
                self.emit(self.fmt.tensor_name(prefix, local), _split(t, kind, p, unit.experts, unit.name))
        self.rows.append(ExportRow(unit.name, scheme.describe(), unit.source, len(self.where[key])))

    def final(self, fn):
        """Run `fn` on the writing rank (its failure captured), then `agree`: every rank returns or raises."""
        result = None
        if self.writer is not None and self.error is None:
            try:
                result = fn()
            except Exception as e:
                self.error = e
        self.agree()
        return result

    def agree(self) -> None:
        failed = self.error is not None
        if self.collective_device is not None:
            flag = torch.tensor([int(failed)], device=self.collective_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if not failed and bool(flag):
                raise ExportError("tq.export: the writing rank (rank 0) failed writing the checkpoint; see its error")
        if failed:
            raise self.error


def _canonical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers under canonical names (wrappers' ``_orig_mod`` /
    ``module`` components removed, as the units are named), in `state_dict` order; tq's own
    delayed-scaling histories are training state, not served."""
    state = {}
    for name, mod in canonical_modules(model):
        pre = f"{name}." if name else ""
        for k, p in mod._parameters.items():
            if p is not None:
                state[pre + k] = p
        for k, b in mod._buffers.items():
            if b is not None and k not in mod._non_persistent_buffers_set and not k.startswith(HISTORY_PREFIX):
                state[pre + k] = b
    return state


def _drop_tied(model: nn.Module, state: dict, units: list[ExportUnit]) -> dict:
    """Drop parameters tied to an earlier one (an LM head sharing the embedding): the loader
    re-ties them, as after `save_pretrained`. A quantized layer tied to another cannot export."""
    seen: dict[int, str] = {}
    out = {}
    unit_keys = {u.weight_key for u in units}
    for k, v in state.items():
        ident = id(v)
        if ident in seen:
            if k in unit_keys or seen[ident] in unit_keys:
                raise ExportError(
                    f"tq.export: {k!r} is tied to {seen[ident]!r} and one of them is quantized; a checkpoint cannot hold "
                    "one tensor both quantized and not: keep both in high precision (the presets keep lm_head so)"
                )
            continue
        seen[ident] = k
        out[k] = v
    return out


def _ignored(model: nn.Module, where: dict, quantized: set[str], experts_as: str) -> list[str]:
    """Checkpoint names of the layers kept in high precision that an engine builds as linear
    layers: every Linear, any other module holding a 2-D weight (MoE routers such as transformers'
    `MixtralTopKRouter`), and experts modules (`experts_as` "per_expert": each expert's names, as
    compressed-tensors lists them; "module": the experts module, as ModelOpt does)."""
    from tqcompile.nn.experts import experts_layout

    names = set()
    for name, module in canonical_modules(model):
        weight = module._parameters.get("weight")
        if isinstance(module, nn.Linear) or (weight is not None and weight.dim() == 2 and not isinstance(module, nn.Embedding)):
            names.update(_prefix(p.name) for p in where.get(f"{name}.weight", ()))
        layout = experts_layout(module)
        for g in () if layout is None else layout.gemms:
            for p in where.get(f"{name}.{g.weight}", ()):
                if _prefix(p.name) in quantized:
                    continue
                if experts_as == "per_expert":
                    names.add(_prefix(p.name))
                elif p.expert is None:  # one tensor of every expert (GPT-OSS): "...mlp.experts.gate_up_proj" -> "...mlp.experts"
                    names.add(p.name.removesuffix(f".{g.weight}"))
                else:  # "model.layers.1.mlp.experts.1.gate_proj.weight" -> "model.layers.1.mlp.experts"
                    names.add(re.sub(rf"\.{p.expert}\.[^.]+\.weight$", "", p.name))
    return sorted(n for n in names if n not in quantized)


def _model_class(model: nn.Module) -> type:
    """The model's own class, under the subclass FSDP2's `fully_shard` swaps in (``FSDPLlamaForCausalLM``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return type(model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _write_configs(
    model: nn.Module, path: str, fmt: CheckpointFormat, groups: dict, ignored: list[str], targets: list[str], dtype, kv_q=None
) -> None:
    qconfig = fmt.quantization_config(groups, ignored, targets)
    files = fmt.extra_files(groups, ignored)
    if kv_q is not None:
        fmt.kv_cache_config(qconfig, files, kv_q)
    for name, content in files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(content, f, indent=2)
    if is_hf_model(model):
        hf = unwrap(model)
        config = copy.deepcopy(model.config)
        config.quantization_config = qconfig
        # save_pretrained fills these in; a model built with from_config has neither until then,
        # and vLLM picks the model class by `architectures` (its dtype="auto" by `dtype`).
        if not getattr(config, "architectures", None):
            config.architectures = [_model_class(hf).__name__]
        if dtype is not None:
            config.dtype = dtype
        elif getattr(config, "dtype", None) is None:
            config.dtype = hf.dtype
        config.save_pretrained(path)
        gen = getattr(model, "generation_config", None)
        if gen is not None and getattr(model, "can_generate", lambda: False)():
            gen.save_pretrained(path)
    else:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"quantization_config": qconfig}, f, indent=2)
