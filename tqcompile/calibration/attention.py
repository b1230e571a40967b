"""KV-cache quantizers: the keys and values an attention module stores in its cache, fake-quantized.

An attention unit is the attention module itself, converted in place like the other units (a
generated ``FakeQuant<Class>``, `tqcompile.surgery.classes`) with three `TensorQuantizer` children,
``query_quantizer``, ``key_quantizer`` and ``value_quantizer``. Rules set them through
`QuantRule`'s ``query`` / ``key`` / ``value`` slots (`tq.configs.fp8_kv_cache()`); an attention
module none of whose quantizers a config enables is left as it is.

Which tensors: the keys after the rotary embedding and the values, as they enter the cache, which
are what serving engines quantize (vLLM's ``k_scale`` / ``v_scale`` scale the cache writes). How
they are reached without editing the model's code:

- Hugging Face attention (Llama, Qwen3, Mixtral, GPT-OSS, ... any implementation: "sdpa", "eager",
  ...): every such forward hands its new keys and values to ``past_key_values.update(k, v,
  layer_idx)`` when it has a cache and attends to what that returns. The converted forward passes
  a `_CacheTap` as ``past_key_values``: its ``update`` fake-quantizes k and v and hands them on to
  the model's cache (or back, without one). So a cache stores quantized entries, as an FP8 cache
  does, and calibration, evaluation and QAT (``use_cache=False``) see the same tensors.
  llmcompressor reaches the same point by a forward pre-hook that swaps the cache argument;
  replacing the module's class is how tq converts every unit (`tq.calibration.reattach`, pickling,
  undo on failure work unchanged), and keeps the model free of hooks under torch.compile.
- The query (optional: vLLM's ``q_scale``, read by its FP8 attention kernels) after the rotary
  embedding never passes the cache: it goes straight from the forward to the attention function,
  which Hugging Face models look up by name, ``ALL_ATTENTION_FUNCTIONS.get_interface(
  self.config._attn_implementation, eager_attention_forward)``. An attention whose query is
  quantized reads, as ``self.config``, a view of the model's config (`_QueryTapConfig`) naming
  `QUERY_TAP`, a function tq registers in transformers' ``AttentionInterface``: it fake-quantizes
  the query and calls the model's own implementation (the config's, or the model file's
  ``eager_attention_forward``). The model's config and every other module stay as they were, so
  ``set_attn_implementation`` still chooses the kernel. (compressed-tensors reaches the query the
  same way, but switches the whole model's implementation to its function.)
- `nn.MultiheadAttention`: its forward is recomputed by `tqcompile.nn.attention`'s
  `_mha_forward` (the one `tq.convert` uses) with float projections, and q, k and v fake-quantized
  after the head split.

Scaling units: a key or value tensor is (batch, kv_heads, tokens, head_dim). TENSORWISE gives one
scale per layer (``kv_cache_scheme`` strategy "tensor"); per KV head, compressed-tensors' strategy
"attn_head", is a ROWWISE quantizer on the (kv_heads, batch * tokens * head_dim) view of the
tensor, one row per head (``TensorQuantizer(..., unit_dim=1)``). That view, not a new
granularity, keeps every rowwise path as it is: kernels, the static per-unit amax (shape
(kv_heads, 1), as a per-channel weight's), the clipped STE, and export (flattened to one scale per head).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tqcompile.calibration.config import ATTENTION_SLOTS
from tqcompile.calibration.fake_quant import TensorQuantizer
from tqcompile.nn.base import is_converted

__all__ = ["ATTENTION_SLOTS", "KVLayout", "kv_layout", "AttentionQuantizers", "HEAD_DIM", "QUERY_TAP", "register_query_tap"]

# The dim of a (batch, heads, tokens, head_dim) query, key or value that indexes the head.
HEAD_DIM = 1
# The name of tq's query tap in transformers' AttentionInterface (`_query_tap_attention`).
QUERY_TAP = "tq_query_tap"


class KVLayout:
    """What a recognised attention module is: its number of KV heads, how its forward is reached,
    and (Hugging Face) the model file's eager attention function."""

    def __init__(self, kv_heads: int, mixin: type, cache_arg: int | None = None, eager: Callable | None = None):
        self.kv_heads, self.mixin, self.cache_arg, self.eager = kv_heads, mixin, cache_arg, eager


def _hf_cache_arg(cls: type) -> int | None:
    """The positional index of ``past_key_values`` in a Hugging Face attention forward, else None."""
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("past_key_values") - 1 if "past_key_values" in params else None


def kv_layout(module: nn.Module, cls: type | None = None) -> KVLayout | None:
    """The `KVLayout` of an attention module tq can quantize the KV cache of, else None. `cls`:
    the module's own class (before conversion; default its class).

    Hugging Face attention is recognised by structure, as the models define it (no class list):
    an int ``layer_idx`` and ``head_dim``, a config naming ``num_key_value_heads`` (or
    ``num_attention_heads``), and a forward taking ``past_key_values``."""
    cls = type(module) if cls is None else cls
    if is_converted(module):
        return None  # tq.convert's attention quantizes with its training recipe
    if issubclass(cls, nn.MultiheadAttention):
        return KVLayout(module.num_heads, _MultiheadAttentionKV)
    config = getattr(module, "config", None)
    if not (isinstance(getattr(module, "layer_idx", None), int) and isinstance(getattr(module, "head_dim", None), int)):
        return None
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    arg = _hf_cache_arg(cls)
    if not isinstance(heads, int) or arg is None:
        return None
    # The default each model file's forward passes to get_interface: "eager" is no registered name.
    eager = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    return KVLayout(heads, _HFAttentionKV, arg, eager)


