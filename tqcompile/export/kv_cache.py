"""KV-cache scales in a checkpoint: what `tq.export` writes for the attention modules whose KV
cache a calibrated model quantizes (`tqcompile.calibration.attention`), and what `tq.load_exported`
reads back.

Both formats write, per attention module, ``<attention>.k_scale`` and ``<attention>.v_scale``:
the dequantization multipliers the engine writes its FP8 cache with (``cache = fp8(k / k_scale)``),
which is tq's ``scale_inv = amax / 448`` as it is (`reference.tensor_scale_inv`). vLLM maps
``<attention>.k_scale`` onto its ``<attention>.attn.k_scale`` (``maybe_remap_kv_scale_name``).

============================  ==============================================  =====================================
                              compressed-tensors                              ModelOpt
============================  ==============================================  =====================================
config                        ``kv_cache_scheme``: num_bits 8, type float,    ``kv_cache_quant_algo: "FP8"``
                              symmetric, dynamic false, strategy "tensor"
                              or "attn_head"
per layer (TENSORWISE)        fp32 (1,)                                       fp32 () (vLLM's loader takes one scalar)
per KV head (ROWWISE)         fp32 (kv_heads, 1, 1), as llmcompressor         not held: vLLM's ModelOpt loader takes
                              writes it; vLLM flattens it                     one scale per layer
============================  ==============================================  =====================================

One scheme for the model: every quantized attention with the same key and value quantizer.

A quantized query (``tq.configs.fp8_kv_cache(query=True)``) adds ``<attention>.q_scale``, fp32
(1,) in compressed-tensors (as llmcompressor writes an attention's input scale) and () in
ModelOpt: one per layer in both, as vLLM's attention takes it (a single float; its FP8 attention
kernels read it, vLLM maps it onto ``<attention>.attn.q_scale`` and otherwise uses ``k_scale``).
Every quantized attention or none quantizes its query.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tqcompile.calibration.attention import AttentionQuantizers
from tqcompile.export.units import ExportError
from tqcompile.formats import Format
from tqcompile.kernels.reference import tensor_scale_inv
from tqcompile.quantizers import Float8Quantizer, Granularity, Quantizer
from tqcompile.surgery.names import canonical_modules

__all__ = [
    "KVCacheUnit", "kv_cache_units", "KV_TENSORS", "QUERY_TENSOR", "kv_scale", "KV_WORKS", "per_head", "kv_quantizer_for",
    "QUERY_QUANTIZER",
]

# The tensors an attention module holds in a checkpoint, by slot.
KV_TENSORS = {"key": "k_scale", "value": "v_scale"}
QUERY_TENSOR = "q_scale"
KV_WORKS = (
    "KV caches export as FP8 E4M3 (Float8Quantizer) with a static scale per layer (TENSORWISE) or, in compressed-tensors, "
    "per KV head (ROWWISE), the same quantizer for keys and values in every attention (tq.configs.fp8_kv_cache()); "
    "a query quantized in every attention or in none, per layer"
)
# The one query quantizer engines load: FP8 E4M3, one static scale per layer (vLLM's q_scale).
QUERY_QUANTIZER = Float8Quantizer(Format.E4M3)


@dataclasses.dataclass(frozen=True)
class KVCacheUnit:
    """One attention module whose KV cache the model quantizes: its canonical name, its key's
    and value's calibrated amaxes ((), or (kv_heads, 1)), and its query's (()) or None."""

    name: str
    key_amax: torch.Tensor
    value_amax: torch.Tensor
    query_amax: torch.Tensor | None = None


def kv_cache_units(model: nn.Module) -> tuple[Quantizer | None, list[KVCacheUnit]]:
    """(the one KV quantizer, the attention modules using it) of `model`; (None, []) when no KV
    cache is quantized. Raises `ExportError` for what no checkpoint format holds (`KV_WORKS`)."""
    found: dict[Quantizer, list[str]] = {}
    units = []
    for name, module in canonical_modules(model):
        if not isinstance(module, AttentionQuantizers):
            continue
        k, v = module.key_quantizer, module.value_quantizer
        if k.quantizer is None and v.quantizer is None:
            continue
        if k.quantizer != v.quantizer:
            raise ExportError(f"tq.export: attention {name!r} quantizes keys with {k.quantizer!r} and values with {v.quantizer!r}; {KV_WORKS}")
        q = k.quantizer
        if q not in (kv_quantizer_for(False), kv_quantizer_for(True)):  # what the engines' FP8 caches are
            raise ExportError(f"tq.export: attention {name!r} quantizes its KV cache with {q!r}; {KV_WORKS}")
        if k.amax is None or v.amax is None:
            raise ExportError(f"tq.export: attention {name!r} has no calibrated KV amax; calibrate the model (tq.calibrate) first")
        found.setdefault(q, []).append(name)
        units.append(KVCacheUnit(name, k.amax.detach(), v.amax.detach(), _query_amax(name, module)))
    if len(found) > 1:
        shown = "; ".join(f"{q!r}: {names[0]}{' and more' if len(names) > 1 else ''}" for q, names in found.items())
        raise ExportError(f"tq.export: the model's attentions quantize their KV caches differently ({shown}); {KV_WORKS}")
    with_query = [u.name for u in units if u.query_amax is not None]
    if with_query and len(with_query) != len(units):
        without = next(u.name for u in units if u.query_amax is None)
        raise ExportError(f"tq.export: attention {with_query[0]!r} quantizes its query and {without!r} does not; {KV_WORKS}")
    return (next(iter(found)) if found else None), units


def _query_amax(name: str, module: nn.Module) -> torch.Tensor | None:
    """The attention's calibrated query amax, None where its query is not quantized."""
    t = module._modules.get("query_quantizer")
    if t is None or t.quantizer is None:
        return None
    if t.quantizer != QUERY_QUANTIZER:
        raise ExportError(f"tq.export: attention {name!r} quantizes its query with {t.quantizer!r}; {KV_WORKS}")
    if t.amax is None:
        raise ExportError(f"tq.export: attention {name!r} has no calibrated query amax; calibrate the model (tq.calibrate) first")
    return t.amax.detach()


def kv_scale(amax: torch.Tensor, q: Quantizer) -> torch.Tensor:
    """The engine's dequantization multiplier of a calibrated KV amax: tq's ``scale_inv``, fp32."""
    return tensor_scale_inv(amax, q).float()


def per_head(q: Quantizer) -> bool:
    """Whether `q` keeps one KV scale per head (ROWWISE; see `tqcompile.calibration.attention`)."""
    return q.layout()[0] is Granularity.ROWWISE


def kv_quantizer_for(per_head_scales: bool) -> Float8Quantizer:
    """The tq quantizer of an FP8 E4M3 KV cache scheme with static scales per layer or per head."""
    return Float8Quantizer(Format.E4M3, Granularity.ROWWISE if per_head_scales else Granularity.TENSORWISE)
