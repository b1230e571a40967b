"""`tq.compress`: a calibrated model's deployment form, its weights packed and run by real kernels.

A calibrated model (`tq.calibrate`, `tq.restore`, `tq.load_exported`) keeps float weights and
fake-quantizes them on every call. `compress` quantizes each weight once, with its calibrated
amax, into a `QuantizedTensor` parameter (INT8 and FP8 one byte an element, INT4 and FP4 half a
byte, with their scales), frees the float weight, and gives the module a ``Packed<Class>`` class
whose forward runs the kernel `tqcompile.deploy.kernels.linear_kernel` chose for the layer. The
module keeps its quantizers (input and output amaxes, the weight's method), so `tq.summary` and
`tq.quant_state` read it as before, and its class still derives from the model's own (``nn.Linear``).

Experts modules (fused 3-D expert weights) keep their routing; each GEMM's weight is packed per
expert in the GEMM's (experts, out, in) view under the parameter's name. INT8 (weight-only or
W8A8) and INT4 weight-only GEMMs on the CPU call the dense layers' kernels once per expert with
rows (`tqcompile.deploy.experts_mm`, `kernels.experts_kernel`); FP8 GEMMs on CUDA's
Hopper/Blackwell run one ``torch._scaled_grouped_mm``; every other one dequantizes its routed
experts' packed weights per call (exact; half or a quarter of the bytes).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tqcompile import ops
from tqcompile.calibration.attention import _HFAttentionKV
from tqcompile.calibration.modules import (
    ExpertGemmQuantizers,
    base_class,
    is_fake_quant_experts,
    kind_of,
    register_mixin,
    slots_of,
)
from tqcompile.deploy.experts_mm import EXPERTS_KERNELS, experts_int_mm, experts_weight_only_mm
from tqcompile.deploy.int4_cpu import Int4PackedCPUTensor
from tqcompile.deploy.int4_cuda import Int4PackedCUDATensor
from tqcompile.deploy.kernels import _WEIGHT_ONLY_MAX_M, experts_kernel, int4_kernel_block, linear_kernel, packed_linear
from tqcompile.deploy.mx_packed import MXFP4PackedTensor, holds_e8m0_scales, mx_packed
from tqcompile.deploy.packed import PackedModule
from tqcompile.nn.experts import ExpertsRouting
from tqcompile.ops import grouped_gemm as gops
from tqcompile.surgery.classes import generated_class
from tqcompile.surgery.names import canonical_modules
from tqcompile.tensor import GroupedQuantizedTensor, QuantizedTensor, quantize_usages

__all__ = ["compress", "PackedModule", "DeployedLayer", "deployed_layers", "FALLBACKS"]

# What `compress` does with a weight no kernel serves: keep it packed and dequantize per call
# (the memory saving, at the dequantization's cost), or keep the dequantized weight (the float
# model's memory and speed, no per-call work). Both compute what the calibrated model computes.
FALLBACKS = ("packed", "dequantized")


@register_mixin
class _LinearPacked(PackedModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tq_kernel == "dequantized":  # the fallback kept the dequantized weight
            y = F.linear(self.input_quantizer(x), self.weight, self.bias)
        else:
            y = packed_linear(x, self.weight, self.bias, self.input_quantizer, self.tq_kernel, self._buffers.get("weight_kernel_scale"))
        return self.output_quantizer(y)


def _dequantized_gemm_weight(w: torch.Tensor) -> torch.Tensor:
    """The (E, N, K) weight of one experts GEMM as the calibrated model computes with it."""
    if not isinstance(w, QuantizedTensor):
        return w  # the "dequantized" fallback, or a GEMM whose weight quantizer is disabled
    if isinstance(w, GroupedQuantizedTensor):  # one tensor-level amax per expert
        e, n, k = w.shape
        ends = gops.equal_ends(e, n, w._data.device)
        return gops.grouped_dequantize(w._data, w._scale_inv, w._amax, w.quantizer, ends, w.orig_dtype).view(e, n, k)
    return w.dequantize()


def _routed_gemm_weight(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """The (R, N, K) dequantized weights of experts `ids` (R of them, repeats allowed) of a packed
    (E, N, K) experts weight, each equal to its expert's slice of `_dequantized_gemm_weight(w)`; None
    where the packed layout has no per-expert leading dim to gather along (then the whole weight is
    dequantized)."""
    if not isinstance(w, QuantizedTensor) or w._data is None or isinstance(w, Int4PackedCPUTensor):  # INT4: the kernel's layout
        return None
    e, n, k = w.shape
    r = ids.numel()
    if isinstance(w, GroupedQuantizedTensor):  # (E*N, K') rows, scales per expert or per row
        s = w._scale_inv
        if s.dim() == 1 and s.shape[0] == e:
            s = s[ids]
        elif s.shape[0] == e * n:
            s = s.view(e, n, *s.shape[1:])[ids].reshape(r * n, *s.shape[1:])
        else:
            return None
        data = w._data.view(e, n, -1)[ids].reshape(r * n, -1)
        ends = gops.equal_ends(r, n, data.device)
        return gops.grouped_dequantize(data, s, w._amax[ids], w.quantizer, ends, w.orig_dtype).view(r, n, k)
    if w._data.shape[0] != e or w._scale_inv.dim() < 2 or w._scale_inv.shape[0] != e or (w._amax is not None and w._amax.dim() > 0):
        return None
    if isinstance(w, MXFP4PackedTensor):  # its own payload order
        return w.dequantize_at(ids)
    return ops.dequantize(w._data[ids], w._scale_inv[ids], w._amax, w.quantizer, w.orig_dtype)


def _grouped_input_codes(input_quantizer, x: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The INT8 (or FP8) codes of an experts GEMM's (R, K) input (rows sorted by expert) and each row's fp32
    scale, as its calibrated fake-quantizer computes them (`fake_quantize_grouped`): per expert
    with its static amax or one from its rows, or per token."""
    q, amax = input_quantizer.quantizer, input_quantizer.amax
    if amax is None and q.uses_tensor_amax():
        amax = gops.grouped_amax(x, q, ends, False)
    codes, scale_inv = gops.grouped_quantize(x, q, ends, amax, None, False)
    if scale_inv.dim() == 1:  # one scale per expert: each row takes its expert's
        scale_inv = scale_inv[gops.expert_ids(ends, x.shape[0])]
    return codes, scale_inv.reshape(-1, 1).float()


