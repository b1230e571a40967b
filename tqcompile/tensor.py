"""QuantizedTensor: a traceable wrapper subclass holding quantized payloads and their scales.

Inner tensors (any may be absent, but not both usages):

- rowwise usage: ``_data`` (payload in the logical shape, 4-bit formats packed two a byte along
  the last dim), ``_scale_inv`` (shape ``quantizer.scale_shape(shape)``), ``_amax`` (the
  tensor-level amax, for quantizers that use one);
- columnwise usage: the same of the 2-D transpose ``x.reshape(-1, K).t()``, as a GEMM that
  reduces over the rows needs it (dgrad's weight, wgrad's operands): ``_data_t``,
  ``_scale_inv_t``, ``_amax_t``. Its scales have ``quantizer.columnwise_scale_shape``: flat for
  1-D blocks (MX, NVFP4 1x16, FP8 1x128), so a dynamic token count T never puts a T // block dim,
  which may be 1, in a compiled graph (see `Quantizer.flat_columnwise_scale`).

`GroupedQuantizedTensor` (at the end of this file) holds E matrices, each with its own scales, as
the grouped (MoE) GEMMs read them.

Metadata: the quantizer, the original dtype, the *name* of the amax reduction group (see
`tqcompile.groups` for why a name and not the group), and `rowwise_not_gathered`, the error to
raise where an FSDP2 gather left the rowwise usage unfilled (None otherwise). `t()` of a 2-D tensor swaps the
two usages, since the rowwise usage of ``x.t()`` is the columnwise usage of ``x``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tqcompile import ops
from tqcompile.groups import all_reduce_amax, resolve_group
from tqcompile.quantizers import Granularity, Quantizer

__all__ = ["QuantizedTensor"]  # quantize_usages: for tqcompile.api, not public

aten = torch.ops.aten
_ROWWISE = ("_data", "_scale_inv", "_amax")
_COLUMNWISE = ("_data_t", "_scale_inv_t", "_amax_t")
_INNER = _ROWWISE + _COLUMNWISE


class QuantizedTensor(torch.Tensor):
    """A quantized tensor: payload(s), scales, the quantizer that made them and the amax group.

    Make one with `tq.quantize(x, quantizer, amax_group=..., rowwise=..., columnwise=...)`;
    get a high-precision tensor back with `.dequantize()`. Ops other than the few that parameters
    and FSDP2/DTensor need (detach, clone, `to`, views keeping the last dim, slicing/splitting dim
    0, `t`, `copy_`, `empty_like`) raise an error that names the op.
    """

    _data: torch.Tensor | None
    _scale_inv: torch.Tensor | None
    _amax: torch.Tensor | None
    _data_t: torch.Tensor | None
    _scale_inv_t: torch.Tensor | None
    _amax_t: torch.Tensor | None

    @staticmethod
    def __new__(
        cls, shape, quantizer: Quantizer, orig_dtype: torch.dtype, amax_group_name: str | None = None, *, rowwise_not_gathered=None, **inner
    ):
        ref = inner.get("_data") if inner.get("_data") is not None else inner.get("_data_t")
        if ref is None:
            raise ValueError("QuantizedTensor needs a rowwise (_data) or a columnwise (_data_t) payload")
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=orig_dtype, device=ref.device, requires_grad=False)

    def __init__(
        self,
        shape,
        quantizer: Quantizer,
        orig_dtype: torch.dtype,
        amax_group_name: str | None = None,
        *,
        rowwise_not_gathered: str | None = None,
        **inner,
    ):
        unknown = set(inner) - set(_INNER)
        if unknown:
            raise TypeError(f"QuantizedTensor: unknown inner tensors {sorted(unknown)}; allowed: {_INNER}")
        for name in _INNER:
            setattr(self, name, inner.get(name))
        self.quantizer = quantizer
        self.orig_dtype = orig_dtype
        self.amax_group_name = amax_group_name
        # The error to raise where a GEMM reads the rowwise usage, set by the FSDP2 all-gather that
        # left it unfilled (`tqcompile.distributed.fsdp`), else None. Metadata, so Dynamo guards on it.
        self.rowwise_not_gathered = rowwise_not_gathered

    # --- public accessors ----------------------------------------------------------------
    @property
    def amax_group(self):
        """The ProcessGroup the amax was reduced over (None if it was not reduced)."""
        return resolve_group(self.amax_group_name)

    @property
    def has_rowwise(self) -> bool:
        return self._data is not None

    @property
    def has_columnwise(self) -> bool:
        return self._data_t is not None

    def usage(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(payload, scale_inv, amax) of the rowwise or the columnwise usage, for a GEMM."""
        parts = (self._data_t, self._scale_inv_t, self._amax_t) if columnwise else (self._data, self._scale_inv, self._amax)
        if parts[0] is None:
            raise ValueError(f"{self!r} has no {'columnwise' if columnwise else 'rowwise'} usage; quantize with it")
        return parts

    def keep_usages(self, *, rowwise: bool, columnwise: bool) -> QuantizedTensor:
        """The same tensor holding only the usages asked for (e.g. what backward still needs)."""
        names = (_ROWWISE if rowwise else ()) + (_COLUMNWISE if columnwise else ())
        return self._with(**{n: t for n, t in self._inner().items() if n in names})

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision tensor (`dtype`, default the original dtype) this one stands for."""
        dtype = dtype or self.orig_dtype
        if self._data is not None:
            return ops.dequantize(self._data, self._scale_inv, self._amax, self.quantizer, dtype)
        out = ops.dequantize(self._data_t, self._scale_inv_t, self._amax_t, self.quantizer, dtype)
        return out.t().reshape(self.shape)

    def __repr__(self) -> str:
        usages = "+".join(u for u, present in (("rowwise", self.has_rowwise), ("columnwise", self.has_columnwise)) if present)
        group = f", amax_group={self.amax_group_name!r}" if self.amax_group_name else ""
        return f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.orig_dtype}, {self.quantizer!r}, usages={usages}{group})"

    # --- tracing ---------------------------------------------------------------------------
    def __tensor_flatten__(self):
        meta = (self.quantizer, self.orig_dtype, self.amax_group_name, self.rowwise_not_gathered)
        return [n for n in _INNER if getattr(self, n) is not None], meta

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta, outer_size, outer_stride):
        quantizer, orig_dtype, group_name, not_gathered = meta
        return QuantizedTensor(outer_size, quantizer, orig_dtype, group_name, rowwise_not_gathered=not_gathered, **inner)

    def _stable_hash_for_caching(self) -> str:
        """This tensor's part of AOTAutograd's cache key (torch >= 2.13 calls it for a subclass input).
        Torch's default hashes the opaque objects in a subclass's metadata by their type alone, so
        two tensors that differ only in their quantizer's fields (MXFP6 E2M3 and E3M2 weights: the
        same class, uint8 payloads of one shape) shared one compiled graph: measured, torch 2.13
        and 2.14, the second dequantized with the first's element format from a warm cache. This
        key holds the quantizer's value (its repr: every field) and each inner tensor's metadata."""
        inner = tuple((n, tuple(t.shape), t.stride(), str(t.dtype), str(t.device)) for n, t in self._inner().items())
        meta = (type(self).__qualname__, tuple(self.shape), str(self.orig_dtype), self.requires_grad, repr(self.quantizer))
        key = repr((meta, self.amax_group_name, self.rowwise_not_gathered, inner))
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _inner(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in _INNER if getattr(self, n) is not None}

    def _with(self, shape=None, orig_dtype=None, **inner) -> QuantizedTensor:
        # The same payloads (views, copies): an unfilled rowwise usage stays unfilled where it is kept.
        not_gathered = self.rowwise_not_gathered if "_data" in inner else None
        return type(self)(
            self.shape if shape is None else shape,
            self.quantizer,
            orig_dtype or self.orig_dtype,
            self.amax_group_name,
            rowwise_not_gathered=not_gathered,
            **inner,
        )

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor], **kw) -> QuantizedTensor:
        return self._with(**kw, **{n: fn(t) for n, t in self._inner().items()})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            # tree_leaves: list arguments (torch.cat, torch.stack) hold the QuantizedTensor one level down.
            qt = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, QuantizedTensor))
            raise NotImplementedError(
                f"QuantizedTensor does not support {func} (its {qt.quantizer!r} payload is not a {qt.orig_dtype} "
                f"tensor). Call .dequantize() first and apply {func.__name__} to the high-precision result."
            )
        return handler(func, args, kwargs)


# ---------------------------------------------------------------------------------------------
# Supported aten ops
#
# View ops (detach, t, view, slice) return a new wrapper whose inner tensors are views of the
# input's, without `return_and_correct_aliasing`: with it, AOTAutograd rebuilds an output that is
# a view of a subclass graph input through `as_strided` (pytorch/pytorch#184002, torch 2.13),
# which a quantized payload cannot support. Inner tensors still alias, so in-place updates of a
# payload are seen through every view.
# ---------------------------------------------------------------------------------------------
_HANDLERS: dict[Any, Callable] = {}


def _implements(*funcs):
    def deco(fn):
        for f in funcs:
            _HANDLERS[f] = fn
        return fn

    return deco


@_implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    return args[0]._map(func)


@_implements(aten.clone.default)
def _clone(func, args, kwargs):
    memory_format = kwargs.get("memory_format", torch.preserve_format)
    if memory_format not in (torch.preserve_format, torch.contiguous_format):
        raise ValueError(f"QuantizedTensor.clone supports preserve_format/contiguous_format, got {memory_format}")
    return args[0]._map(torch.clone)


@_implements(aten.empty_like.default)
def _empty_like(func, args, kwargs):
    return args[0]._map(torch.empty_like)


@_implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    self = args[0]
    dtype = kwargs.get("dtype") or self.orig_dtype
    if not dtype.is_floating_point:
        raise TypeError(f"QuantizedTensor.to(dtype={dtype}): the nominal dtype must be floating point")
    device = kwargs.get("device") or self.device
    return self._map(lambda t: t.to(device=device, copy=True), orig_dtype=dtype)


@_implements(aten.t.default, aten.transpose.int)
def _transpose(func, args, kwargs):
    self = args[0]
    if self.dim() != 2 or (func is aten.transpose.int and sorted(d % 2 for d in args[1:3]) != [0, 1]):
        raise NotImplementedError(f"QuantizedTensor supports t()/transpose(0, 1) of 2-D tensors only; got {func} on shape {tuple(self.shape)}")
    inner = self._inner()
    swapped = {b: inner[a] for a, b in zip(_ROWWISE + _COLUMNWISE, _COLUMNWISE + _ROWWISE) if a in inner}
    q, shape = self.quantizer, (self.shape[1], self.shape[0])
    if q.flat_columnwise_scale():  # each usage's scales in its own layout (module docstring)
        if "_scale_inv" in swapped:
            swapped["_scale_inv"] = swapped["_scale_inv"].reshape(q.scale_shape(shape))
        if "_scale_inv_t" in swapped:
            swapped["_scale_inv_t"] = swapped["_scale_inv_t"].reshape(-1)
    # Not `_with`: the rowwise usage of the result is this one's columnwise usage, which an FSDP2
    # gather that left the rowwise usage unfilled did bring (no `rowwise_not_gathered`).
    return QuantizedTensor(shape, q, self.orig_dtype, self.amax_group_name, **swapped)


@_implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    self, size = args[0], args[1]
    new_shape = torch.empty(self.shape, device="meta").view(size).shape
    q = self.quantizer
    gran, axis, _ = q.layout()
    if self.dim() == 0 or len(new_shape) == 0 or new_shape[-1] != self.shape[-1]:
        raise NotImplementedError(f"QuantizedTensor views must keep the last dim: {tuple(self.shape)} -> {tuple(new_shape)}")
    if gran is Granularity.ROWWISE and axis % self.dim() != self.dim() - 1:
        raise NotImplementedError(f"QuantizedTensor with ROWWISE scales along axis {axis} cannot be viewed as {tuple(new_shape)}")
    q.check_shape(new_shape)
    inner = self._inner()
    if "_data" in inner:
        inner["_data"] = inner["_data"].view(q.payload_shape(new_shape))
        inner["_scale_inv"] = inner["_scale_inv"].reshape(q.scale_shape(new_shape))
    return self._with(shape=new_shape, **inner)


def _slice_payload(data, scale, q, dim, start, end, length):
    """Slice elements [start, end) of a payload along `dim` (logical length `length`), keeping the
    scales that go with them; error where the slice would cut a shared scale."""
    fmt = q.element_format()
    group, nbytes = (fmt.pack_elements, fmt.pack_bytes) if dim == data.dim() - 1 else (1, 1)
    if start % group or end % group:
        raise NotImplementedError(f"slice [{start}:{end}] splits a byte of packed {fmt.bits}-bit elements")
    data = data.narrow(dim, start // group * nbytes, (end - start) // group * nbytes)
    if scale.dim():
        n = scale.shape[dim]
        if n != length:
            block = length // n if n > 1 or length == 1 else length
            if start % block or end % block:
                raise NotImplementedError(
                    f"slice [{start}:{end}] of dim {dim} cuts through scaling units of {block} elements; "
                    f"slice at multiples of {block} or dequantize first"
                )
            start, end = start // block, end // block
        scale = scale.narrow(dim, start, end - start)
    return data, scale


@_implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    self, dim, start, end, step = (list(args) + [0, None, None, 1][len(args) - 1 :])[:5]
    if self.dim() == 0 or dim % self.dim() != 0 or step != 1:
        raise NotImplementedError(f"QuantizedTensor supports slicing dim 0 with step 1; got dim={dim}, step={step}")
    rows = range(self.shape[0])[slice(start, end)]
    start, end = rows.start, rows.start + len(rows)
    inner = self._inner()
    if "_data" in inner:
        inner["_data"], inner["_scale_inv"] = _slice_payload(inner["_data"], inner["_scale_inv"], self.quantizer, 0, start, end, self.shape[0])
    if "_data_t" in inner:
        # The columnwise payload is (K, R) with R = numel / K: dim 0 of a 1-D tensor is its K,
        # otherwise a row of dim 0 is `inner_rows` consecutive columns.
        if self.dim() == 1:
            dim_t, lo, hi, length = 0, start, end, self.shape[0]
        else:
            inner_rows = self.numel() // (self.shape[0] * self.shape[-1]) if self.numel() else 0
            dim_t, lo, hi, length = 1, start * inner_rows, end * inner_rows, self.shape[0] * inner_rows
        q, scale_t = self.quantizer, inner["_scale_inv_t"]
        if q.flat_columnwise_scale():  # sliced as (K, R // block), kept flat (a copy where not contiguous)
            scale_t = scale_t.view(q.scale_shape(q.logical_shape(inner["_data_t"].shape)))
        inner["_data_t"], scale_t = _slice_payload(inner["_data_t"], scale_t, q, dim_t, lo, hi, length)
        inner["_scale_inv_t"] = scale_t.reshape(-1) if q.flat_columnwise_scale() else scale_t
    return self._with(shape=(end - start,) + tuple(self.shape[1:]), **inner)


@_implements(aten.split.Tensor, aten.split_with_sizes.default)
def _split(func, args, kwargs):
    self, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if isinstance(sizes, int):
        sizes = [min(sizes, self.shape[dim] - i) for i in range(0, self.shape[dim], sizes)]
    bounds, offset = [], 0
    for s in sizes:
        bounds.append((offset, offset + s))
        offset += s
    return [_slice(aten.slice.Tensor, (self, dim, a, b), {}) for a, b in bounds]


@_implements(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, QuantizedTensor):
        raise NotImplementedError("copying a QuantizedTensor into a plain tensor: use dst.copy_(src.dequantize())")
    if dst.shape != src.shape:
        raise ValueError(f"copy_: shape mismatch, destination {tuple(dst.shape)} vs source {tuple(src.shape)}")
    if not isinstance(src, QuantizedTensor):
        # Quantized as `tq.quantize(src, dst.quantizer, amax_group=..., rowwise=..., columnwise=...)` would: its
        # checks hold already (src has dst's shape, which dst's quantizer took, and dst's dtype after the cast).
        x = src.to(dst.orig_dtype) if src.dtype != dst.orig_dtype else src
        x_t = x.reshape(x.shape[:-1].numel(), x.shape[-1]).t() if dst.has_columnwise else None
        src = quantize_usages(
            x, x_t, dst.quantizer, rowwise=dst.has_rowwise, columnwise=dst.has_columnwise, seed=None, group_name=dst.amax_group_name
        )
    if src.quantizer != dst.quantizer or set(src._inner()) != set(dst._inner()):
        raise ValueError(
            f"copy_: source {src!r} does not match destination {dst!r}; quantizer and usages must be equal"
        )
    for name, t in dst._inner().items():
        t.copy_(getattr(src, name))
    return dst


@_implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    # FSDP2 views the unsharded parameter its all-gather hook returns with as_strided(self, size,
    # contiguous strides, 0): the identity, the only as_strided a payload can serve.
    self, size, stride = args[0], tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    contiguous = torch.empty(self.shape, device="meta").stride()
    if size != tuple(self.shape) or stride != contiguous or offset not in (0, None):
        raise NotImplementedError(
            f"QuantizedTensor supports as_strided only as the identity (size {tuple(self.shape)}, strides {contiguous}, "
            f"offset 0); got size {size}, strides {stride}, offset {offset}"
        )
    return self._map(lambda t: t.view(t.shape))


@_implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    # Asked by torch.distributed.checkpoint before it copies a tensor.
    return all(t.is_pinned() for t in args[0]._inner().values())


def quantize_usages(
    x: torch.Tensor,
    x_t: torch.Tensor | None,
    q: Quantizer,
    *,
    rowwise: bool,
    columnwise: bool,
    seed: torch.Tensor | None,
    group_name: str | None,
    amax_history: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> QuantizedTensor:
    """The kernels behind `tq.quantize`, once its arguments are checked: quantize the usages of `x`
    asked for (the columnwise one from `x_t`, x's 2-D transpose) into a QuantizedTensor.

    It lives here, below `tqcompile.api`, because `copy_` of a plain tensor into a QuantizedTensor
    quantizes the same way. `amax`: a static amax (the kernels scale with it; only a tensor-level
    one is recorded); otherwise tensor-level amaxes are computed, MAX-reduced over `group_name`
    and, with `amax_history`, replaced by delayed scaling's. `seed` is drawn when the quantizer
    needs one and none is given."""
    if seed is None and q.needs_seed():
        seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, device=x.device)
    if amax is not None:
        tensor_amax = amax if q.uses_tensor_amax() else None
        return _usages(x, x_t, q, rowwise, columnwise, (amax, amax), (tensor_amax, tensor_amax), seed, group_name)
    amax_t = None
    if q.uses_tensor_amax():
        amax = ops.amax(x, q)
        if columnwise:
            # A transform along the last dim makes the columnwise amax differ from the rowwise one.
            amax_t = ops.amax(x_t, q) if q.hadamard_transformed() else amax
        if group_name is not None:
            if amax_t is not None and amax_t is not amax:
                amax, amax_t = all_reduce_amax(torch.stack((amax, amax_t)), group_name).unbind()
            else:
                amax = all_reduce_amax(amax, group_name)
                amax_t = amax if columnwise else None
        if amax_history is not None:
            amax = ops.amax_history_update(amax_history, amax)
            amax_t = amax if columnwise else None
    return _usages(x, x_t, q, rowwise, columnwise, (amax, amax_t), (amax, amax_t), seed, group_name)


def _usages(x, x_t, q: Quantizer, rowwise: bool, columnwise: bool, amaxes, recorded, seed, group_name) -> QuantizedTensor:
    """Quantize the requested usages of `x` (columnwise from `x_t`) with the kernel amaxes `amaxes`
    (rowwise, columnwise) and build the QuantizedTensor recording the amaxes `recorded`."""
    inner = {}
    if rowwise:
        inner["_data"], inner["_scale_inv"] = ops.quantize(x, q, amaxes[0], seed)
        inner["_amax"] = recorded[0]
    if columnwise:
        inner["_data_t"], inner["_scale_inv_t"] = ops.quantize_columnwise(x_t, q, amaxes[1], seed)
        inner["_amax_t"] = recorded[1]
    inner = {k: v for k, v in inner.items() if v is not None}
    return QuantizedTensor(x.shape, q, x.dtype, group_name, **inner)


_GROUPED_OPS = (aten.detach.default, aten.alias.default, aten.clone.default, aten.as_strided.default, aten.is_pinned.default)


class GroupedQuantizedTensor(QuantizedTensor):
    """(E, R, C): E matrices each quantized with its own scales, as the grouped (MoE) GEMMs read them
    (`tqcompile.ops.grouped_gemm`'s weight layout). The rowwise usage is the (E*R, C) grouped operand,
    the columnwise usage that of the per-matrix transposes, (E*C, R); ``transpose(1, 2)`` swaps the
    two. FSDP2's quantized all-gather of expert weights makes them (`tqcompile.distributed.fsdp_experts`)
    and only `tq.nn.grouped_linear` reads them: detach, alias, clone, the identity `as_strided` FSDP2
    applies, and ``transpose(1, 2)`` are the ops they support; any other raises, naming it."""

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta, outer_size, outer_stride):
        quantizer, orig_dtype, group_name, not_gathered = meta
        return GroupedQuantizedTensor(outer_size, quantizer, orig_dtype, group_name, rowwise_not_gathered=not_gathered, **inner)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError(
            f"{self!r} holds per-expert grouped operands, read by tq.nn.grouped_linear only; "
            "dequantize the high-precision weight it was gathered from instead"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        self = args[0]
        if func in _GROUPED_OPS:  # what FSDP2 and parameters do to it: the 2-D handlers serve as they are
            return _HANDLERS[func](func, args, kwargs or {})
        if func is aten.transpose.int and sorted(d % 3 for d in args[1:3]) == [1, 2]:
            inner = self._inner()
            swapped = {b: inner[a] for a, b in zip(_ROWWISE + _COLUMNWISE, _COLUMNWISE + _ROWWISE) if a in inner}
            shape = (self.shape[0], self.shape[2], self.shape[1])
            return GroupedQuantizedTensor(shape, self.quantizer, self.orig_dtype, self.amax_group_name, **swapped)
        raise NotImplementedError(
            f"GroupedQuantizedTensor does not support {func} (it holds {self.quantizer!r} payloads of "
            f"{self.shape[0]} experts); only detach, alias, clone, as_strided (the identity) and transpose(1, 2)"
        )
