"""The deployment form of a quantized KV cache: FP8 codes and the calibrated scales, in Hugging
Face's cache classes.

A calibrated model with a KV rule (`tq.configs.fp8_kv_cache()`) fake-quantizes the keys and
values entering its cache (`tqcompile.calibration.attention`): the cache holds their dequantized
values in the model's dtype, two or four bytes an element. After `tq.compress` the cache holds the
FP8 E4M3 codes themselves (one byte) and dequantizes them on every read with the calibrated
per-layer or per-head scales, the same ``quantize`` and ``dequantize`` ops on the same codes: the
attention sees bit for bit what the calibrated model's saw.

Two layer classes, one per Hugging Face layer they replace:

- `FP8DynamicLayer` (a `DynamicLayer`): codes appended by concatenation, as ``generate``'s default
  cache grows;
- `FP8StaticLayer` (a `StaticLayer`): codes preallocated for ``max_cache_len`` and written in
  place, for ``cache_implementation="static"`` and ``torch.compile(fullgraph=True)`` of the decode
  step.

How they get into the cache: a compressed attention (``Packed<Attention>``) hands its new keys
and values to its layer of whatever cache the model was given; where that layer is a fresh float
`DynamicLayer` or `StaticLayer` (what ``generate`` and users create), it puts the FP8 layer in its
place first. So ``model.generate(...)`` stores FP8 with no argument, and `quantized_kv_cache`
builds such a cache ahead of time (to pass as ``past_key_values``). Any other layer (sliding
window, offloaded, one already holding float entries) keeps its own storage and gets the
fake-quantized values, as the calibrated model's did: right numbers, no saving.

Per-head scales: the calibrated quantizer is ROWWISE on the (kv_heads, batch * tokens * head_dim)
view (`tqcompile.calibration.attention`). The cache keeps its (batch, kv_heads, tokens, head_dim)
layout and quantizes the (batch * kv_heads, tokens * head_dim) view instead, each row with its
head's amax: the same scale for every element, hence the same codes, and a view that needs no
copy to read.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, StaticCache, StaticLayer

from tqcompile import ops
from tqcompile.api import quantize
from tqcompile.calibration.attention import HEAD_DIM, AttentionQuantizers, _CacheTap, _HFAttentionKV
from tqcompile.calibration.modules import base_class, register_mixin
from tqcompile.deploy.packed import PackedModule
from tqcompile.kernels.reference import tensor_scale_inv
from tqcompile.quantizers import Granularity, Quantizer
from tqcompile.surgery.classes import generated_class

__all__ = ["FP8DynamicLayer", "FP8StaticLayer", "KVCodes", "quantized_kv_cache", "kv_cache_bytes"]


class KVCodes:
    """How one attention's keys and values become cache codes and back: its KV quantizer and the
    calibrated amaxes (a scalar, or (kv_heads, 1) per head)."""

    def __init__(self, quantizer: Quantizer, key_amax: torch.Tensor, value_amax: torch.Tensor):
        self.quantizer, self.key_amax, self.value_amax = quantizer, key_amax, value_amax
        self.per_head = quantizer.layout()[0] is not Granularity.TENSORWISE

    @classmethod
    def of(cls, attention: AttentionQuantizers) -> KVCodes:
        return cls(attention.key_quantizer.quantizer, attention.key_quantizer.amax, attention.value_quantizer.amax)

    def _view(self, x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x in the quantizer's layout, its amax): one row per (batch, head) for per-head scales."""
        if not self.per_head:
            return x, amax
        b, h = x.shape[0], x.shape[HEAD_DIM]
        return x.reshape(b * h, -1), amax.reshape(1, h).expand(b, h).reshape(b * h, 1)

    def encode(self, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """The FP8 codes of `x` (batch, kv_heads, tokens, head_dim), in its shape."""
        flat, rows_amax = self._view(x, amax)
        return quantize(flat, self.quantizer, amax=rows_amax)._data.view(x.shape)

    def decode(self, codes: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The `dtype` values of cache codes: what the calibrated model's fake quantization returns."""
        flat, rows_amax = self._view(codes, amax)
        out = ops.dequantize(flat, tensor_scale_inv(rows_amax, self.quantizer), None, self.quantizer, dtype)
        return out.view(codes.shape)


class FP8DynamicLayer(DynamicLayer):
    """A `DynamicLayer` holding FP8 codes (``keys`` and ``values``: float8_e4m3fn) that `update`
    appends to and dequantizes on read (``dtype``: the model's)."""

    def __init__(self, codes: KVCodes):
        super().__init__()
        self.codes = codes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        fp8 = self.codes.quantizer.format.codec.storage_dtype
        self.keys = torch.tensor([], dtype=fp8, device=self.device)
        self.values = torch.tensor([], dtype=fp8, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the codes of the new keys and values; return the whole cache, dequantized."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.codes
        new_keys, new_values = c.encode(key_states, c.key_amax), c.encode(value_states, c.value_amax)
        self.keys = new_keys if self.keys.numel() == 0 else torch.cat([self.keys, new_keys], dim=-2)
        self.values = new_values if self.values.numel() == 0 else torch.cat([self.values, new_values], dim=-2)
        return c.decode(self.keys, c.key_amax, self.dtype), c.decode(self.values, c.value_amax, self.dtype)


class FP8StaticLayer(StaticLayer):
    """A `StaticLayer` holding FP8 codes for ``max_cache_len`` tokens, written in place (static
    addresses: it compiles) and dequantized on read."""

    def __init__(self, codes: KVCodes, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.codes = codes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # StaticLayer's, with the buffers in FP8 (the model's dtype kept for reading).
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        fp8 = self.codes.quantizer.format.codec.storage_dtype
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros((*shape, self.k_head_dim), dtype=fp8, device=self.device)
        self.values = torch.zeros((*shape, self.v_head_dim), dtype=fp8, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():  # as StaticLayer: fixed addresses, no recompile per step
            for t in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the codes of the new keys and values at the next positions; return the whole cache, dequantized."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.codes
        position = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])
        # index_copy_ has no CPU kernel for float8: write the same bytes through uint8 views.
        self.keys.view(torch.uint8).index_copy_(2, position, c.encode(key_states, c.key_amax).view(torch.uint8))
        self.values.view(torch.uint8).index_copy_(2, position, c.encode(value_states, c.value_amax).view(torch.uint8))
        return c.decode(self.keys, c.key_amax, self.dtype), c.decode(self.values, c.value_amax, self.dtype)


FP8_LAYERS = (FP8DynamicLayer, FP8StaticLayer)


def _fp8_layer(cache: Cache, index: int, attention: AttentionQuantizers) -> CacheLayerMixin | None:
    """The FP8 layer of `cache` at `index`, put in place of a fresh float one; None where the
    cache's layer is another kind (it then stores the fake-quantized values)."""
    layers = cache.layers
    if index >= len(layers) and cache.layer_class_to_replicate is DynamicLayer:
        while len(layers) <= index:  # a DynamicCache without a config grows on update
            layers.append(DynamicLayer())
    if index >= len(layers):
        return None
    layer = layers[index]
    if isinstance(layer, FP8_LAYERS):
        return layer
    # Exact classes: their subclasses (sliding windows, offloading, indexers) store differently.
    if layer.is_initialized or type(layer) not in (DynamicLayer, StaticLayer):
        return None
    codes = KVCodes.of(attention)
    layers[index] = FP8DynamicLayer(codes) if type(layer) is DynamicLayer else FP8StaticLayer(codes, layer.max_cache_len)
    return layers[index]


class _FP8CacheTap(_CacheTap):
    """A compressed attention's ``past_key_values``: the new keys and values go to its FP8 layer."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        cache = self.cache
        if cache is None or _fp8_layer(cache, self.attention.layer_idx, self.attention) is None:
            return super().update(key_states, value_states, *args, **kwargs)
        return cache.update(key_states, value_states, *args, **kwargs)


@register_mixin
class _HFAttentionKVPacked(PackedModule, _HFAttentionKV):
    """A compressed Hugging Face attention: its KV cache holds FP8 codes (`_FP8CacheTap`)."""

    tq_cache_tap = _FP8CacheTap
    tq_kernel = "fp8 kv cache"
    tq_kernel_reason = "keys and values stored as FP8 codes with the calibrated scales, dequantized on read"


def pack_attention(module: nn.Module) -> None:
    """Give a fake-quantized Hugging Face attention (KV quantizers calibrated) its FP8 cache."""
    module.__class__ = generated_class(base_class(module), _HFAttentionKVPacked)


def _kv_attentions(model: nn.Module) -> dict[int, AttentionQuantizers]:
    found = {m.layer_idx: m for m in model.modules() if isinstance(m, _HFAttentionKVPacked)}
    if not found:
        raise ValueError(
            "tq.deploy.quantized_kv_cache: the model has no compressed attention with a quantized KV cache; "
            "calibrate it with a KV rule (tq.configs.fp8_kv_cache()), then tq.compress it"
        )
    return found


def quantized_kv_cache(model: nn.Module, *, max_cache_len: int | None = None) -> Cache:
    """A Hugging Face cache for `model` (compressed, `tq.compress`) whose quantized attentions hold
    FP8 codes: a `DynamicCache`, or a `StaticCache` of `max_cache_len` tokens. ``generate`` makes
    such a cache on its own; pass this one as ``past_key_values`` to hold it yourself.

    Example:
        >>> cache = tq.deploy.quantized_kv_cache(model, max_cache_len=64)
        >>> model.generate(ids, past_key_values=cache, max_new_tokens=16)
    """
    attentions = _kv_attentions(model)
    config = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=config) if max_cache_len is None else StaticCache(config=config, max_cache_len=max_cache_len)
    for index, attention in attentions.items():
        _fp8_layer(cache, index, attention)
    return cache


def kv_cache_bytes(cache: Cache) -> int:
    """The bytes a cache's keys and values hold in memory (what grows with the tokens; the scales
    are the model's)."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
