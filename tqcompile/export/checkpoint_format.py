"""A checkpoint format is a class that owns writing and reading its scheme: `CheckpointFormat`.

`tq.export(format=NAME)` and `tq.load_exported` ask the registered instance (`FORMATS`) everything
that differs between formats; everything else is shared (safetensors I/O, files and locking,
names and placements, the load's prechecks, the amax-for-scale search, the families' payload and
scale rules in `tqcompile.export.families`). A third format is one new subclass and one
`register_format` call (docs/adding_a_checkpoint_format.md).

What a format implements:

- writing: `scheme_of` (a layer's scheme, or an `ExportError` naming the layer and what the format
  holds), `layer_tensors` (the tensors of one layer of that scheme), `quantization_config` (config.json's
  ``quantization_config``), and where needed `extra_files`, `check_targets`;
- reading: `scheme_resolver` (how the checkpoint's config names each layer's scheme, as tq
  quantizers), `check_config`, and where its tensors are not named ``<layer>.<tensor>`` per expert,
  `reading_view` (the checkpoint as the shared loader reads it);
- facts, as class attributes: `NAME`, `QUANT_METHOD`, `CONFIG_FILE` (a file of its own that stands
  in for config.json's ``quantization_config``), `IGNORE_EXPERTS`, where it keeps global scales
  (`WEIGHT_GLOBAL_SCALE`, `INPUT_GLOBAL_SCALE`), and the tensor names a layer may hold (`LAYER_TENSORS`).

Per quantizer family, each format keeps `functools.singledispatch` registries of its own (what scheme
a family has in it, its tensors): a new family registers there, not in a branch.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from tqcompile.export.families import global_scale
from tqcompile.export.scales import GlobalScaleTensor
from tqcompile.export.units import ExportError, ExportUnit, QuantizedWeight, check_not_transposed
from tqcompile.kernels.reference import tensor_scale_inv
from tqcompile.quantizers import Quantizer

__all__ = ["CheckpointFormat", "LayerScheme", "FORMATS", "register_format", "format_for_method", "known_layer_tensors", "input_scale_names"]


@dataclasses.dataclass(frozen=True)
class LayerScheme:
    """The tq quantizers of a checkpoint scheme: weight, input (None: 16-bit activations) and
    whether the input scale is static (calibrated, in the checkpoint) or dynamic."""

    weight_q: Quantizer
    input_q: Quantizer | None
    static_input: bool
    text: str  # the scheme as the checkpoint names it, for messages


class CheckpointFormat(abc.ABC):
    """A checkpoint format: how tq writes a quantized model in it and reads it back."""

    NAME: ClassVar[str]  # what `tq.export(format=...)` takes
    QUANT_METHOD: ClassVar[str]  # config.json's ``quantization_config.quant_method``
    CONFIG_FILE: ClassVar[str | None] = None  # a file beside config.json holding the quantization config, if any
    # How the ignore / exclude list names experts kept in high precision: "per_expert" (each
    # expert's layers) or "module" (the experts module).
    IGNORE_EXPERTS: ClassVar[str]
    WEIGHT_GLOBAL_SCALE: ClassVar[GlobalScaleTensor]
    INPUT_GLOBAL_SCALE: ClassVar[GlobalScaleTensor]
    LAYER_TENSORS: ClassVar[tuple[str, ...]]  # every tensor name a quantized layer may hold

    # --- writing ---------------------------------------------------------------------------
    @abc.abstractmethod
    def scheme_of(self, unit: ExportUnit):
        """The scheme of `unit` in this format (frozen, hashable, with ``describe() -> str``:
        layers group by it), or an `ExportError` naming the layer and what the format holds."""

    @abc.abstractmethod
    def layer_tensors(self, unit: ExportUnit, scheme, qw: QuantizedWeight, out_rows: int, in_features: int) -> dict:
        """{local name: (tensor, RowKind)} of one layer of `scheme` (leading expert dim for experts),
        in the order they are written (`compressed_tensors.RowKind` says how each splits)."""

    @abc.abstractmethod
    def quantization_config(self, groups: dict, ignore: list[str], extra_targets: list[str] = ()) -> dict:
        """config.json's ``quantization_config`` for layers grouped by scheme ({scheme: names}),
        the layers kept in high precision (`ignore`) and quantized layers an engine does not build as
        a linear layer (`extra_targets`)."""

    def extra_files(self, groups: dict, ignore: list[str]) -> dict[str, dict]:
        """{file name: JSON content} written beside config.json (none by default)."""
        return {}

    def tensor_name(self, prefix: str, local: str) -> str:
        """The checkpoint name of a layer's tensor `local` (a `layer_tensors` key) under the layer `prefix`."""
        return f"{prefix}.{local}"

    def check_experts_layout(self, model: nn.Module, units: list[ExportUnit]) -> None:
        """Refuse quantized experts this format cannot lay out, before any scheme is asked: by
        default experts are written per expert as (out, in), so experts stored transposed (GPT-OSS)
        and experts a Hugging Face model saves as one tensor of every expert are refused."""
        from tqcompile.export.checks import check_fused_experts

        for u in units:
            check_not_transposed(u, self.NAME)
        check_fused_experts(model, units)

    def check_targets(self, extra_targets: list[str]) -> None:
        """Refuse quantized layers an engine does not build as a linear layer, if the format cannot name them."""
        return None  # by default the format names them

    def input_scale(self, unit: ExportUnit) -> tuple[str, torch.Tensor] | None:
        """(local name, value) of the layer's static input scale, or None (dynamic or 16-bit
        inputs): the global scale where the input quantizer has one (`INPUT_GLOBAL_SCALE`), else
        the `scale_inv` tq quantizes that input with (`reference.tensor_scale_inv`)."""
        q, amax = unit.input_q, unit.input_amax
        if q is None or amax is None:
            return None
        if q.has_global_scale():
            return self.INPUT_GLOBAL_SCALE.name, self.INPUT_GLOBAL_SCALE.stored(global_scale(q, amax))
        return "input_scale", tensor_scale_inv(amax, q)

    # --- the KV cache (`tqcompile.export.kv_cache`) ---------------------------------------------
    def kv_cache_config(self, qconfig: dict, files: dict[str, dict], q: Quantizer) -> None:
        """Name the KV-cache scheme of `q` in `qconfig` (config.json's quantization_config) and in
        the format's own `files` ({name: content}), in place; `ExportError` where the format holds none."""
        raise ExportError(f"tq.export: format {self.NAME!r} holds no KV-cache scales; use format='compressed-tensors'")

    def kv_cache_tensors(self, q: Quantizer, key_scale: torch.Tensor, value_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """{local name under the attention: tensor} of one attention's KV scales (fp32, `scale_inv`)."""
        raise ExportError(f"tq.export: format {self.NAME!r} holds no KV-cache scales")

    def check_kv_cache_only(self) -> None:
        """`ExportError` where the format cannot hold a model that quantizes only its KV cache."""
        return None  # a format that holds the KV scheme at all holds it alone

    def kv_cache_quantizer(self, qc: dict) -> Quantizer | None:
        """The tq KV quantizer the checkpoint's config names, or None (no KV scheme)."""
        return None

    def weight_global_scale(self, qw: QuantizedWeight, q) -> torch.Tensor:
        """The stored global scale of a weight quantized with `q` (`has_global_scale()`)."""
        return self.WEIGHT_GLOBAL_SCALE.stored(global_scale(q, qw.amax))

    # --- reading ---------------------------------------------------------------------------
    def check_config(self, qc: dict, path: str) -> None:
        """Refuse a ``quantization_config`` of this format that tq cannot load (before any layer)."""
        return None  # by default every layer's scheme is checked as it is resolved

    def reading_view(self, ckpt, model: nn.Module, where: dict) -> tuple[object, dict]:
        """(the checkpoint, the placements) as the shared loader reads them: layers named
        ``<prefix>.<tensor>``, experts per expert. `ckpt` is the `CheckpointFiles`, `where` the
        model's placements (`names.placements`); a format whose layout differs returns views of both."""
        return ckpt, where

    @abc.abstractmethod
    def scheme_resolver(self, qc: dict, model: nn.Module) -> Callable[[str], LayerScheme]:
        """prefix -> the `LayerScheme` of that checkpoint layer, per the checkpoint's
        ``quantization_config`` `qc` (raises `ExportError` naming the layer where tq has no
        quantizer for its scheme)."""


FORMATS: dict[str, CheckpointFormat] = {}


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Make `fmt` a format `tq.export(format=fmt.NAME)` writes and `tq.load_exported` reads."""
    if fmt.NAME in FORMATS:
        raise ValueError(f"register_format: {fmt.NAME!r} is already registered ({FORMATS[fmt.NAME]!r})")
    FORMATS[fmt.NAME] = fmt
    return fmt


def format_for_method(method: object) -> CheckpointFormat | None:
    """The registered format whose config says ``quant_method: method``, or None."""
    return next((f for f in FORMATS.values() if f.QUANT_METHOD == method), None)


def known_layer_tensors() -> tuple[str, ...]:
    """The tensor names any registered format puts under a quantized layer. The loader takes them
    all as the layer's, whatever the checkpoint's format (as it did before formats were classes):
    a tensor tq would drop is refused by `decode.check_layer` where it changes the result."""
    return tuple(dict.fromkeys(name for f in FORMATS.values() for name in f.LAYER_TENSORS))


def input_scale_names() -> tuple[str, ...]:
    """The names an input scale has in any registered format: ``input_scale`` and the formats'
    input global scales. `decode.check_layer` refuses each where the scheme would drop it."""
    return tuple(dict.fromkeys(n for f in FORMATS.values() for n in ("input_scale", f.INPUT_GLOBAL_SCALE.name)))
