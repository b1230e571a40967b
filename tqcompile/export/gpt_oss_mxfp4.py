"""GPT-OSS's own MXFP4 checkpoint format (``quant_method: "mxfp4"``), as OpenAI released gpt-oss-20b
and gpt-oss-120b and as vLLM and transformers read them: `GptOssMxfp4`.

Only the MoE experts are quantized, MXFP4 weights with 16-bit activations; everything else
(attention, router, embeddings, head, norms, the experts' biases) is stored as it is. Per experts
GEMM ``<experts>.gate_up_proj`` / ``<experts>.down_proj`` (the model holds them (E, in, out)):

=========================  ====================================================================
tensor                     content
=========================  ====================================================================
``<gemm>_blocks``          uint8 (E, out, in / 32, 16): two E2M1 codes a byte, element 2i in the
                           low nibble, in the GEMM view (E, out, in); gate/up stay interleaved
``<gemm>_scales``          uint8 (E, out, in / 32): E8M0 exponent bytes (value 2^(s - 127))
=========================  ====================================================================

That is tq's MX E2M1 payload and scales (`MXQuantizer(Format.E2M1)`) byte for byte, only named and
shaped differently, so the checkpoint dequantizes to exactly the weights tq's model computed with
(transformers' `convert_moe_packed_tensors` is ``lut[code] * 2^(s - 127)``, then transposed back).
config.json's ``quantization_config`` is ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.

vLLM (0.32, `GptOssMxfp4Config`) takes the format for ``model_type: gpt_oss`` only and quantizes
every experts module (it reads no exclusion list for them), so the export refuses a model whose
experts are not all MXFP4, or that quantizes anything besides them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from tqcompile.export.checkpoint_format import CheckpointFormat, LayerScheme, register_format
from tqcompile.export.files import CheckpointFiles
from tqcompile.export.names import Placement, is_hf_model
from tqcompile.export.safetensors_io import dtype_name, load_tensor
from tqcompile.export.scales import GlobalScaleTensor
from tqcompile.export.units import ExportError, ExportUnit, QuantizedWeight
from tqcompile.formats import Format
from tqcompile.quantizers import MXQuantizer, Quantizer
from tqcompile.surgery.names import canonical_modules, unwrap

__all__ = ["GptOssMxfp4", "GPT_OSS_MXFP4", "Scheme"]

_BLOCK = 32  # elements a scale
_BYTES = _BLOCK // 2  # bytes a block: two E2M1 codes a byte


@dataclasses.dataclass(frozen=True)
class Scheme:
    def describe(self) -> str:
        return "mxfp4 (GPT-OSS: E2M1 weights, E8M0 scales a 32-block; 16-bit activations)"


@functools.singledispatch
def _is_mxfp4(q: Quantizer) -> bool:
    """Whether `q` quantizes as GPT-OSS's experts are stored: E2M1 in 32-blocks under E8M0 scales."""
    return False


@_is_mxfp4.register(MXQuantizer)
def _(q):
    return q.format is Format.E2M1


