"""`tq.load_exported`: a compressed-tensors, ModelOpt or GPT-OSS MXFP4 checkpoint back into a tq
calibrated model, to evaluate it as the engines would, fine-tune it (QAT) or export it again.

The inverse of `tq.export`, step by step:

- each quantized layer of the checkpoint is read back in tq's terms (`decode`: quantizers from the
  export's own scheme mapping, amaxes whose scales are the checkpoint's, the weight dequantized by
  tq's kernel);
- checkpoint names go back to the model's tensors through the very map the export writes with
  (`names.placements`, which asks transformers' save-time conversion): a per-expert
  ``experts.3.gate_proj.weight`` is expert 3, rows [0, I) of the fused ``experts.gate_up_proj``;
  its scales fill the same rows of the experts GEMM's per-expert amaxes;
- the model is converted as `tq.calibrate` converts it (`tq.calibration.prepare`, with one rule
  per quantized layer naming its quantizers) and the amaxes are set: a calibrated model, which
  `tq.quant_state`, `tq.summary`, QAT and `tq.export` take as they take any.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings

import torch
from torch import nn

from tqcompile.calibration.config import QuantConfig, QuantRule
from tqcompile.calibration.fake_quant import static_amax_kind
from tqcompile.calibration.fused import share_fused_weight_amax
from tqcompile.calibration.modules import (
    ExpertGemmQuantizers,
    holds_quantizers,
    kind_of,
    module_device,
    quant_units,
    static_amax_shape,
)
from tqcompile.calibration.pipeline import CalibrationWarning, prepare
from tqcompile.export.checkpoint_format import FORMATS, CheckpointFormat, format_for_method, known_layer_tensors
from tqcompile.export.decode import DecodedLayer, LayerScheme, check_layer, decode_layer, full_grid, with_scale_rules
from tqcompile.export.files import CheckpointFiles
from tqcompile.export.kv_cache import KV_TENSORS, QUERY_QUANTIZER, QUERY_TENSOR
from tqcompile.export.meta import Materializer, parameters_on_meta
from tqcompile.export.names import Placement, hf_model_from_config, placements, put_placed
from tqcompile.export.readers import trim_heap
from tqcompile.export.safetensors_io import dtype_name
from tqcompile.export.scales import bad_values, scaled_amax
from tqcompile.export.units import ExportError
from tqcompile.nn.base import is_converted
from tqcompile.quantizers import Granularity, Quantizer
from tqcompile.surgery.names import canonical_modules

__all__ = ["load_exported"]


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            content = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise ExportError(f"tq.load_exported: {path!r} is not JSON ({e}); restore the file the export wrote") from None
    if not isinstance(content, dict):
        raise ExportError(f"tq.load_exported: {path!r} holds a JSON {type(content).__name__}, not an object; restore the file the export wrote")
    return content


def _quantization_config(path: str) -> tuple[dict, dict, CheckpointFormat]:
    """(config.json, its quantization_config, the checkpoint's format); a format's own config
    file (ModelOpt's hf_quant_config.json) stands in for a config.json that has none."""
    config = _read_json(os.path.join(path, "config.json"))
    if config is None:
        raise ExportError(f"tq.load_exported: {path!r} has no config.json; pass a directory tq.export or save_pretrained wrote")
    qc = config.get("quantization_config")
    for fmt in FORMATS.values():
        if qc is None and fmt.CONFIG_FILE is not None:
            own = _read_json(os.path.join(path, fmt.CONFIG_FILE))
            qc = None if own is None else {"quant_method": fmt.QUANT_METHOD, **own}
    if qc is None:
        raise ExportError(
            f"tq.load_exported: {path!r}'s config.json has no quantization_config (and there is no "
            f"{' or '.join(f.CONFIG_FILE for f in FORMATS.values() if f.CONFIG_FILE)}): "
            "it is not a quantized checkpoint; load a float model with from_pretrained and tq.calibrate it"
        )
    if not isinstance(qc, dict):
        raise ExportError(f"tq.load_exported: {path!r}'s quantization_config is a {type(qc).__name__}, not an object")
    method = qc.get("quant_method")
    fmt = format_for_method(method)
    if fmt is None:
        allowed = ", ".join(repr(f.QUANT_METHOD) for f in FORMATS.values())
        raise ExportError(f"tq.load_exported: quant_method={method!r} is not allowed; allowed: {allowed}")
    fmt.check_config(qc, path)
    return config, qc, fmt


def _build_model(path: str, config: dict, dtype: torch.dtype, empty: bool = False) -> nn.Module:
    if "model_type" not in config:
        raise ExportError(
            f"tq.load_exported: {path!r}'s config.json names no model_type (not a transformers checkpoint); "
            "pass the model to fill: tq.load_exported(path, model=build_model())"
        )
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config  # else transformers would quantize the model it builds
    with parameters_on_meta() if empty else contextlib.nullcontext():
        return hf_model_from_config(hf_config, dtype=dtype).eval()


def _unit_by_weight_key(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """{state_dict key of a GEMM weight: (unit name, unit)} for the layers tq can fake-quantize."""
    out = {}
    for name, m in quant_units(model):
        found = kind_of(m)
        if isinstance(m, ExpertGemmQuantizers):
            owner = name.rpartition(".")[0]
            out[f"{owner}.{m.gemm.weight}" if owner else m.gemm.weight] = (name, m)
        elif found is not None and found[0] in ("Linear", "GroupedLinear"):
            out[f"{name}.weight" if name else "weight"] = (name, m)
    return out


def _prefix(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


class _Unit:
    """What the loader sets on one of the model's quantized GEMMs."""

    def __init__(self, name: str, scheme: LayerScheme):
        self.name, self.scheme = name, scheme
        self.weight_amax: torch.Tensor | None = None
        self.input_amax: torch.Tensor | None = None


def _tensor_amax(parts: list[tuple[Placement, torch.Tensor]], experts: int | None, notes: list[str], what: str) -> torch.Tensor:
    """A tensor-level amax from the checkpoint layers an engine would fuse (per expert for
    experts): the max of theirs, said in a note where they differ (vLLM requantizes so too)."""
    if experts is None:
        vals = torch.stack([a.reshape(()) for _, a in parts])
        if bool((vals != vals[0]).any()):
            notes.append(f"{what}: {len(parts)} checkpoint layers with different scales share one in the model (their max)")
        return vals.max()
    out = torch.full((experts,), -1.0)
    for p, a in parts:
        e = p.expert if p.expert is not None else 0
        if out[e] >= 0 and out[e] != a.reshape(()):
            notes.append(f"{what}: expert {e}'s layers have different scales; the model shares one (their max)")
        out[e] = torch.maximum(out[e], a.reshape(()))
    return out


def load_exported(
    path: str,
    model: nn.Module | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    compress: bool = False,
    fallback: str = "packed",
    device: str | torch.device | None = None,
) -> nn.Module:
    """Load a compressed-tensors or ModelOpt checkpoint (written by `tq.export`, llmcompressor,
    ModelOpt, ...), or a GPT-OSS one in its own MXFP4 format (as released, or `tq.export`'s), as a
    tq calibrated model: the fake-quantized modules `tq.calibrate` makes, whose
    float weights are the checkpoint's weights as tq dequantizes them and whose quantizers and
    static amaxes reproduce the checkpoint's scheme and scales. It evaluates as the checkpoint
    quantizes, fine-tunes with QAT, and exports again (`tq.export`) to the same payloads.

    Args:
        path: the checkpoint directory (config.json with a ``quantization_config``, or ModelOpt's
            hf_quant_config.json, and safetensors files, sharded or not).
        model: the float model to fill, of the checkpoint's architecture (freshly built, not yet
            quantized). None: a transformers model built from the directory's config.json
            (``AutoModelForCausalLM.from_config``, without the quantization_config), in eval mode.
        dtype: the parameter dtype of the model built when `model` is None (float32: QAT keeps
            float32 master weights); a given model keeps its own.
        compress: return the deployment form (`tq.compress`, with its `fallback`) instead: the
            built model's quantized layers are never held in float, each is read, packed and its
            float weight freed in turn, so the peak is the packed model plus about one layer (the
            weights a plain load then `tq.compress` would hold in float: the whole model). The
            result equals ``tq.compress(tq.load_exported(path, dtype=dtype), fallback=fallback)``.
        device: with `compress` and a built model, where its tensors are made and its layers
            packed, for that device's kernels (default: the CPU); the float model never exists
            anywhere. Without `compress`, load, then ``model.to(device)``.

    Scales map back to amaxes exactly for checkpoints tq wrote (calibrated, QAT or `tq.convert`
    models): the loaded model computes the exported model's logits bit for bit and exports to the
    same bytes. A scale another tool computed as ``amax / qmax`` may have no exact tq amax; the
    nearest is used (an fp32 ulp of the scale away) and a `CalibrationWarning` says how many.
    Integer layers load on the FULL grid (`tq.IntGrid`): codes -128 (INT8) and -8 (INT4), which
    llmcompressor writes, compute as themselves, as in the engines.
    Scale rules a checkpoint does not record are read off its scales: FP8 scales that are all
    powers of two load as ``power_of_two_scale``; MX blocks that only the RCEIL rule writes, as
    RCEIL. Dynamic per-tensor activations (a training recipe's export) keep no amax.

    Raises:
        ExportError: no quantization_config; a scheme tq cannot express (names the layer and the
            scheme); a model whose tensors do not match the checkpoint's (names them).

    Example:
        >>> model = tq.load_exported("llama-int8")            # a calibrated tq model
        >>> model.train(); loss = model(ids, labels=ids).loss  # QAT continues from it
        >>> served = tq.load_exported("llama-w4a16", dtype=torch.bfloat16, compress=True)  # packed INT4
    """
    from tqcompile.deploy.modules import FALLBACKS

    if fallback not in FALLBACKS:
        raise ValueError(f"tq.load_exported: fallback={fallback!r} is not allowed; allowed: {FALLBACKS}")
    if device is not None and (not compress or model is not None):
        raise ValueError(
            f"tq.load_exported: device={device!r} goes with compress=True and a model it builds (model=None); "
            "otherwise load, then move the model: model.to(device)"
        )
    device = torch.device("cpu" if device is None else device)
    ckpt = CheckpointFiles(path)  # a missing directory, shard or index is named first
    config, qc, fmt = _quantization_config(path)
    if model is None:
        model = _build_model(path, config, dtype, empty=compress)
    _check_float(model)
    resolve = fmt.scheme_resolver(qc, model)
    state = _untied_state(model)
    ckpt, where = fmt.reading_view(ckpt, model, placements(model, {k: v.shape for k, v in state.items()}))
    quantized = set(ckpt.layer_prefixes())
    units_by_key = _unit_by_weight_key(model)
    kv_q = fmt.kv_cache_quantizer(qc)
    kv, kv_inexact = _kv_cache(model, ckpt, kv_q)
    kv_names = {f"{n}.{t}" for n, amaxes in kv.items() for t in (*KV_TENSORS.values(), QUERY_TENSOR)[: len(amaxes)]}
    checked = _precheck(model, ckpt, state, where, quantized, units_by_key, resolve, fmt, kv_names)
    # Everything named and shaped as the model needs: now fill it, one tensor (one layer) at a time,
    # in place (memory holds the model and one layer, not a second copy of the model).
    units: list[tuple[nn.Module, _Unit]] = []
    deferred: list[tuple[str, str, nn.Module, list]] = []  # compress: layers read again when packed
    mismatch, notes, counts = [], [], {"inexact": kv_inexact, "rceil": 0, "fp8": 0, "pow2": 0}
    materialized = Materializer(model, device)
    with torch.no_grad():
        for key, value in state.items():
            ps, target = where[key], value.detach()
            if key not in units_by_key or not any(_prefix(p.name) in quantized for p in ps):
                target = materialized(key, target) if target.is_meta else target
                for p in ps:
                    put_placed(target, ckpt.get(p.name), p, value.dim() == 3, 1, mismatch, p.name)
                continue
            name, unit_module = units_by_key[key]
            dst = torch.empty(_gemm_shape(value.shape, unit_module), dtype=torch.float32)
            units.append((unit_module, _load_unit(name, unit_module, ps, ckpt, checked, fmt, dst, mismatch, notes, counts)))
            if target.is_meta and compress:  # its scales are read now; its weight again when packed
                deferred.append((key, name, unit_module, ps))
                del dst
                trim_heap()
            else:
                target = materialized(key, target) if target.is_meta else target
                target.copy_(dst.transpose(1, 2) if _transposed(unit_module) else dst)
        materialized.retie()
    if mismatch:
        raise ExportError(_mismatch_message(model, [], [], mismatch))
    # One scale rule for the model, as the scales show: MX blocks that only RCEIL gives, in any
    # layer (a layer whose blocks cannot tell takes the others'); FP8 scales all powers of two.
    rceil, pow2 = counts["rceil"] > 0, counts["fp8"] > 0 and counts["pow2"] == counts["fp8"]
    for _, u in units:
        u.scheme = with_scale_rules(u.scheme, rceil=rceil, pow2=pow2)
    _convert(model, units, kv_q, kv, device)
    # As tq.calibrate gives them (tq's own checkpoints already hold one global scale per group).
    for differed in share_fused_weight_amax([(u.name, model.get_submodule(u.name)) for _, u in units]):
        notes.append(f"NVFP4 layers that engines fuse into one GEMM hold different global scales ({differed}); the model gives them one amax, the max of theirs")
    _warn(notes, counts, path)
    if compress:
        _pack_deferred(model, materialized, deferred, ckpt, checked, fmt, fallback)
        if len(deferred) < len(units) or kv:  # layers of a given model, loaded in place; KV caches
            from tqcompile.deploy.modules import compress as compress_model

            compress_model(model, fallback=fallback)
        if deferred:
            materialized.move_buffers()  # rotary tables and the like, built on the CPU
    return model


def _pack_deferred(model: nn.Module, materialized: Materializer, deferred: list, ckpt, checked, fmt, fallback: str) -> None:
    """Read each deferred layer's weight again (as the first pass did), put it in the converted
    module and pack it (`tq.compress`'s packing), one module at a time: an experts module once
    all its GEMMs' weights are in."""
    from tqcompile.deploy.modules import pack_module

    by_module: dict[str, list] = {}
    for key, name, unit_module, ps in deferred:
        owner = key.rpartition(".")[0]
        by_module.setdefault(owner, []).append((key, name, unit_module, ps))
    with torch.no_grad():
        for owner, items in by_module.items():
            for key, name, unit_module, ps in items:
                meta = model.get_parameter(key)
                dst = torch.empty(_gemm_shape(meta.shape, unit_module), dtype=torch.float32)
                _load_unit(name, unit_module, ps, ckpt, checked, fmt, dst, [], [], {"inexact": 0, "rceil": 0, "fp8": 0, "pow2": 0})
                dst = dst.transpose(1, 2) if _transposed(unit_module) else dst
                materialized(key, meta, tie=False).copy_(dst)
                del dst
            pack_module(owner, model.get_submodule(owner), fallback)
            trim_heap()  # the float weights just packed, freed: back to the system before the next layer


def _transposed(unit_module: nn.Module) -> bool:
    """An experts GEMM stored (E, in, out) (GPT-OSS): checkpoints hold it in the GEMM view, (E, out, in)."""
    return isinstance(unit_module, ExpertGemmQuantizers) and unit_module.gemm.transposed


def _gemm_shape(shape: torch.Size, unit_module: nn.Module) -> torch.Size:
    return torch.Size((shape[0], shape[2], shape[1])) if _transposed(unit_module) else shape


def _layer_shape(ckpt: CheckpointFiles, prefix: str, scheme: LayerScheme) -> tuple[int, ...] | None:
    """A quantized layer's (out, in), from its headers (and its small weight_shape tensor)."""
    if f"{prefix}.weight_shape" in ckpt.entries:
        return tuple(int(v) for v in ckpt.get(f"{prefix}.weight_shape"))
    entry = ckpt.entries.get(f"{prefix}.weight_packed") or ckpt.entries.get(f"{prefix}.weight")
    if entry is None:
        return None
    shape = tuple(entry[1]["shape"])
    q = scheme.weight_q
    if entry[1]["dtype"] == dtype_name(torch.uint8) and shape and q.element_format().pack_elements > 1:
        shape = q.logical_shape(shape)  # packed by bit width: two 4-bit elements a byte (NVFP4, MXFP4)
    return tuple(shape)


def _slot_shape(shape: torch.Size, p: Placement, experts: bool) -> tuple[int, ...]:
    s = tuple(shape[1:]) if experts and p.expert is not None else tuple(shape)
    return (p.rows.numel(), *s[1:]) if p.rows is not None and s else s


def _precheck(
    model, ckpt: CheckpointFiles, state: dict, where: dict, quantized: set[str], units_by_key: dict, resolve, fmt, kv_names: set[str]
) -> dict:
    """Names and shapes against the checkpoint's headers, then every tensor (`_check_layers`),
    before any tensor is written into the model: a checkpoint of another architecture, or a
    corrupt one, changes nothing (`kv_names`: the KV-cache scales, checked by `_kv_cache`).
    Returns each quantized layer's scheme."""
    missing, mismatch, known = [], [], set(kv_names)
    for key, value in state.items():
        ps = where[key]
        q_ps = [p for p in ps if _prefix(p.name) in quantized]
        if q_ps and (len(q_ps) != len(ps) or key not in units_by_key):
            raise ExportError(
                f"tq.load_exported: the checkpoint quantizes {sorted(_prefix(p.name) for p in q_ps)}, which the model holds as "
                f"{key!r}, {'partly in high precision' if key in units_by_key else 'not a layer tq quantizes (Linear or MoE experts)'}; "
                "the model's architecture does not match the checkpoint's"
            )
        for p in ps:
            if q_ps:
                prefix = _prefix(p.name)
                scheme = resolve(prefix)  # a scheme tq cannot express raises here, naming the layer
                known.update(f"{prefix}.{t}" for t in known_layer_tensors())
                got = _layer_shape(ckpt, prefix, scheme)
            elif p.name in ckpt.entries:
                known.add(p.name)
                got = tuple(ckpt.entries[p.name][1]["shape"])
            else:
                missing.append(p.name)
                continue
            want = _slot_shape(_gemm_shape(value.shape, units_by_key[key][1]) if q_ps else value.shape, p, value.dim() == 3)
            if got != want:
                mismatch.append(f"{p.name}: checkpoint {got}, model {want}")
    ckpt.refuse_strays({p.name for ps in where.values() for p in ps})
    unused = sorted(set(ckpt.entries) - known)
    if missing or unused or mismatch:
        raise ExportError(_mismatch_message(model, missing, unused, mismatch))
    return _check_layers(ckpt, state, where, quantized, units_by_key, resolve, fmt)


def _check_layers(ckpt: CheckpointFiles, state: dict, where: dict, quantized: set[str], units_by_key: dict, resolve, fmt) -> dict:
    """Every tensor's dtype and every quantized layer's tensors and scales (`decode.check_layer`),
    and that the checkpoint layers of one model GEMM are quantized alike: whatever a checkpoint
    can get wrong is found here, before the first tensor is copied into the model. Returns each
    quantized layer's scheme, as its scales show it."""
    checked: dict[str, LayerScheme] = {}
    for key, value in state.items():
        ps = where[key]
        if key not in units_by_key or not any(_prefix(p.name) in quantized for p in ps):
            for p in ps:
                stored = ckpt.entry(p.name)["dtype"]
                if stored.startswith(("F", "BF")) != value.is_floating_point() or (stored == "BOOL") != (value.dtype == torch.bool):
                    raise ExportError(f"tq.load_exported: {p.name} is stored as {stored}; the model's {key!r} is {value.dtype}")
            continue
        name, unit_module = units_by_key[key]
        experts = isinstance(unit_module, ExpertGemmQuantizers) or kind_of(unit_module)[0] == "GroupedLinear"
        first = None
        for p in ps:
            prefix = _prefix(p.name)
            if experts and p.expert is None:
                raise ExportError(f"tq.load_exported: layer {prefix!r} holds all experts in one tensor; tq loads per-expert layers")
            scheme = check_layer(prefix, resolve(prefix), lambda local, pre=prefix: ckpt.entry(f"{pre}.{local}"),
                                 lambda local, pre=prefix: ckpt.get(f"{pre}.{local}"), fmt)
            checked[prefix] = scheme
            wq = scheme.weight_q
            if first is None:
                first = (prefix, scheme)
            elif (scheme.weight_q, scheme.input_q, scheme.static_input) != (first[1].weight_q, first[1].input_q, first[1].static_input):
                raise ExportError(
                    f"tq.load_exported: {first[0]!r} ({first[1].text}) and {prefix!r} ({scheme.text}) are one GEMM in the "
                    f"model ({name!r}) but quantized differently in the checkpoint; tq quantizes a GEMM one way"
                )
            block = wq.layout()[2] if wq.layout()[0] is Granularity.BLOCKWISE_2D else 1
            if p.rows is not None and block > 1 and (int(p.rows[0]) % block or p.rows.numel() % block):
                raise ExportError(
                    f"tq.load_exported: {prefix!r} is rows {int(p.rows[0])}..{int(p.rows[0]) + p.rows.numel()} of the model's "
                    f"{key!r}, which do not align with its {block}x{block} scale blocks"
                )
    return checked


def _check_float(model: nn.Module) -> None:
    for name, m in canonical_modules(model):
        if holds_quantizers(m) or is_converted(m):
            raise ExportError(
                f"tq.load_exported: module {name!r} of the model is already quantized ({type(m).__name__}); "
                "pass a freshly built float model (or model=None to build it from the checkpoint's config)"
            )


def _untied_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict without tensors tied to an earlier one (as `tq.export` writes it)."""
    seen, out = set(), {}
    for k, v in model.state_dict(keep_vars=True).items():
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        out[k] = v
    return out


def _on_full_grid(p: Placement, layer: DecodedLayer, ckpt, fmt) -> DecodedLayer:
    full = full_grid(layer.scheme)
    if full is None:
        return layer
    prefix = _prefix(p.name)
    return decode_layer(prefix, full, lambda local: ckpt.get(f"{prefix}.{local}"), fmt)


def _load_unit(name, unit_module, ps, ckpt, checked, fmt, dst, mismatch, notes, counts) -> _Unit:
    experts = isinstance(unit_module, ExpertGemmQuantizers) or kind_of(unit_module)[0] == "GroupedLinear"
    layers: list[tuple[Placement, DecodedLayer]] = []
    for p in ps:
        prefix = _prefix(p.name)
        layer = decode_layer(prefix, checked[prefix], lambda local, pre=prefix: ckpt.get(f"{pre}.{local}"), fmt)
        layers.append((p, layer))
    if len({lay.scheme for _, lay in layers}) > 1:
        # One GEMM, one quantizer: layers without bottom codes (-8, -128) join those with them on the FULL grid.
        layers = [(p, _on_full_grid(p, lay, ckpt, fmt)) for p, lay in layers]
    for _, layer in layers:
        counts["inexact"] += layer.inexact
        counts["rceil"] += layer.mx_rceil
        if layer.pow2_scales is not None:
            counts["fp8"] += 1
            counts["pow2"] += layer.pow2_scales
    first = layers[0][1].scheme
    unit = _Unit(name, first)
    wq, n_exp = first.weight_q, (dst.shape[0] if experts else None)
    for p, layer in layers:
        put_placed(dst, layer.weight, p, experts, 1, mismatch, p.name)
    kind = static_amax_kind(wq, "weight")
    if kind == "tensor":
        amax = _tensor_amax([(p, lay.weight_amax) for p, lay in layers], n_exp, notes, name)
        unit.weight_amax = amax.reshape(-1, 1, 1) if experts else amax
    elif kind == "unit":
        unit.weight_amax = torch.zeros(wq.scale_shape(dst.shape))
        block = wq.layout()[2] if wq.layout()[0] is Granularity.BLOCKWISE_2D else 1
        for p, lay in layers:
            put_placed(unit.weight_amax, lay.weight_amax, p, experts, block, mismatch, f"{p.name} scales")
    if first.input_q is not None and first.static_input:
        unit.input_amax = _tensor_amax([(p, lay.input_amax) for p, lay in layers], n_exp, notes, f"{name} input")
    return unit


def _kv_cache(model: nn.Module, ckpt: CheckpointFiles, q: Quantizer | None) -> tuple[dict[str, tuple[torch.Tensor, ...]], int]:
    """({attention name: (key amax, value amax[, query amax])}, how many scales have no exact amax)
    from the checkpoint's KV-cache scales (`tqcompile.export.kv_cache`), every one checked: each
    attention of the model has both, shaped as the scheme `q` says, finite and positive; a query
    scale (one per layer) in every attention or in none; none is left over."""
    held = {k.rpartition(".")[0] for k in ckpt.entries if k.endswith(tuple(f".{t}" for t in KV_TENSORS.values()))}
    if q is None:
        if held:
            raise ExportError(
                f"tq.load_exported: the checkpoint holds KV-cache scales ({sorted(held)[0]}.k_scale, ...) but its config names no "
                "KV-cache scheme (kv_cache_scheme / kv_cache_quant_algo): the config and the tensors disagree"
            )
        return {}, 0
    attentions = {n: m for n, m in quant_units(model) if (found := kind_of(m)) is not None and found[0] == "Attention"}
    lacking = sorted(set(attentions) - held)
    strays = sorted(held - set(attentions))
    if lacking or strays or not attentions:
        raise ExportError(
            f"tq.load_exported: the checkpoint quantizes the KV cache, but its scales do not match the model's attention modules: "
            f"attentions without k_scale/v_scale: {lacking or 'none'}; scales of no attention of the model: {strays or 'none'}"
        )
    with_query = sorted(n for n in attentions if f"{n}.{QUERY_TENSOR}" in ckpt.entries)
    if with_query and len(with_query) != len(attentions):
        raise ExportError(
            f"tq.load_exported: attention {with_query[0]!r} has a {QUERY_TENSOR} and "
            f"{sorted(set(attentions) - set(with_query))[0]!r} has none; a query is quantized in every attention or in none"
        )
    out, inexact = {}, 0
    for name, module in attentions.items():
        scales = [(local, q, static_amax_shape(module, "key", q)) for local in KV_TENSORS.values()]
        scales += [(QUERY_TENSOR, QUERY_QUANTIZER, ())] if with_query else []
        amaxes = []
        for local, scheme, want in scales:
            t = ckpt.get(f"{name}.{local}")
            if t is None:
                raise ExportError(f"tq.load_exported: attention {name!r} lacks its {local}")
            n = 1 if not want else want[0]
            problem = (None if t.numel() == n else f"{t.numel()} values where the scheme has {n}") or bad_values(t, zero_ok=False)
            if problem:
                raise ExportError(
                    f"tq.load_exported: {name}.{local} holds {problem}; KV scales are finite and positive, one per layer or per KV "
                    "head (q_scale: one per layer)"
                )
            amax, more = scaled_amax(t.float().reshape(want), scheme)
            amaxes.append(amax)
            inexact += more
        out[name] = tuple(amaxes)
    return out, inexact


def _convert(
    model: nn.Module, units: list[tuple[nn.Module, _Unit]], kv_q: Quantizer | None = None, kv: dict | None = None, device: torch.device | None = None
) -> None:
    """Convert as `tq.calibrate` does (every quantizable module; the loaded layers with their
    checkpoint's quantizers, the attentions with the KV cache's), then set the amaxes. A dynamic
    per-tensor input (what `tq.export` writes for a training recipe's activations) keeps no amax:
    its scale comes from each input, as in the engines (calibration would have made it static)."""
    rules = tuple(QuantRule(name=u.name, input=u.scheme.input_q or False, weight=u.scheme.weight_q, output=False) for _, u in units)
    kv = kv or {}
    rules += tuple(QuantRule(name=name, key=kv_q, value=kv_q, query=QUERY_QUANTIZER if len(a) > 2 else None) for name, a in kv.items())
    prepare(model, QuantConfig(rules))
    for name, amaxes in kv.items():
        m = model.get_submodule(name)
        for t, amax in zip((m.key_quantizer, m.value_quantizer, m.query_quantizer), amaxes):
            t.set_amax(amax.to(_real(module_device(m), device)))
    for _, u in units:
        m = model.get_submodule(u.name)
        where = _real(module_device(m.owner if isinstance(m, ExpertGemmQuantizers) else m), device)
        if u.weight_amax is not None:
            m.weight_quantizer.set_amax(u.weight_amax.to(where))
        if u.scheme.input_q is not None:
            m.input_quantizer.set_amax(None if u.input_amax is None else u.input_amax.to(where))


def _real(device: torch.device, packed_on: torch.device | None) -> torch.device:
    """Where a module's amaxes go: its device, or, for one whose weights are still on the meta
    device (`compress=True`: read and packed later), the device it is packed on."""
    return (packed_on or torch.device("cpu")) if device.type == "meta" else device


def _mismatch_message(model: nn.Module, missing: list[str], unused: list[str], mismatch: list[str]) -> str:
    def few(xs: list[str]) -> str:
        return ", ".join(xs[:6]) + (f" and {len(xs) - 6} more" if len(xs) > 6 else "") if xs else "none"

    return (
        f"tq.load_exported: the model ({type(model).__name__}) does not match the checkpoint's architecture: "
        f"tensors the model needs that the checkpoint lacks: {few(missing)}; checkpoint tensors the model has no place "
        f"for: {few(unused)}; shapes that differ: {few(mismatch)}"
    )


def _warn(notes: list[str], counts: dict, path: str) -> None:
    lines = list(dict.fromkeys(notes))
    if counts["inexact"]:
        lines.append(
            f"{counts['inexact']} scales have no tq amax that gives them exactly (scales computed as amax / qmax, by another "
            "tool): the nearest is used, an fp32 ulp of the scale away"
        )
    if lines:
        warnings.warn(f"tq.load_exported({path!r}):\n  " + "\n  ".join(lines), CalibrationWarning, stacklevel=3)