@register_mixin
class _ExpertsPacked(ExpertsRouting):
    """Deployed experts: the routing of `tqcompile.nn.experts`; each GEMM runs its kernel
    (``unit.tq_kernel``): the CPU's integer kernels per expert with rows (`experts_mm`), or its
    input quantized as calibrated and its packed weight dequantized (``dequantize``: exactly the
    calibrated model's computation).

    Dequantizing with fewer routed rows than experts (decoding: a token's top-k of E experts),
    only the routed experts' weights are dequantized, one per row, each row's group ending where
    its expert's does: the same GEMM per expert as over the whole weight, so the same result, bit
    for bit."""

    tq_class_prefix = "Packed"
    tq_kernel = "dequantize"

    def _expert_gemm(self, index: int, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        g = self.tq_experts_layout.gemms[index]
        unit = self._modules[f"{g.weight}_gemm"]
        ends = torch.cumsum(counts.to(torch.int64), 0)
        packed = self._parameters[g.weight]
        kernel = unit.tq_kernel
        routed = x.shape[0] < packed.shape[0] and kernel == "dequantize"
        ids = gops.expert_ids(ends, x.shape[0]) if routed or g.bias is not None else None
        if kernel == "int_mm":  # W8A8 on the CPU: the input's codes as calibrated, a kernel call per expert with rows
            codes, row_scale = _grouped_input_codes(unit.input_quantizer, x, ends)
            y = experts_int_mm(codes, row_scale, packed._data, packed._scale_inv, ends, x.dtype)
        elif kernel == "scaled_grouped_mm":  # FP8 on CUDA: the input's codes as calibrated, all experts in one call
            codes, row_scale = _grouped_input_codes(unit.input_quantizer, x, ends)
            y = gops.scaled_grouped_mm(codes, row_scale.view(-1), packed._data, self._buffers[f"{g.weight}_kernel_scale"], ends, x.dtype)
        elif kernel in EXPERTS_KERNELS:  # weight-only INT8 / INT4 on the CPU: a kernel call per expert with rows
            scale = packed._scale_inv if kernel == "int4pack_mm" else self._buffers[f"{g.weight}_kernel_scale"]
            most = _WEIGHT_ONLY_MAX_M[("cpu", kernel)]
            y = experts_weight_only_mm(x, packed._data, scale, packed._scale_inv, packed.quantizer, ends, kernel, most)
        else:
            w = _routed_gemm_weight(packed, ids) if routed else None
            # Routed: row j's group is empty unless j is the first row of its expert's segment, then the segment.
            gemm_ends = ends if w is None else ends[ids]
            if w is None:
                w = _dequantized_gemm_weight(packed)
            y = gops.grouped_mm(unit.input_quantizer(x, ends=ends), w, gemm_ends)
        if g.bias is not None:
            y = y + self._parameters[g.bias].to(y.dtype)[ids]
        return unit.output_quantizer(y)


@dataclasses.dataclass(frozen=True)
class DeployedLayer:
    """One layer of a compressed model: its name, kernel (`tqcompile.deploy.kernels.KERNELS`,
    "dequantized" for the float fallback, or "fp8 kv cache" for an attention), why, and the bytes
    its weight holds in memory (with the INT8 weight-only kernel's scales kept beside it)."""

    name: str
    kernel: str
    reason: str
    weight_bytes: int


def _bytes(t: torch.Tensor) -> int:
    if isinstance(t, QuantizedTensor):
        return sum(x.numel() * x.element_size() for x in t._inner().values())
    return t.numel() * t.element_size()


def _static_amax(tq, what: str) -> torch.Tensor | None:
    """The weight quantizer's calibrated amax; an error where calibration has not set one."""
    if tq.observer is not None:
        raise RuntimeError(f"tq.compress: {what} is still calibrating; compress after tq.calibrate returns")
    if tq.static_kind is not None and tq.amax is None:
        raise RuntimeError(f"tq.compress: {what} has no calibrated weight amax; calibrate (tq.calibrate) or restore (tq.restore) it first")
    return tq.amax


def _kv_packable(module: nn.Module) -> bool:
    """A fake-quantized Hugging Face attention whose keys and values are quantized, not compressed
    yet: `tq.compress` gives it an FP8 cache (`tqcompile.deploy.kv_cache`)."""
    return (
        isinstance(module, _HFAttentionKV)
        and not isinstance(module, PackedModule)
        and module.key_quantizer.enabled
        and module.value_quantizer.enabled
    )


def _check_dense(name: str, t: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        raise ValueError(f"tq.compress: {name} is sharded ({t.placements}); compress the unsharded model (one process)")
    if isinstance(t, QuantizedTensor):
        raise ValueError(f"tq.compress: {name} is already packed; compress a calibrated model once")
    if t.device.type == "meta":
        raise ValueError(f"tq.compress: {name} is on the meta device; load the weights first")


def _compilable(qt: QuantizedTensor) -> QuantizedTensor:
    """A packed weight dequantized per call, in the form inductor can generate that dequantization
    from: an MX weight's E8M0 scales as their bits (`MXPackedTensor`)."""
    return mx_packed(qt) if type(qt) is QuantizedTensor and holds_e8m0_scales(qt) else qt


def _pack_linear(name: str, module: nn.Module, fallback: str) -> None:
    slots = slots_of(module)
    w = module.weight.detach()
    q = slots["weight"].quantizer
    amax = _static_amax(slots["weight"], f"the weight quantizer of {name!r}")
    qt = quantize_usages(w, None, q, rowwise=True, columnwise=False, seed=None, group_name=None, amax=amax)
    input_q = slots["input"].quantizer
    kernel, why = linear_kernel(q, input_q, tuple(w.shape), w.device, w.dtype)
    if kernel == "int4pack_mm":
        packed_class = Int4PackedCUDATensor if w.device.type == "cuda" else Int4PackedCPUTensor
        qt = packed_class.from_quantized(qt, int4_kernel_block(q, w.shape[1]))
    if kernel == "dequantize" and fallback == "dequantized":
        packed, kernel, why = qt.dequantize(), "dequantized", f"{why}; kept dequantized (fallback='dequantized')"
    else:
        packed = _compilable(qt)
    module._parameters["weight"] = nn.Parameter(packed, requires_grad=False)
    if kernel == "int8pack_mm":  # the kernel's (N,) scales in the model's dtype (kernels.weight_only_mm)
        module.register_buffer("weight_kernel_scale", qt._scale_inv.reshape(-1).to(w.dtype))
    module.__class__ = generated_class(base_class(module), _LinearPacked)
    module.tq_kernel, module.tq_kernel_reason = kernel, why


def _pack_experts(name: str, module: nn.Module, fallback: str) -> None:
    for g in module.tq_experts_layout.gemms:
        unit = module._modules[f"{g.weight}_gemm"]
        w = unit.weight.detach()  # the (E, N, K) GEMM view
        wq = unit.weight_quantizer
        q = wq.quantizer
        kernel, why = "dequantize", "experts GEMM: per-expert tensor scales; the routed experts' packed weights dequantized per call (exact)"
        if q is None:
            packed = w.contiguous()
        elif wq.static_kind == "tensor":  # one amax per expert: quantized per expert as the grouped path does
            e, n, k = w.shape
            ends = gops.equal_ends(e, n, w.device)
            amax = _static_amax(wq, f"the weight quantizer of {name}.{g.weight}").reshape(e)
            data, scale_inv = gops.grouped_quantize(w.reshape(e * n, k), q, ends, amax, None, False)
            packed = GroupedQuantizedTensor(w.shape, q, w.dtype, None, _data=data, _scale_inv=scale_inv, _amax=amax)
            rule = experts_kernel(q, unit.input_quantizer.quantizer, tuple(w.shape), w.device, w.dtype)
            if rule[0] == "scaled_grouped_mm":  # the CPU's integer kernels take per-row scales, not these
                kernel, why = rule
        else:
            amax = _static_amax(wq, f"the weight quantizer of {name}.{g.weight}")
            packed = quantize_usages(w.contiguous(), None, q, rowwise=True, columnwise=False, seed=None, group_name=None, amax=amax)
            kernel, why = experts_kernel(q, unit.input_quantizer.quantizer, tuple(w.shape), w.device, w.dtype)
        if kernel == "int4pack_mm":
            packed = Int4PackedCPUTensor.from_quantized(packed, int4_kernel_block(q, w.shape[2]))
        elif kernel == "int8pack_mm":  # the kernel's (E, N) scales in the model's dtype (kernels.weight_only_mm)
            module.register_buffer(f"{g.weight}_kernel_scale", packed._scale_inv.reshape(w.shape[:2]).to(w.dtype))
        elif kernel == "scaled_grouped_mm":  # each weight row's fp32 scale, (E, N): its expert's or its own
            e, n = w.shape[:2]
            module.register_buffer(f"{g.weight}_kernel_scale", packed._scale_inv.float().reshape(e, -1).expand(e, n).contiguous())
            packed = _compilable(packed)
        elif fallback == "dequantized" and isinstance(packed, QuantizedTensor):
            packed = _dequantized_gemm_weight(packed)
            kernel, why = "dequantized", f"{why}; kept dequantized (fallback='dequantized')"
        elif isinstance(packed, QuantizedTensor):
            packed = _compilable(packed)
        else:
            kernel, why = "dequantized", "experts GEMM whose weight quantizer is disabled: its float weight"
        module._parameters[g.weight] = nn.Parameter(packed, requires_grad=False)
        unit.tq_kernel, unit.tq_kernel_reason = kernel, why
    # The packed weights are stored in the GEMM's (E, out, in) view, whatever the model stored.
    gemms = tuple(dataclasses.replace(g, transposed=False) for g in module.tq_experts_layout.gemms)
    module.tq_experts_layout = dataclasses.replace(module.tq_experts_layout, gemms=gemms)
    for g in gemms:
        module._modules[f"{g.weight}_gemm"].gemm = g
    module.__class__ = generated_class(base_class(module), _ExpertsPacked)


def compress(model: nn.Module, *, fallback: str = "packed") -> nn.Module:
    """Turn a calibrated model into its deployment form, in place, and return it.

    Every fake-quantized linear layer whose weight quantizer is enabled (and every fake-quantized
    experts GEMM) gets its weight quantized once into a packed `QuantizedTensor` parameter, the
    float weight freed, and a forward that runs the layer's kernel (`deployed_layers` lists them;
    docs/deploy.md). Other fake-quantized modules (convolutions, norms, embeddings) stay as they
    are. The result runs under ``torch.compile(fullgraph=True)`` and HF ``generate`` (static KV
    cache included), and its ``state_dict`` (packed tensors) loads into another compressed model
    of the same calibration. It is for inference: the packed weights take no gradient.

    Args:
        model: a model from `tq.calibrate`, `tq.restore` or `tq.load_exported`, unsharded.
        fallback: for a weight no kernel serves on its device (FP8, MX, NVFP4 on the CPU):
            "packed" keeps it packed and dequantizes per call (the memory saving; slower than the
            float model), "dequantized" keeps the dequantized weight (the float model's memory and
            speed). Both compute exactly what the calibrated model computes.

    Raises:
        ValueError: a bad `fallback`; a sharded, meta or already packed weight (names it).
        RuntimeError: a layer still calibrating or without its calibrated weight amax.

    Example:
        >>> tq.calibrate(model, tq.configs.int4_weight_only(), forward_loop)
        >>> tq.compress(model)        # INT4 weights at half a byte, torch._weight_int4pack_mm_for_cpu
        >>> model = torch.compile(model, fullgraph=True)
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"tq.compress: fallback={fallback!r} is not allowed; allowed: {FALLBACKS}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"tq.compress: model must be a torch.nn.Module, got {type(model).__name__}")
    todo = []
    for name, module in canonical_modules(model):
        if _kv_packable(module):
            todo.append(("attention", name, module))
        elif is_fake_quant_experts(module):
            todo.append(("experts", name, module))
        elif slots_of(module) is not None and not isinstance(module, (ExpertGemmQuantizers, PackedModule)):
            found = kind_of(module)
            if found is not None and found[0] == "Linear" and slots_of(module)["weight"].enabled:
                todo.append(("linear", name, module))
    if not todo:
        raise ValueError(
            "tq.compress: the model has no calibrated linear layer, experts module or Hugging Face attention with a quantized "
            "KV cache to pack; run tq.calibrate (or tq.restore) first"
        )
    for what, name, module in todo:  # checks before the first change: a failure leaves the model as it was
        _check_packable(what, name, module)
    for what, name, module in todo:
        _pack(what, name, module, fallback)
    return model


def pack_module(name: str, module: nn.Module, fallback: str = "packed") -> None:
    """`compress` of one calibrated linear layer or experts module, its float weights in place:
    `tq.load_exported(..., compress=True)` packs each layer as it reads it."""
    what = "experts" if is_fake_quant_experts(module) else "linear"
    _check_packable(what, name, module)
    _pack(what, name, module, fallback)


def _check_packable(what: str, name: str, module: nn.Module) -> None:
    if what == "attention":
        for slot in ("key", "value"):
            _static_amax(getattr(module, f"{slot}_quantizer"), f"the {slot} quantizer of {name!r}")
    elif what == "linear":
        _check_dense(f"{name}.weight", module.weight)
        _static_amax(slots_of(module)["weight"], f"the weight quantizer of {name!r}")
    else:
        for g in module.tq_experts_layout.gemms:
            unit = module._modules[f"{g.weight}_gemm"]
            _check_dense(f"{name}.{g.weight}", unit.weight)
            if unit.weight_quantizer.enabled:
                _static_amax(unit.weight_quantizer, f"the weight quantizer of {name}.{g.weight}")


def _pack(what: str, name: str, module: nn.Module, fallback: str) -> None:
    if what == "attention":
        from tqcompile.deploy.kv_cache import pack_attention  # Hugging Face's cache classes: transformers

        pack_attention(module)
    elif what == "linear":
        _pack_linear(name, module, fallback)
    else:
        _pack_experts(name, module, fallback)


def deployed_layers(model: nn.Module) -> list[DeployedLayer]:
    """The packed layers of a compressed model: name, kernel, why, weight bytes in memory. A
    compressed attention's row is its FP8 KV cache ("fp8 kv cache", 0 weight bytes: its
    projections are rows of their own)."""
    rows = []
    for name, module in canonical_modules(model):
        if isinstance(module, _HFAttentionKV) and isinstance(module, PackedModule):
            rows.append(DeployedLayer(name, module.tq_kernel, module.tq_kernel_reason, 0))
        elif isinstance(module, _LinearPacked):
            extra = module._buffers.get("weight_kernel_scale")  # INT8 weight-only: the kernel's scales
            rows.append(DeployedLayer(name, module.tq_kernel, module.tq_kernel_reason, _bytes(module.weight) + (0 if extra is None else _bytes(extra))))
        elif isinstance(module, _ExpertsPacked):
            for g in module.tq_experts_layout.gemms:
                w, unit = module._parameters[g.weight], module._modules[f"{g.weight}_gemm"]
                extra = module._buffers.get(f"{g.weight}_kernel_scale")  # INT8 weight-only, FP8 grouped: the kernel's scales
                nbytes = _bytes(w) + (0 if extra is None else _bytes(extra))
                rows.append(DeployedLayer(f"{name}.{g.weight}_gemm", unit.tq_kernel, unit.tq_kernel_reason, nbytes))
    return rows
