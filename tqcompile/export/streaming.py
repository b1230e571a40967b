"""Quantize a checkpoint on disk into a serving checkpoint without loading the model:
`tq.quantize_checkpoint`.

The model is built on the meta device (shapes, no values) from the checkpoint's `config.json`
and converted as `tq.calibrate` converts it; then, one weight at a time, each quantized layer's
weight is read from the checkpoint's safetensors, its static amax computed (what `max`
calibration gives: data-free), and the weight dropped; `tq.export` then reads every tensor from
the checkpoint again, one at a time, and writes the quantized one. Peak memory is the largest
tensor (and its quantized form), not the model: a model larger than the machine's memory
quantizes, as llmcompressor's `model_free_ptq` does for data-free schemes. Schemes that need
calibration data (static activation amaxes, GPTQ / AWQ / SmoothQuant) need the model's forward
and are refused here: calibrate those with `tq.calibrate`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from tqcompile.calibration.algorithms import Algorithm, parse_algorithm
from tqcompile.calibration.config import QuantConfig
from tqcompile.calibration.fused import share_fused_weight_amax
from tqcompile.calibration.modules import ExpertGemmQuantizers, holds_quantizers
from tqcompile.calibration.pipeline import check_data_free, check_searches, prepare, weight_amax
from tqcompile.export.files import check_destination
from tqcompile.export.layerwise import calibrate_layerwise, check_batches, parameters_on_meta
from tqcompile.export.names import hf_model_from_config
from tqcompile.export.readers import safetensors_reader, trim_heap
from tqcompile.export.safetensors_io import parse_size
from tqcompile.export.units import ExportError
from tqcompile.export.writer import export
from tqcompile.surgery.names import canonical_modules

__all__ = ["quantize_checkpoint"]


def _meta_model(path: str, buffers: bool = False) -> nn.Module:
    """The model of the checkpoint's config.json on the meta device (`buffers`: with its buffers
    real, to run)."""
    try:
        from transformers import AutoConfig
    except ImportError as e:  # pragma: no cover - transformers is installed wherever HF checkpoints are read
        raise ExportError("tq.quantize_checkpoint: building the model from config.json needs transformers; or pass model=") from e
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ExportError(f"tq.quantize_checkpoint: {path!r} has no config.json to build the model from; pass model= (built on the meta device)")
    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta() if buffers else torch.device("meta"):
        return hf_model_from_config(config).eval()


@contextlib.contextmanager
def _loaded(module: nn.Module, name: str, value: torch.Tensor):
    """`module`'s parameter `name` holds `value` for the duration (its meta placeholder after)."""
    meta = module._parameters[name]
    module._parameters[name] = nn.Parameter(value, requires_grad=False)
    try:
        yield
    finally:
        module._parameters[name] = meta


def quantize_checkpoint(
    path: str,
    out: str,
    config: QuantConfig,
    *,
    data: Sequence | None = None,
    algorithm: str | Algorithm | Sequence[str | Algorithm] = "max",
    percentile: float = 99.99,
    kv_scale_search: str | None = None,
    model: nn.Module | None = None,
    format: str = "compressed-tensors",
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    cache_bytes: int | str | None = None,
    cache_dir: str | None = None,
    progress: bool = True,
    amax_groups: Sequence[dist.ProcessGroup] = (),
):
    """Quantize the safetensors checkpoint in `path` (a `save_pretrained` directory) with `config`
    and write the serving checkpoint to `out`, without loading the model: data-free, one tensor
    in memory at a time; with calibration `data`, one decoder layer at a time
    (`tqcompile.export.layerwise`).

    Args:
        path: the float checkpoint (its `config.json` builds the model on the meta device).
        out: the directory to write (as `tq.export`).
        config: a `QuantConfig`. Without `data`, its quantizers must need none: weights (any
            preset's weight quantizers), and activations only where their scales come from each
            input (dynamic: `tq.configs.int8_dynamic()`, `int4_weight_only()`, MX); static
            activation amaxes are refused, naming the layers.
        data: the calibration batches, a list of token-id tensors (``model(batch)``) or of dicts
            of the model's keyword arguments (``model(**batch)``). Each runs through the
            embeddings once, then every decoder layer is calibrated on the cached inputs, read from
            the checkpoint only for its turn: the same result as `tq.calibrate` of the loaded model
            with ``lambda m: [m(b) for b in data]`` and the same `algorithm`.
        algorithm, percentile, kv_scale_search: as `tq.calibrate` ("max" is the only algorithm
            without `data`). Weight
            transforms (GPTQ, AWQ, SmoothQuant) run on the decoder layers; a layer outside them that
            one would transform (a quantized head) is refused by name.
        model: the model skeleton to use instead of building it from `config.json`: its
            parameters on the meta device, as the checkpoint's state-dict names expect (with
            `data`, its buffers real: build it under `tqcompile.export.layerwise.parameters_on_meta()`).
        cache_bytes, cache_dir: with `data`, the bound on the cached decoder-layer inputs held in
            memory (bytes, or a string such as "4GB"; None: no bound); the rest go to files in
            `cache_dir`. The weights a transform changed wait for the export in a scratch
            directory in `cache_dir` (default: beside `out`), removed at the end.
        progress: with `data`, a progress bar counting decoder layers.
        amax_groups: with `data`, data parallel: every rank of the first group calls with its own
            share of the batches (and the same `path`, `out`, config), every statistic is reduced
            over the groups as `tq.calibrate` reduces it, so each rank computes what one process
            computes on the union of the data; the group's first rank writes `out` and returns the
            report, the others return None. What one rank refuses (its data, the writer's `out`)
            is refused on every rank before the calibration, and an error writing `out` is raised
            on every rank, each with the failing rank's reason.
        format, dtype, max_shard_size, overwrite: as `tq.export`.

    Returns:
        `tq.export`'s report. The result equals ``tq.calibrate(model, config, None)`` then
        ``tq.export`` on the loaded model, byte for byte (tests/test_quantize_checkpoint.py).
    """
    if not isinstance(config, QuantConfig):
        raise TypeError(f"tq.quantize_checkpoint: config must be a tq QuantConfig, got {type(config).__name__}")
    algo = parse_algorithm(algorithm)
    if data is not None:
        return _with_data(path, out, config, data, algo, percentile, kv_scale_search, model, cache_bytes, cache_dir, progress, tuple(amax_groups),
                          dict(format=format, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite))
    if algo.transforms or algo.scale_search != "max":
        raise ValueError(f"tq.quantize_checkpoint: algorithm={algo.describe()!r} needs calibration data; pass data= (without it, 'max' only)")
    model = _meta_model(path) if model is None else model
    read = safetensors_reader(path, model)
    prepare(model, config)
    units = [(n, m) for n, m in canonical_modules(model) if holds_quantizers(m)]
    check_data_free(units, "tq.quantize_checkpoint (data-free)")
    owners = {id(p): (mod, key, f"{n}.{key}" if n else key) for n, mod in canonical_modules(model) for key, p in mod._parameters.items() if p is not None}
    for _, unit in units:
        t = unit.quantizers().get("weight")
        if t is None or not t.enabled or t.static_kind is None:
            continue
        param = unit.owner._parameters[unit.gemm.weight] if isinstance(unit, ExpertGemmQuantizers) else unit.weight
        owner, key, full = owners[id(param)]
        with _loaded(owner, key, read(full, param)):
            t.set_amax(weight_amax(unit, t, "max"))
        trim_heap()
    share_fused_weight_amax(units)  # NVFP4 q/k/v and gate/up: one global amax, as tq.calibrate gives them
    return export(model, out, format=format, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, checkpoint=path)