class GptOssMxfp4(CheckpointFormat):
    """GPT-OSS's MXFP4 checkpoints: the experts in ``*_blocks`` / ``*_scales`` (module docstring)."""

    NAME = "mxfp4"
    QUANT_METHOD = "mxfp4"
    IGNORE_EXPERTS = "module"  # transformers matches ``modules_to_not_convert`` against "<...>.mlp.experts"
    # No global scales in this format; named as compressed-tensors names them, for the loader's checks.
    WEIGHT_GLOBAL_SCALE = GlobalScaleTensor("weight_global_scale", reciprocal=False)
    INPUT_GLOBAL_SCALE = GlobalScaleTensor("input_global_scale", reciprocal=False)
    LAYER_TENSORS = ("blocks", "scales")
    WORKS = (
        "GPT-OSS's mxfp4 format holds a gpt_oss model's MoE experts, every one, with MXFP4 weights (MXQuantizer(Format.E2M1)) "
        "and 16-bit activations, and nothing else quantized: tq.configs.mxfp4_weight_only(experts_only=True); for other "
        "schemes use format='compressed-tensors' or 'modelopt'"
    )

    def __repr__(self) -> str:
        return "GptOssMxfp4()"

    # --- writing ---------------------------------------------------------------------------
    def check_experts_layout(self, model: nn.Module, units: list[ExportUnit]) -> None:
        """A gpt_oss model whose quantized layers are exactly its experts, all of them."""
        model_type = getattr(getattr(unwrap(model), "config", None), "model_type", None) if is_hf_model(model) else None
        if model_type != "gpt_oss":
            raise ExportError(
                f"tq.export: format='mxfp4' is GPT-OSS's own checkpoint format, which vLLM and transformers read for model_type "
                f"'gpt_oss' only; this model is {model_type or type(unwrap(model)).__name__!r}: use format='compressed-tensors' "
                "(MXFP4 as mxfp4-pack-quantized)"
            )
        for u in units:
            if not (u.experts and u.transposed):
                raise ExportError(
                    f"tq.export: layer {u.name!r} is quantized, but GPT-OSS's mxfp4 format quantizes only the MoE experts (vLLM "
                    f"builds every other layer in 16 bits); keep it in high precision. {self.WORKS}"
                )
        from tqcompile.nn.experts import experts_layout

        quantized = {u.name for u in units}
        for name, module in canonical_modules(model):
            layout = experts_layout(module)
            for g in () if layout is None else layout.gemms:
                if f"{name}.{g.weight}_gemm" not in quantized:
                    raise ExportError(
                        f"tq.export: experts GEMM {name}.{g.weight} is kept in high precision, but vLLM's GPT-OSS mxfp4 loader "
                        f"quantizes every experts module (it reads no exclusion list for them). {self.WORKS}"
                    )

    def scheme_of(self, unit: ExportUnit) -> Scheme:
        """The one scheme, or an `ExportError` naming the layer and what exports."""
        if not _is_mxfp4(unit.weight_q) or unit.input_q is not None:
            raise ExportError(
                f"tq.export: layer {unit.name!r} (weight {unit.weight_q!r}, input {unit.input_q!r}) has no GPT-OSS mxfp4 form. {self.WORKS}"
            )
        return Scheme()

    def layer_tensors(self, unit: ExportUnit, scheme: Scheme, qw: QuantizedWeight, out_rows: int, in_features: int) -> dict:
        """``blocks`` and ``scales`` of one experts GEMM (module docstring)."""
        experts = qw.data.shape[0]
        blocks = qw.data.reshape(experts, out_rows, in_features // _BLOCK, _BYTES)
        return {"blocks": (blocks, "rows"), "scales": (qw.scale_inv.view(torch.uint8), "rows")}

    def tensor_name(self, prefix: str, local: str) -> str:
        return f"{prefix}_{local}"  # "model.layers.0.mlp.experts.gate_up_proj_blocks"

    def quantization_config(self, groups: dict, ignore: list[str], extra_targets: list[str] = ()) -> dict:
        """``{"quant_method": "mxfp4", "modules_to_not_convert": ignore}``, as gpt-oss checkpoints hold it."""
        return {"quant_method": self.QUANT_METHOD, "modules_to_not_convert": sorted(ignore)}

    def kv_cache_config(self, qconfig: dict, files: dict[str, dict], q: Quantizer) -> None:
        raise ExportError(
            "tq.export: the model quantizes its KV cache, but GPT-OSS's mxfp4 format holds no KV-cache scales (vLLM's GPT-OSS "
            "MXFP4 config reads none; with kv_cache_dtype='fp8' it runs with scales 1.0): calibrate without "
            "tq.configs.fp8_kv_cache() for this format, or keep the experts in 16 bits and use format='compressed-tensors'"
        )

    # --- reading ---------------------------------------------------------------------------
    def scheme_resolver(self, qc: dict, model: nn.Module) -> Callable[[str], LayerScheme]:
        scheme = LayerScheme(MXQuantizer(Format.E2M1), None, False, "mxfp4 (GPT-OSS)")
        return lambda prefix: scheme

    def reading_view(self, ckpt, model: nn.Module, where: dict) -> tuple[object, dict]:
        """Each ``<gemm>_blocks`` / ``<gemm>_scales`` pair read as per-expert layers ``<gemm>.<e>``
        holding ``weight_packed`` (out, in / 2) and ``weight_scale`` (out, in / 32), as
        compressed-tensors holds MXFP4; the experts GEMM's placement split per expert to match."""
        view = _PerExpertView(ckpt)
        out = dict(where)
        for key, ps in where.items():
            if len(ps) != 1 or ps[0].expert is not None or f"{ps[0].name}_blocks" not in ckpt.entries:
                continue
            out[key] = [Placement(f"{ps[0].name}.{e}", e, None) for e in range(view.add(ps[0].name))]
        view.check_consumed()
        return view, out


class _PerExpertView(CheckpointFiles):
    """The checkpoint's files with GPT-OSS's expert tensors read per expert (`GptOssMxfp4.reading_view`)."""

    def __init__(self, ckpt: CheckpointFiles):  # a view of `ckpt`'s checked files: no second read of them
        self.path, self.strays, self.entries = ckpt.path, ckpt.strays, dict(ckpt.entries)
        self._stored: dict[str, tuple] = {}  # the `*_blocks` / `*_scales` entries the virtual layers read
        self._virtual: dict[str, tuple[str, int, tuple[int, ...]]] = {}  # name -> (stored tensor, expert, shape)
        # The stored tensors of one experts GEMM (its blocks and scales): the loader reads them expert by
        # expert, alternating between the two, and each is read from the file once.
        self._held: tuple[str, dict[str, torch.Tensor]] = ("", {})

    def add(self, gemm: str) -> int:
        """Read ``<gemm>_blocks`` / ``<gemm>_scales`` per expert; returns the number of experts."""
        blocks, scales = self.entries.pop(f"{gemm}_blocks", None), self.entries.pop(f"{gemm}_scales", None)
        if scales is None:
            raise ExportError(f"tq.load_exported: the checkpoint holds {gemm}_blocks but no {gemm}_scales; restore the file the export wrote")
        self._stored.update({f"{gemm}_blocks": blocks, f"{gemm}_scales": scales})
        b, s = blocks[1], scales[1]
        b_shape, s_shape = tuple(b["shape"]), tuple(s["shape"])
        if b["dtype"] != "U8" or s["dtype"] != "U8" or len(b_shape) != 4 or b_shape[-1] != _BYTES or b_shape[:-1] != s_shape:
            raise ExportError(
                f"tq.load_exported: {gemm}_blocks is {b['dtype']} {list(b_shape)} and {gemm}_scales {s['dtype']} {list(s_shape)}; "
                f"GPT-OSS's mxfp4 format holds U8 (experts, out, in/32, {_BYTES}) blocks and U8 (experts, out, in/32) scales"
            )
        experts, out_rows, groups = s_shape
        for e in range(experts):
            for local, stored, shape in (("weight_packed", f"{gemm}_blocks", (out_rows, groups * _BYTES)),
                                         ("weight_scale", f"{gemm}_scales", (out_rows, groups))):
                name = f"{gemm}.{e}.{local}"
                self._virtual[name] = (stored, e, shape)
                self.entries[name] = (None, {"dtype": dtype_name(torch.uint8), "shape": list(shape)}, None)
        return experts

    def check_consumed(self) -> None:
        left = sorted(n for n in self.entries if n.endswith(("_blocks", "_scales")))
        if left:
            raise ExportError(
                f"tq.load_exported: {left[0]} has no experts GEMM of the model to load into (the model's experts are kept "
                "in 16 bits, or the architecture differs)"
            )

    def get(self, name: str):
        if name not in self._virtual:
            return super().get(name)
        stored, e, shape = self._virtual[name]
        gemm = stored.rsplit("_", 1)[0]
        if self._held[0] != gemm:
            self._held = (gemm, {})
        held = self._held[1]
        if stored not in held:
            held[stored] = load_tensor(*self._stored[stored])
        return held[stored][e].reshape(shape)

    def refuse_strays(self, names: set[str]) -> None:
        super().refuse_strays(names | set(self._stored))


GPT_OSS_MXFP4 = register_format(GptOssMxfp4())
