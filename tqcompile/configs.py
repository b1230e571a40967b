"""Named PTQ/QAT configs: `tq.configs.int8()`, `int8_dynamic()`, `int8_weight_only()`, `int4_weight_only()`,
`int_weight_only(bits)`, `fp8()`,
`mxfp8()`, `mxfp6()`, `mxfp4_weight_only()`, `nvfp4()`.

Each is a `QuantConfig` whose first rule enables quantizers on the GEMM layers (Linear,
Conv1d/2d/3d, `tq.nn.GroupedLinear`, and each GEMM of a MoE experts module with fused 3-D weights,
`tq.calibration.ExpertGemmQuantizers`) and whose later rules (`default_disabled()`) turn off what
users expect left in high precision:

- norms: BatchNorm1d/2d/3d, SyncBatchNorm, LayerNorm, RMSNorm, GroupNorm (by class, subclasses
  included);
- embeddings (`nn.Embedding`);
- the output head: modules whose canonical name is, or ends in, ``lm_head``, ``head``,
  ``output`` or ``output_layer`` (e.g. ``lm_head``, ``model.head``), and the classification heads
  of Hugging Face models, ``classifier`` (BERT, ViT: ``BertForSequenceClassification.classifier``)
  and ``score`` (decoder models' ``*ForSequenceClassification``, e.g. ``LlamaForSequenceClassification.score``),
  with every module under a ``classifier`` (RoBERTa's head is a module of its own:
  ``classifier.dense``, ``classifier.out_proj``);
- MoE routers: names that are, or end in, ``router``, ``gate`` or ``shared_expert_gate`` (e.g.
  ``block_sparse_moe.gate``, Qwen2-MoE's ``mlp.shared_expert_gate``; not ``mlp.gate_proj``).

Those default rules carry ``must_match=False``: a model without a head or router gets no warning.
Extend a preset with `QuantConfig.with_rules(...)`; a later rule overrides.

Example:
    >>> cfg = tq.configs.int8().with_rules(tq.calibration.QuantRule.disable("features.0"))
"""

from __future__ import annotations

from torch import nn

from tqcompile.calibration.config import QuantConfig, QuantRule
from tqcompile.calibration.modules import ExpertGemmQuantizers
from tqcompile.formats import Format
from tqcompile.nn.grouped import GroupedLinear
from tqcompile.quantizers import Float8Quantizer, Granularity, IntGrid, IntQuantizer, MXQuantizer, NVFP4Quantizer

__all__ = ["int8", "int8_dynamic", "int8_weight_only", "int4_weight_only", "int_weight_only", "fp8", "mxfp8", "mxfp6", "mxfp4_weight_only", "nvfp4", "fp8_kv_cache", "default_disabled", "GEMM_LAYERS"]

GEMM_LAYERS: tuple[type, ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, GroupedLinear, ExpertGemmQuantizers)
NORMS: tuple[type, ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.GroupNorm,
)
# The head's output is the loss's input (logits): quantizing it costs the most accuracy for the least
# compute. `classifier` and `score` are the names Hugging Face gives classification heads.
HEAD_NAMES = ("lm_head", "head", "output", "output_layer", "classifier", "score")
# Heads matched at the top level only: Whisper's output head is `proj_out` (tied to the decoder's
# embedding, so a quantized one cannot be exported), a name diffusion transformers give inner layers.
TOP_LEVEL_HEAD_NAMES = ("proj_out",)
# Heads Hugging Face builds as modules of their own (RobertaClassificationHead and some 20 more): their
# layers too. Only `classifier`: `output` is also the name of every BERT layer's output block.
HEAD_MODULES = ("classifier",)
# `shared_expert_gate`: Qwen2-MoE / Qwen3-Next gate the shared expert with a (hidden -> 1) Linear that
# vLLM builds in high precision.
ROUTER_NAMES = ("router", "gate", "shared_expert_gate")
# The vision (and audio) encoders and projectors of Hugging Face's multimodal models stay in high
# precision, as llmcompressor's and ModelOpt's VLM recipes keep them (vLLM serves them so; their
# share of the compute is small and their accuracy sensitive). Matched below a parent module only
# for `vision_model`: a CLIP or SigLIP vision model on its own holds its layers under a top-level
# `vision_model`, and those are the model the user quantizes.
ENCODER_NAMES = ("vision_tower", "visual", "multi_modal_projector", "mm_projector", "audio_tower")
NESTED_ENCODER_NAMES = ("vision_model",)