class AttentionQuantizers:
    """Mixin of a fake-quantized attention module: it owns ``query_quantizer``, ``key_quantizer``
    and ``value_quantizer`` (`TensorQuantizer`s of roles "query", "key" and "value"), fake-quantizes
    what enters its KV cache and, where enabled, the query it attends with."""

    query_quantizer: TensorQuantizer
    key_quantizer: TensorQuantizer
    value_quantizer: TensorQuantizer
    tq_mixin_first = True
    tq_class_prefix = "FakeQuant"
    tq_kind = "Attention"

    def quantizers(self) -> dict[str, TensorQuantizer]:
        return {s: getattr(self, f"{s}_quantizer") for s in ATTENTION_SLOTS}

    def quantizes_query(self) -> bool:
        # An attention pickled before the query slot existed has no query quantizer.
        q = self._modules.get("query_quantizer")
        return q is not None and q.enabled

    def quantize_query(self, query: torch.Tensor) -> torch.Tensor:
        """The (batch, heads, tokens, head_dim) query fake-quantized (or, while calibrating, recorded)."""
        return self.query_quantizer(query, unit_dim=HEAD_DIM)

    def quantize_qkv(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.quantize_query(query) if self.quantizes_query() else query), *self.quantize_kv(key, value)

    def quantize_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) of shape (batch, kv_heads, tokens, head_dim), each fake-quantized by its
        quantizer (or, while calibrating, recorded and returned unchanged)."""
        return self.key_quantizer(key, unit_dim=HEAD_DIM), self.value_quantizer(value, unit_dim=HEAD_DIM)


class _CacheTap:
    """What a converted Hugging Face attention gets as ``past_key_values``: ``update`` fake-quantizes
    the new keys and values, then stores them in the model's cache (`cache`, or returns them when
    there is none); anything else is the cache's."""

    def __init__(self, attention: AttentionQuantizers, cache: Any):
        self.attention, self.cache = attention, cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        key_states, value_states = self.attention.quantize_kv(key_states, value_states)
        if self.cache is None:
            return key_states, value_states
        return self.cache.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str):
        # Only reached for names this class lacks: a model reading its cache's structure.
        cache = self.__dict__.get("cache")
        if cache is None:
            raise AttributeError(f"the attention's KV cache is None; it has no attribute {name!r}")
        return getattr(cache, name)


class _QueryTapConfig:
    """What a Hugging Face attention whose query is quantized reads as ``self.config``: the model's
    config, except that its attention implementation is `QUERY_TAP`."""

    _attn_implementation = QUERY_TAP

    def __init__(self, config: Any):
        self.tq_model_config = config

    def __getattr__(self, name: str):
        return getattr(self.__dict__["tq_model_config"], name)


def _query_tap_attention(module: nn.Module, query: torch.Tensor, *args, **kwargs):
    """`QUERY_TAP`: the query fake-quantized, then the attention the model's config names."""
    implementation = module.tq_model_config._attn_implementation  # the copy: torch 2.11 read __dict__["config"] as the property
    if implementation == QUERY_TAP:  # a model whose config itself names the tap: no implementation to call
        raise ValueError(f"{type(module).__name__}: the model's attn_implementation is {QUERY_TAP!r}; set it to its own (e.g. 'sdpa')")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, module.tq_eager_attention)
    if attention is None:
        raise ValueError(
            f"{type(module).__name__}: attn_implementation {implementation!r} has no function here (its model file defines no "
            "eager_attention_forward); choose a registered one, e.g. model.set_attn_implementation('sdpa')"
        )
    return attention(module, module.quantize_query(query), *args, **kwargs)


def register_query_tap() -> None:
    """Register `QUERY_TAP` in transformers' ``AttentionInterface`` (idempotent): the name the
    attentions whose query tq quantizes look their attention function up by."""
    from transformers import AttentionInterface

    AttentionInterface.register(QUERY_TAP, _query_tap_attention)


class _HFAttentionKV(AttentionQuantizers):
    """Hugging Face attention: the model's own forward, with the cache argument tapped and, when
    the query is quantized, the attention function (`_QueryTapConfig`)."""

    tq_cache_arg: int  # the positional index of past_key_values (`kv_layout`)
    tq_cache_tap: type = _CacheTap  # what the cache is tapped with (`tq.compress`'s stores FP8 codes)
    tq_eager_attention: Callable | None  # the model file's eager_attention_forward (`kv_layout`)

    # A data descriptor: found before the instance's own ``config`` (the model's), which it wraps.
    # It reads the copy `tq_model_config` (`convert_module` sets it): torch 2.11's Dynamo turned
    # ``self.__dict__["config"]`` back into this property, and recursed (measured, a compiled decode step).
    @property
    def config(self) -> Any:
        config = self.tq_model_config
        return _QueryTapConfig(config) if self.quantizes_query() else config

    @config.setter
    def config(self, value: Any) -> None:
        self.__dict__["config"] = self.__dict__["tq_model_config"] = value

    def forward(self, *args, **kwargs):
        i, tap = self.tq_cache_arg, self.tq_cache_tap
        if len(args) > i:
            args = (*args[:i], tap(self, args[i]), *args[i + 1 :])
        else:
            kwargs["past_key_values"] = tap(self, kwargs.get("past_key_values"))
        return super().forward(*args, **kwargs)


def _float_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: str) -> torch.Tensor:
    return F.linear(x, weight, bias)


class _MultiheadAttentionKV(AttentionQuantizers):
    """`nn.MultiheadAttention` computed by `_mha_forward` with float projections and k, v fake-quantized."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from tqcompile.nn.attention import _mha_forward

        return _mha_forward(
            self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal,
            _float_projection, qkv=self.quantize_qkv,
        )


ATTENTION_MIXINS = (_HFAttentionKV, _MultiheadAttentionKV)
