"""A 3-D expert weight that arrives already quantized (what FSDP2's quantized all-gather of expert
weights makes: a `GroupedQuantizedTensor`) runs through `tq.nn.grouped_linear` exactly as the
high-precision weight it stands for: fprop and dgrad read its usages instead of quantizing."""

from __future__ import annotations

import pytest
import torch

import tqcompile as tq
from tqcompile.nn.grouped import quantize_expert_weight
from tqcompile.tensor import GroupedQuantizedTensor

E, N, K = 4, 64, 96
ROW, COL = ("_data", "_scale_inv", "_amax"), ("_data_t", "_scale_inv_t", "_amax_t")


def _gathered(w: torch.Tensor, q, *, transposed: bool = False) -> GroupedQuantizedTensor:
    """The GroupedQuantizedTensor of the (E, N, K) GEMM weight `w` (stored (E, K, N) when `transposed`)."""
    fprop, dgrad = quantize_expert_weight(w, q, dgrad=False), quantize_expert_weight(w, q, dgrad=True)
    row, col = (dgrad, fprop) if transposed else (fprop, dgrad)
    inner = {n: t for names, ts in ((ROW, row), (COL, col)) for n, t in zip(names, ts) if t is not None}
    shape = (E, K, N) if transposed else (E, N, K)
    return GroupedQuantizedTensor(shape, q, w.dtype, None, **inner)


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("transposed", [False, True])
def test_gathered_weight_equals_quantizing_here(recipe, transposed):
    r = tq.recipes.get(recipe)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(E, N, K, generator=g)
    x = torch.randn(80, K, generator=g)
    counts = torch.tensor([30, 0, 18, 32])
    dy = torch.randn(80, N, generator=g)

    def run(weight):
        xr = x.clone().requires_grad_()
        torch.manual_seed(1)  # NVFP4's stochastic rounding of gradients
        y = tq.nn.grouped_linear(xr, counts, weight, None, r)
        y.backward(dy)
        return y.detach(), xr.grad

    y_ref, dx_ref = run(w)
    gathered = _gathered(w, r.fprop_weight, transposed=transposed)
    y, dx = run(gathered.transpose(1, 2) if transposed else gathered)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


def test_grouped_quantized_tensor_ops():
    q = tq.recipes.mxfp8().fprop_weight
    t = _gathered(torch.randn(E, N, K), q)
    tt = t.transpose(1, 2)
    assert isinstance(tt, GroupedQuantizedTensor) and tt.shape == (E, K, N)
    assert tt._data is t._data_t and tt._data_t is t._data  # the usages swap, nothing is copied
    assert isinstance(t.detach(), GroupedQuantizedTensor)
    inner, meta = t.__tensor_flatten__()
    back = GroupedQuantizedTensor.__tensor_unflatten__({n: getattr(t, n) for n in inner}, meta, t.shape, t.stride())
    assert isinstance(back, GroupedQuantizedTensor) and torch.equal(back._data.view(torch.uint8), t._data.view(torch.uint8))
    with pytest.raises(NotImplementedError, match="GroupedQuantizedTensor does not support aten.mul"):
        t * 2
    with pytest.raises(NotImplementedError, match="read by tq.nn.grouped_linear only"):
        t.dequantize()