def default_disabled() -> tuple[QuantRule, ...]:
    """The rules every preset ends with: norms, embeddings, the output head, MoE routers and a
    multimodal model's vision and audio encoders and projectors off."""
    rules = [
        QuantRule.disable(module_types=NORMS, must_match=False),
        QuantRule.disable(module_types=(nn.Embedding,), must_match=False),
    ]
    for n in HEAD_NAMES + ROUTER_NAMES:
        rules += [QuantRule.disable(n, must_match=False), QuantRule.disable(f"*.{n}", must_match=False)]
    rules += [QuantRule.disable(n, must_match=False) for n in TOP_LEVEL_HEAD_NAMES]
    # Layers inside such modules too: a head built as a module (RoBERTa), a router holding its
    # nn.Linear one level down (HunYuan-MoE's mlp.gate.wg).
    for n in HEAD_MODULES + ROUTER_NAMES + ENCODER_NAMES:
        rules += [QuantRule.disable(f"{n}.*", must_match=False), QuantRule.disable(f"*.{n}.*", must_match=False)]
    rules += [QuantRule.disable(f"*.{n}.*", must_match=False) for n in NESTED_ENCODER_NAMES]
    return tuple(rules)


def _preset(input_q, weight_q, ste: str) -> QuantConfig:
    return QuantConfig(
        (QuantRule(module_types=GEMM_LAYERS, input=input_q, weight=weight_q, must_match=False), *default_disabled()), ste
    )


# The grid of the presets' integer weights (and static activations): FULL, the codes and scale rule
# of llmcompressor's checkpoints, which the engines compute as stored (docs/ptq.md, "Integer grids").
_GRID = IntGrid.FULL


def _int(fmt: Format, grid: IntGrid, granularity: Granularity = Granularity.TENSORWISE, block_size: int | None = None) -> IntQuantizer:
    if block_size is None:
        return IntQuantizer(fmt, granularity, grid=grid)
    return IntQuantizer(fmt, Granularity.BLOCKWISE_1D, block_size=block_size, grid=grid)


def int8(*, grid: IntGrid = _GRID, ste: str = "clipped") -> QuantConfig:
    """W8A8 with static activations: INT8 weights per output channel, INT8 activations per tensor
    with one calibrated (static) scale. Both on `grid` (default FULL: codes -128..127, scale
    amax / 127.5, as llmcompressor's static W8A8; with ASYMMETRIC weights the activations stay
    FULL). Not llmcompressor's default W8A8, which has dynamic per-token activations: that is
    `int8_dynamic()`."""
    inputs = IntGrid.FULL if grid is IntGrid.ASYMMETRIC else grid
    return _preset(_int(Format.INT8, inputs), _int(Format.INT8, grid, Granularity.ROWWISE), ste)


def int8_weight_only(*, grid: IntGrid = _GRID, ste: str = "clipped") -> QuantConfig:
    """W8A16: INT8 weights per output channel on `grid` (default FULL); activations stay high precision."""
    return _preset(False, _int(Format.INT8, grid, Granularity.ROWWISE), ste)


def int8_dynamic(*, grid: IntGrid = _GRID, ste: str = "clipped") -> QuantConfig:
    """W8A8 with dynamic activations (llmcompressor's and vLLM's W8A8): INT8 weights per output
    channel on `grid` (default FULL), INT8 activations with one scale per token computed from each
    token (no static amax), on the SYMMETRIC grid: amax / 127, as vLLM quantizes them."""
    weights, tokens = _int(Format.INT8, grid, Granularity.ROWWISE), _int(Format.INT8, IntGrid.SYMMETRIC, Granularity.ROWWISE)
    return _preset(tokens, weights, ste)


def int_weight_only(bits: int = 4, block_size: int | None = 128, *, grid: IntGrid = _GRID, ste: str = "clipped") -> QuantConfig:
    """W{bits}A16: INT8, INT4, INT3 or INT2 weights in blocks of `block_size` along the input dim, or
    one scale per output channel (`block_size=None`, compressed-tensors' "channel" strategy), on
    `grid` (default FULL: codes -2**(bits-1)..2**(bits-1)-1, scale amax / ((2**bits - 1) / 2), as
    llmcompressor's W4A16 / W3A16; ASYMMETRIC: a zero point a unit, as its asymmetric W4A16);
    activations stay high precision. Layers whose input dim is not a
    multiple of `block_size` are left in high precision (reported). INT3 and INT2 are for GPTQ
    (round to nearest at 3 bits costs several times GPTQ's perplexity: docs/ptq.md)."""
    formats = {8: Format.INT8, 4: Format.INT4, 3: Format.INT3, 2: Format.INT2}
    if bits not in formats:
        raise ValueError(f"tq.configs.int_weight_only: bits={bits!r} is not allowed; allowed: {sorted(formats)}")
    return _preset(False, _int(formats[bits], grid, Granularity.ROWWISE, block_size), ste)


