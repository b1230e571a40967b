"""`weight_only`: a calibrated model's weight-only view, for as long as a ``with`` block lasts.

The comparisons a user makes after PTQ need the model with its activations in float and its
weights still fake-quantized: that is what a weight-only engine computes, and what transformers'
compressed-tensors loader builds from an exported W8A8 checkpoint (it dequantizes the weights and
ignores the input scales). ModelOpt spells it ``mtq.disable_quantizer(model, "*input_quantizer")``
and must be told to enable them again; here the block restores them on exit, even on an error.

A quantizer is switched off the one way tq knows a disabled slot, ``TensorQuantizer.quantizer is
None``, so everything that reads a model (its forward, `tq.summary`, `tq.quant_state`,
`tq.export`) sees the same weight-only model inside the block. The static amaxes stay in their
buffers, untouched. Under `torch.compile`, Dynamo guards on each quantizer: entering the block
compiles the weight-only graph once, and leaving it finds the first graph again (two graphs for
any number of blocks; `compile_tests/test_weight_only_compile.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from tqcompile.calibration.fake_quant import TensorQuantizer

__all__ = ["weight_only"]

# The slots a weight-only model computes in high precision.
ACTIVATION_ROLES = ("input", "output")


@contextmanager
def weight_only(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, `model`'s input and output quantizers are off and its weights are still
    fake-quantized; on exit every quantizer is as it was.

    Works on every fake-quantized unit (Linear, Conv, `tq.nn.GroupedLinear`, each GEMM of an MoE
    experts module) of a model made by `tq.calibrate`, `tq.restore` or `tq.load_exported`, also
    when `model` is the `torch.compile` of one.

    Example:
        >>> tq.calibrate(model, tq.configs.int8(), forward_loop)
        >>> with tq.calibration.weight_only(model):
        ...     logits = model(ids).logits   # W8A16: what transformers' dequantizing loader computes

    Raises:
        ValueError: `model` holds no fake-quantized module, or it is being calibrated.
    """
    slots = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    if not slots:
        raise ValueError(
            f"tq.calibration.weight_only: {type(model).__name__} holds no fake-quantized module; it takes a model "
            "made by tq.calibrate, tq.restore or tq.load_exported (a tq.convert model quantizes as its recipe says)"
        )
    busy = [m.owner for m in slots if m.observer is not None]
    if busy:
        raise ValueError(
            f"tq.calibration.weight_only: the model is being calibrated (module {busy[0]!r} records statistics); "
            "use weight_only after tq.calibrate returns"
        )
    saved = [(m, m.quantizer) for m in slots if m.role in ACTIVATION_ROLES and m.enabled]
    try:
        for m, _ in saved:
            m.quantizer = None
        yield model
    finally:
        for m, q in saved:
            m.quantizer = q