def _with_data(path, out, config, data, algo, percentile, kv_scale_search, model, cache_bytes, cache_dir, progress, groups, export_args):
    for g in groups:
        if not isinstance(g, dist.ProcessGroup):
            raise TypeError(f"tq.quantize_checkpoint: amax_groups must hold torch.distributed ProcessGroups, got {type(g).__name__}")
    writer = dist.get_global_rank(groups[0], 0) if groups else None
    writes = writer is None or dist.get_rank() == writer
    failure = None
    try:  # everything refused is refused before the calibration, which may take hours
        batches = check_batches(data)
        check_searches(percentile, kv_scale_search, "tq.quantize_checkpoint")
        bound = None if cache_bytes is None else parse_size(cache_bytes) if isinstance(cache_bytes, str) else cache_bytes
        model = _meta_model(path, buffers=True) if model is None else model
        meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
        if meta_buffers:
            raise ExportError(
                f"tq.quantize_checkpoint: the model's buffer {meta_buffers[0]!r} is on the meta device; running calibration data "
                "needs real buffers: build the model under tqcompile.export.layerwise.parameters_on_meta() (parameters on meta, "
                "buffers computed), or leave model= out"
            )
        if writes:
            check_destination(out, export_args["overwrite"])
    except Exception as e:
        failure = e
    _raise_on_every_rank(failure, groups, "refused the call")
    scratch = cache_dir if cache_dir is not None else os.path.dirname(os.path.abspath(out))
    overlay = calibrate_layerwise(
        model, safetensors_reader(path, model), config, batches, algo, percentile,
        scratch=scratch, cache_bytes=bound, cache_dir=cache_dir, progress=progress, amax_groups=groups,
        kv_scale_search=kv_scale_search,
    )
    report = None
    try:
        if writes:
            report = export(model, out, checkpoint=overlay.read, collective=False, **export_args)
    except BaseException as e:  # every rank learns of it before any returns
        failure = e
    finally:
        overlay.close()
    _raise_on_every_rank(failure, groups, f"failed writing {out!r}")
    return report


def _raise_on_every_rank(failure: BaseException | None, groups: tuple, what: str) -> None:
    """Raise `failure` here, and on the first group's other ranks an `ExportError` with its reason:
    one rank raising alone would leave the others waiting in the next collective (or matched to
    another one)."""
    if groups:
        reasons = [None] * dist.get_world_size(groups[0])
        dist.all_gather_object(reasons, None if failure is None else f"{type(failure).__name__}: {failure}", group=groups[0])
        failed = [(i, r) for i, r in enumerate(reasons) if r is not None]
        if failure is None and failed:
            i, reason = failed[0]
            failure = ExportError(f"tq.quantize_checkpoint: rank {dist.get_global_rank(groups[0], i)} {what}: {reason}")
    if failure is not None:
        raise failure