def int4_weight_only(block_size: int | None = 128, *, grid: IntGrid = _GRID, ste: str = "clipped") -> QuantConfig:
    """W4A16: `int_weight_only(4, block_size)`: INT4 weights in blocks of `block_size` (or per output
    channel with None) on `grid` (default FULL, llmcompressor's W4A16: codes -8..7, scale amax / 7.5)."""
    return int_weight_only(4, block_size, grid=grid, ste=ste)


def fp8(*, ste: str = "clipped") -> QuantConfig:
    """FP8 E4M3 weights and activations, one static scale per tensor."""
    return _preset(Float8Quantizer(Format.E4M3), Float8Quantizer(Format.E4M3), ste)


def fp8_kv_cache(*, per_head: bool = False, query: bool = False) -> QuantRule:
    """A rule quantizing every attention's KV cache to FP8 E4M3 with static, calibrated scales: one
    per layer, or one per KV head (`per_head`, compressed-tensors' "attn_head"); with `query`, the
    query too (after the rotary embedding), one scale per layer (exported as ``q_scale``, which
    vLLM's FP8 attention kernels read). Append it to any preset; it sets only the attention
    modules' quantizers. `tq.calibrate` searches per-layer KV amaxes with "mse" by default, per-head
    ones with its `algorithm` (its `kv_scale_search` argument; docs/ptq.md, "KV cache").

    Example:
        >>> cfg = tq.configs.int4_weight_only().with_rules(tq.configs.fp8_kv_cache())   # W4A16 + FP8 KV
    """
    q = Float8Quantizer(Format.E4M3, Granularity.ROWWISE if per_head else Granularity.TENSORWISE)
    return QuantRule(key=q, value=q, query=Float8Quantizer(Format.E4M3) if query else None)


def mxfp8(*, ste: str = "clipped") -> QuantConfig:
    """MXFP8 (E4M3 elements, a power-of-two scale per 32-block) weights and activations: no static
    amax, every block scale comes from its block. Input dims must be multiples of 32."""
    return _preset(MXQuantizer(Format.E4M3), MXQuantizer(Format.E4M3), ste)


def mxfp6(*, ste: str = "clipped") -> QuantConfig:
    """MXFP6 weights (E2M3 elements, a power-of-two scale per 32-block) with MXFP8 (E4M3) activations,
    compressed-tensors' MXFP6A8: no static amax. Input dims must be multiples of 32."""
    return _preset(MXQuantizer(Format.E4M3), MXQuantizer(Format.E2M3), ste)


def mxfp4_weight_only(*, experts_only: bool = False, ste: str = "clipped") -> QuantConfig:
    """MXFP4 weights (E2M1 elements, a power-of-two E8M0 scale per 32-block along the input dim;
    compressed-tensors' mxfp4-pack-quantized) with activations in high precision: no static amax.
    Input dims must be multiples of 32. `experts_only`: only the MoE experts' GEMMs, every
    nn.Linear in high precision, as OpenAI released GPT-OSS; such a gpt_oss model exports in its
    own format, ``tq.export(model, path, format="mxfp4")``, which vLLM and transformers load.

    Example:
        >>> tq.calibrate(gpt_oss, tq.configs.mxfp4_weight_only(experts_only=True), None)   # no data needed
        >>> tq.export(gpt_oss, "gpt-oss-mxfp4", format="mxfp4")
    """
    if experts_only not in (True, False):
        raise ValueError(f"tq.configs.mxfp4_weight_only: experts_only={experts_only!r} is not allowed; allowed: True, False")
    config = _preset(False, MXQuantizer(Format.E2M1), ste)
    if experts_only:
        gemms = tuple(t for t in GEMM_LAYERS if t is not ExpertGemmQuantizers)
        config = config.with_rules(QuantRule.disable(module_types=gemms, must_match=False))
    return config


def nvfp4(*, ste: str = "clipped") -> QuantConfig:
    """NVFP4 weights and activations: E2M1 in 16-blocks with E4M3 block scales under a static
    (calibrated) fp32 global amax. Input dims must be multiples of 16."""
    return _preset(NVFP4Quantizer(), NVFP4Quantizer(), ste)
