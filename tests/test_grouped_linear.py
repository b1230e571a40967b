"""`tq.nn.GroupedLinear` (MoE experts): per-expert scales; the dense per-expert loop and the grouped
path (`m_splits` as a tensor or a list) agree; uneven counts with block recipes; bad input; opcheck
on the grouped ops (compiled: compile_tests/test_grouped_linear_compile.py).

Bit for bit means payload-derived results identical (y, dx, dW). Exceptions, each stated where it
is tested: NVFP4's stochastically rounded gradients (one random stream per layer instead of one
per expert: compared by SQNR against fp64, measured nvfp4 dx 15.0 / dW 15.6 dB for both paths),
and the bias gradient (a per-expert segment sum in fp32 instead of `sum(0)` per expert: both within
fp32 summation's error bound of the exact sum).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tqcompile as tq
from tqcompile.ops import grouped_gemm as gops
from tqcompile.quantizers import NVFP4Quantizer
from tqcompile.testing.compile import assert_bitwise_equal
from tqcompile.testing.numerics import sqnr

E, K, N = 4, 128, 128
# Recipes whose scales could be shared across experts if the layer got it wrong: a tensor-level
# amax (fp8_tensorwise; nvfp4's global amax under its block scales) or per-row/per-block scales.
RECIPES = ["fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4"]


def _nvfp4_no_sr() -> tq.Recipe:
    """nvfp4 without stochastic rounding: deterministic, so the grouped path can be compared bit for bit."""
    r = tq.recipes.nvfp4()
    return dataclasses.replace(r, name="nvfp4_no_sr", dgrad_grad=NVFP4Quantizer(), wgrad_grad=NVFP4Quantizer(hadamard=True))


def _mixed_wgrad() -> tq.Recipe:
    """wgrad operands padded differently (MX 32-blocks against tensorwise FP8, no padding)."""
    return dataclasses.replace(tq.recipes.mxfp8(), name="mixed_wgrad", wgrad_input=tq.Float8Quantizer())


def _recipe(name: str) -> tq.Recipe:
    return {"nvfp4_no_sr": _nvfp4_no_sr, "mixed_wgrad": _mixed_wgrad}.get(name, lambda: tq.recipes.get(name))()


# Every current-scaling recipe, with the block its wgrad operands use along the tokens (fp8_delayed:
# test_delayed_scaling_one_window_per_expert).
BIT_EXACT = {
    "fp8_tensorwise": 1,
    "fp8_rowwise": 1,
    "fp8_rowwise_hp_wgrad": 1,
    "fp8_blockwise": 128,
    "mxfp8": 32,
    "nvfp4_no_sr": 16,
    "mixed_wgrad": 32,
}


def _experts(name: str, bias: bool = False, seed: int = 0) -> tq.nn.GroupedLinear:
    torch.manual_seed(seed)
    return tq.nn.GroupedLinear(E, K, N, bias=bias, recipe=_recipe(name))


def _step(experts, x, dy, m_splits=None, rng_seed=0):
    torch.manual_seed(rng_seed)  # nvfp4's stochastic rounding seeds
    xr = x.clone().requires_grad_()
    y = experts(xr, m_splits) if m_splits is not None else experts(xr)
    y.backward(dy)
    out = (y.detach(), xr.grad, experts.weight.grad.clone())
    if experts.bias is not None:
        out += (experts.bias.grad.clone(),)
    experts.zero_grad()
    return out


def _per_expert_loop(experts, x, dy, m_splits, pad_to: int = 1):
    """The reference: one `tq.nn.linear` per expert on its tokens, zero-padded to a multiple of
    `pad_to` (the block the loop needs for its wgrad operands); returns (y, dx, dW, db)."""
    ys, dxs, dws, dbs, start = [], [], [], [], 0
    for e, m in enumerate(m_splits):
        padded = -(-m // pad_to) * pad_to
        xe = x.new_zeros(padded, K).index_copy_(0, torch.arange(m), x[start : start + m]).requires_grad_()
        dye = dy.new_zeros(padded, N).index_copy_(0, torch.arange(m), dy[start : start + m])
        we = experts.weight[e].detach().clone().requires_grad_()
        be = None if experts.bias is None else experts.bias[e].detach().clone().requires_grad_()
        ye = tq.nn.linear(xe, we, be, experts.recipe)
        ye.backward(dye)
        ys.append(ye.detach()[:m])
        dxs.append(xe.grad[:m])
        dws.append(we.grad)
        dbs.append(None if be is None else be.grad)
        start += m
    db = torch.stack(dbs) if experts.bias is not None else None
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws), db


def _assert_bias_grad(db, ref_db, dy, m_splits):
    """The bias gradient sums each expert's dy in another order than the loop's `sum(0)`: both
    must be within fp32 recursive summation's error bound, (m - 1) * 2^-24 * sum|dy|, of the exact sum."""
    ends = [0, *torch.tensor(m_splits).cumsum(0).tolist()]
    for e, (lo, hi) in enumerate(zip(ends, ends[1:])):
        exact = dy[lo:hi].double().sum(0)
        bound = max(hi - lo - 1, 0) * 2**-24 * dy[lo:hi].double().abs().sum(0) + 1e-30
        for what, got in (("grouped", db[e]), ("loop", ref_db[e])):
            assert ((got.double() - exact).abs() <= bound).all(), f"{what} bias grad of expert {e}"


def _data(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, K, generator=g), torch.randn(tokens, N, generator=g)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("mode", ["dense", "tensor"])
def test_per_expert_scales(name, mode):
    """Expert 0's weights 1000x larger leave every other expert's results unchanged, bit for bit,
    and each expert's output keeps the SQNR of its recipe."""
    experts = _experts(name)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(E, 32, K, generator=g), torch.randn(E, 32, N, generator=g)

    def step():
        if mode == "dense":
            return _step(experts, x, dy)
        y, dx, dw = _step(experts, x.reshape(-1, K), dy.reshape(-1, N), torch.full((E,), 32))
        return y.view(E, 32, N), dx.view(E, 32, K), dw

    before = step()
    with torch.no_grad():
        experts.weight[0] *= 1000
    after = step()
    for what, b, a in zip(("y", "dx", "dW"), before, after):
        assert_bitwise_equal(a[1:], b[1:], f"{what} of experts 1..{E - 1}")
    # Expert 0's own output and input gradient do change (its dW = dyᵀ·x does not involve W).
    assert not torch.equal(after[0][0], before[0][0]) and not torch.equal(after[1][0], before[1][0])
    # Per-expert output SQNR against fp64, including the scaled-up expert. Thresholds from
    # tests/test_linear_numerics.py (derived there from the formats): fprop with two E4M3 operands
    # 28.5 dB, nvfp4's 1x16 x 16x16 fprop 16.5 dB; minus the same 1.5 dB margin.
    threshold = {"nvfp4": 16.5 - 1.5}.get(name, 28.5 - 1.5)
    ref = torch.einsum("etk,enk->etn", x.double(), experts.weight.detach().double())
    for e in range(E):
        assert sqnr(ref[e], after[0][e]) >= threshold, f"expert {e}"


@pytest.mark.parametrize("name", list(BIT_EXACT))
def test_tensor_m_splits_equal_per_expert_loop(name):
    """Counts that are a multiple of the recipe's wgrad block (so the loop can run them), one of
    them zero: the grouped path equals one `tq.nn.linear` per expert bit for bit, and equal counts
    equal the dense (E, C, in) path bit for bit."""
    experts = _experts(name, bias=True)
    b = max(BIT_EXACT[name], 16)
    m_splits = [2 * b, 0, 3 * b, b]
    x, dy = _data(sum(m_splits), seed=2)
    y, dx, dw, db = _step(experts, x, dy, torch.tensor(m_splits))
    ref_y, ref_dx, ref_dw, ref_db = _per_expert_loop(experts, x, dy, m_splits)
    assert_bitwise_equal(y, ref_y, "y")
    assert_bitwise_equal(dx, ref_dx, "dx")
    assert_bitwise_equal(dw, ref_dw, "dW")
    assert not dw[1].any() and not db[1].any(), "an expert with no tokens gets zero weight and bias gradients"
    _assert_bias_grad(db, ref_db, dy, m_splits)

    # Equal counts: the dense path (one tq.nn.linear per expert inside the module).
    c = 2 * b
    xd, dyd = _data(E * c, seed=3)
    dense = _step(experts, xd.view(E, c, K), dyd.view(E, c, N))
    grouped = _step(experts, xd, dyd, torch.full((E,), c))
    assert_bitwise_equal(grouped[0], dense[0].reshape(-1, N), "y")
    assert_bitwise_equal(grouped[1], dense[1].reshape(-1, K), "dx")
    assert_bitwise_equal(grouped[2], dense[2], "dW")


def _per_expert_fprop_dgrad(experts, x, dy, m_splits):
    """y and dx of one `tq.nn.linear` forward and one dgrad GEMM per expert on its unpadded
    tokens (the loop's backward refuses counts that are no multiple of the wgrad block)."""
    r, ys, dxs, start = experts.recipe, [], [], 0
    for e, m in enumerate(m_splits):
        w = experts.weight[e].detach()
        with torch.no_grad():
            ys.append(tq.nn.linear(x[start : start + m], w, None if experts.bias is None else experts.bias[e].detach(), r))
        qdy = tq.quantize(dy[start : start + m], r.dgrad_grad)
        qw = tq.quantize(w, r.dgrad_weight, rowwise=False, columnwise=True)
        dxs.append(tq.nn.qgemm(qdy, False, qw, True, x.dtype))
        start += m
    return torch.cat(ys), torch.cat(dxs)


@pytest.mark.parametrize("name", ["fp8_rowwise_hp_wgrad", "mxfp8"])
def test_bf16_autocast_equals_per_expert_loop(name):
    """bf16 weights and tokens under bf16 autocast (how models train): still the loop's bits,
    the high-precision bf16 wgrad included."""
    torch.manual_seed(0)
    experts = tq.nn.GroupedLinear(E, K, N, bias=True, recipe=tq.recipes.get(name), dtype=torch.bfloat16)
    m_splits = [32, 0, 64, 32]
    x, dy = (t.bfloat16() for t in _data(sum(m_splits), seed=9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _step(experts, x, dy, torch.tensor(m_splits))
        ref = _per_expert_loop(experts, x, dy, m_splits)
    for what, g, r in zip(("y", "dx", "dW"), got, ref):
        assert g.dtype == torch.bfloat16
        assert_bitwise_equal(g, r, what)


@pytest.mark.parametrize("name", ["fp8_blockwise", "mxfp8", "nvfp4_no_sr", "fp8_rowwise"])
def test_uneven_m_splits_are_padded_inside(name):
    """Counts that are no multiple of the wgrad block (which the per-expert loop refuses) work:
    y and dx equal the per-expert GEMMs on the unpadded tokens, and dW equals the loop run on each
    expert's tokens zero-padded to the block, bit for bit."""
    experts = _experts(name, bias=True)
    m_splits = [5, 0, 17, 10]
    x, dy = _data(sum(m_splits), seed=4)
    if BIT_EXACT[name] > 1:
        with pytest.raises(ValueError, match="pad it"):
            _per_expert_loop(experts, x, dy, m_splits)
    ref_y, ref_dx = _per_expert_fprop_dgrad(experts, x, dy, m_splits)
    _, _, ref_dw, ref_db = _per_expert_loop(experts, x, dy, m_splits, pad_to=BIT_EXACT[name])
    for m in (torch.tensor(m_splits), m_splits):  # tensor and list go the same way
        y, dx, dw, db = _step(experts, x, dy, m)
        assert_bitwise_equal(y, ref_y, "y")
        assert_bitwise_equal(dx, ref_dx, "dx")
        assert_bitwise_equal(dw, ref_dw, "dW")
        _assert_bias_grad(db, ref_db, dy, m_splits)


@settings(max_examples=12)
@given(
    name=st.sampled_from(list(BIT_EXACT)), counts=st.lists(st.integers(0, 70), min_size=E, max_size=E), seed=st.integers(0, 2**16)
)
def test_any_counts_equal_the_padded_loop(name, counts, seed):
    """Property: for any counts (zeros, single tokens, all tokens on one expert), y and dx equal the
    per-expert GEMMs and dW the zero-padded per-expert loop, bit for bit."""
    assume(sum(counts) > 0)
    experts = _experts(name)
    x, dy = _data(sum(counts), seed=seed)
    y, dx, dw = _step(experts, x, dy, torch.tensor(counts))
    ref_y, ref_dx = _per_expert_fprop_dgrad(experts, x, dy, counts)
    assert_bitwise_equal(y, ref_y, "y")
    assert_bitwise_equal(dx, ref_dx, "dx")
    assert_bitwise_equal(dw, _per_expert_loop(experts, x, dy, counts, pad_to=BIT_EXACT[name])[2], "dW")


def test_nvfp4_stochastic_rounding_matches_the_loop_by_sqnr():
    """nvfp4 rounds gradients stochastically with one random stream per layer on the grouped path
    and one per expert in the loop, so their bits differ; y is deterministic (bit for bit), and dx
    and dW have the loop's quality: SQNR against fp64 within 1 dB of the loop's and above the
    thresholds of tests/test_linear_numerics.py (dx 15.0, dW 15.6 dB measured there, minus 1.5)."""
    experts = _experts("nvfp4")
    m_splits = [64, 0, 128, 64]
    x, dy = _data(sum(m_splits), seed=5)
    torch.manual_seed(0)
    grouped = _step(experts, x, dy, torch.tensor(m_splits))
    loop = _per_expert_loop(experts, x, dy, m_splits)
    assert_bitwise_equal(grouped[0], loop[0], "y")
    w = experts.weight.detach().double()
    ends = [0, *torch.tensor(m_splits).cumsum(0).tolist()]
    ref_dx = torch.cat([dy[lo:hi].double() @ w[e] for e, (lo, hi) in enumerate(zip(ends, ends[1:]))])
    ref_dw = torch.stack([dy[lo:hi].double().t() @ x[lo:hi].double() for lo, hi in zip(ends, ends[1:])])
    for what, ref, g, lp, floor in (
        ("dx", ref_dx, grouped[1], loop[1], 15.0 - 1.5),
        ("dW", ref_dw, grouped[2], loop[2], 15.6 - 1.5),
    ):
        got, want = sqnr(ref, g), sqnr(ref, lp)
        assert got >= floor and abs(got - want) <= 1.0, f"{what}: grouped {got:.2f} dB, loop {want:.2f} dB"


def test_backward_reaches_every_parameter():
    experts = _experts("mxfp8", bias=True)
    x = torch.randn(E, 32, K, requires_grad=True)
    experts(x).pow(2).mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert experts.weight.grad.shape == (E, N, K) and all(experts.weight.grad[e].abs().sum() > 0 for e in range(E))
    assert experts.bias.grad.shape == (E, N)


def test_no_grad_and_frozen_operands():
    experts = _experts("fp8_blockwise")
    x, dy = _data(40, seed=6)
    counts = torch.tensor([10, 10, 0, 20])
    with torch.no_grad():
        y = experts(x, counts)
    assert y.shape == (40, N) and not y.requires_grad
    # An input that needs no gradient: dW only.
    experts(x, counts).backward(dy)
    assert experts.weight.grad is not None and not experts.weight.grad[2].any() and experts.weight.grad[3].any()
    # A frozen layer: dx only, equal to dx when the layer trains too.
    dx_training = _step(experts, x, dy, counts)[1]
    experts.weight.requires_grad_(False)
    xr = x.clone().requires_grad_()
    experts(xr, counts).backward(dy)
    assert_bitwise_equal(xr.grad, dx_training, "dx")


def test_bad_input():
    experts = _experts("fp8_tensorwise")
    x = torch.randn(8, K)
    with pytest.raises(ValueError, match=r"m_splits tensor has shape \(3,\); expected \(4,\), one count per expert"):
        experts(x, torch.tensor([2, 2, 4]))
    with pytest.raises(ValueError, match=r"m_splits tensor has shape \(1, 4\)"):
        experts(x, torch.tensor([[2, 2, 2, 2]]))
    with pytest.raises(TypeError, match=r"m_splits tensor has dtype torch.float32; allowed: torch.int64"):
        experts(x, torch.tensor([2.0, 2.0, 2.0, 2.0]))
    with pytest.raises(ValueError, match=r"m_splits=\[2, 2, 2, 3\] must be non-negative counts summing to x.shape\[0\]=8"):
        experts(x, torch.tensor([2, 2, 2, 3]))
    with pytest.raises(ValueError, match=r"m_splits=\[4, -2, 4, 2\] must be non-negative"):
        experts(x, torch.tensor([4, -2, 4, 2]))
    with pytest.raises(ValueError, match=r"m_splits=\[1, 2\] must have 4 entries summing to x.shape\[0\]=8"):
        experts(x, [1, 2])
    with pytest.raises(TypeError, match=r"m_splits must be an int64 tensor or a list of ints, got list \[2.0"):
        experts(x, [2.0, 2.0, 2.0, 2.0])
    with pytest.raises(ValueError, match=r"with m_splits, expected x of shape \(tokens, 128\), got \(2, 4, 128\)"):
        experts(torch.randn(2, 4, K), torch.tensor([2, 2, 2, 2]))
    # The ops check the counts too (what a compiled call, which skips the module's eager check, hits).
    q = tq.Float8Quantizer()
    with pytest.raises(
        ValueError, match=r"grouped_amax: m_splits=\[2, 2, 2, 3\] must be non-negative per-expert token counts summing"
    ):
        gops.grouped_amax(x, q, torch.tensor([2, 4, 6, 9]), False)
    # Delayed scaling needs per-expert histories: the function refuses a call without them.
    with pytest.raises(ValueError, match="uses delayed scaling.*or pass amax_histories"):
        tq.nn.grouped_linear(x, torch.tensor([2, 2, 2, 2]), experts.weight, None, tq.recipes.fp8_delayed())
    two_d = dataclasses.replace(tq.recipes.fp8_blockwise(), fprop_input=tq.recipes.fp8_blockwise().fprop_weight)
    with pytest.raises(ValueError, match="fprop_input=.*2-D blocks on a token operand would mix tokens of different experts"):
        tq.nn.GroupedLinear(2, 128, 128, recipe=two_d)


def test_padded_layout_is_worst_case_static():
    """The columnwise layout's length is the static worst case: every expert's segment starts at a
    multiple of the block, and the last one ends within it, whatever the counts."""
    g = torch.Generator().manual_seed(7)
    for multiple in (2, 16, 32, 128):
        for _ in range(20):
            counts = torch.randint(0, 3 * multiple, (E,), generator=g)
            ends = counts.cumsum(0)
            pends = gops._padded_ends(ends, multiple)
            assert (pends % multiple == 0).all() and int(pends[-1]) <= gops.padded_tokens(int(ends[-1]), E, multiple)
    assert gops.padded_tokens(100, 8, 32) == (100 + 8 * 31) // 32 * 32 == 320 and gops.padded_tokens(100, 8, 1) == 100


# --- opcheck on the grouped ops: schema, fake kernel (output shape independent of the counts), AOT dispatch.
_OPCHECK_QUANTIZERS = {
    "fp8_tensorwise": tq.Float8Quantizer(),
    "fp8_rowwise": tq.Float8Quantizer(granularity=tq.Granularity.ROWWISE),
    "fp8_1x128": tq.Float8Quantizer(granularity=tq.Granularity.BLOCKWISE_1D),
    "mxfp8": tq.MXQuantizer(),
    "nvfp4_hadamard": NVFP4Quantizer(hadamard=True),
    "int4_tensorwise": tq.IntQuantizer(format=tq.Format.INT4),
}


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("qname", list(_OPCHECK_QUANTIZERS))
def test_opcheck_grouped_quantize_and_amax(qname, columnwise, float8_comparable):
    q = _OPCHECK_QUANTIZERS[qname]
    x = torch.randn(37, 128)
    ends = torch.tensor([5, 5, 22, 37])
    amax = gops.grouped_amax(x, q, ends, columnwise) if q.uses_tensor_amax() else None
    torch.library.opcheck(gops.grouped_amax, (x, q, ends, columnwise))
    torch.library.opcheck(gops.grouped_quantize, (x, q, ends, amax, None, columnwise))


@pytest.mark.parametrize("qname", ["fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4_hadamard", "int4_tensorwise"])
def test_opcheck_grouped_gemm(qname, float8_comparable):
    q = _OPCHECK_QUANTIZERS[qname]
    g = torch.Generator().manual_seed(8)
    t, n, k = 37, 64, 128
    ends = torch.tensor([5, 5, 22, 37])
    w_ends = torch.arange(1, E + 1) * n
    x, dy, w = torch.randn(t, k, generator=g), torch.randn(t, n, generator=g), torch.randn(E * n, k, generator=g)

    def operand(v, e, columnwise):
        amax = gops.grouped_amax(v, q, e, columnwise) if q.uses_tensor_amax() else None
        data, scale_inv = gops.grouped_quantize(v, q, e, amax, None, columnwise)
        return data, scale_inv, amax, q

    torch.library.opcheck(
        gops.grouped_gemm_tn, (*operand(x, ends, False), *operand(w, w_ends, False), ends, False, torch.float32)
    )
    torch.library.opcheck(gops.grouped_gemm_tn, (*operand(dy, ends, True), *operand(x, ends, True), ends, True, torch.bfloat16))
    torch.library.opcheck(gops.grouped_mm_wgrad, (dy, x, ends, torch.float32))




def test_delayed_scaling_one_window_per_expert():
    """fp8_delayed: (L, E) histories, one window per expert; the dense (E, C, in) form runs the
    grouped op with equal counts; histories roll in training mode only."""
    torch.manual_seed(0)
    experts = tq.nn.GroupedLinear(E, K, N, recipe=tq.recipes.fp8_delayed(amax_history_len=3))
    assert experts.amax_history_weight.shape == (3, E)
    x = torch.randn(E, 8, K)
    experts(x).sum().backward()
    torch.testing.assert_close(experts.amax_history_weight[0], experts.weight.detach().abs().amax((1, 2)), rtol=0, atol=0)
    torch.testing.assert_close(experts.amax_history_input[0], x.abs().amax((1, 2)), rtol=0, atol=0)
    assert (experts.amax_history_grad[0] > 0).all()
    before = experts.amax_history_input.clone()
    experts.eval()
    y_dense = experts(x)
    y_grouped = experts(x.reshape(-1, K), torch.full((E,), 8))
    assert torch.equal(y_dense.reshape(-1, N), y_grouped) and torch.equal(experts.amax_history_input, before)


@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_rowwise"])
def test_hopper_fprop_and_dgrad_run_one_scaled_grouped_mm(name, monkeypatch):
    """Where CUDA's grouped FP8 GEMM runs (`cuda_grouped_gemms`, patched true here; the op replaced
    by its contract, the exact product of codes times scales rounded once to bf16), bf16 training
    of E4M3 per-tensor / per-row experts runs fprop and dgrad (E4M3 gradients) as one
    `torch._scaled_grouped_mm` each (each row's scale its expert's or its own, weight scales
    (E, N)): y and dx within one bf16 ulp of the per-expert loop (which rounds the same product
    once, from its fp32 sum: `fp8_gemm_cpu`), dW the loop's bit for bit (the weight gradient keeps the loop). On the GPU: tests/test_cuda.py."""
    calls = []

    def exact(a, b, scale_a, scale_b, offs=None, out_dtype=None, **_):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and b.stride(-2) == 1
        calls.append(a.shape[0])
        ids = gops.expert_ids(offs.long(), a.shape[0])
        return torch.einsum("tk,tkn->tn", a.double() * scale_a.double()[:, None], (b.double() * scale_b.double()[:, None, :])[ids]).to(out_dtype)

    torch.manual_seed(0)
    experts = tq.nn.GroupedLinear(E, K, N, recipe=tq.recipes.get(name), dtype=torch.bfloat16)
    m_splits = [32, 0, 5, 27]
    x, dy = (t.bfloat16() for t in _data(sum(m_splits), seed=9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _step(experts, x, dy, torch.tensor(m_splits))
        monkeypatch.setattr(gops, "cuda_grouped_gemms", lambda device: True)
        monkeypatch.setattr(torch, "_scaled_grouped_mm", exact, raising=False)
        got = _step(experts, x, dy, torch.tensor(m_splits))
    # fprop, and dgrad where the gradient is E4M3 (fp8_tensorwise's E5M2 gradients keep the loop)
    assert calls == ([64, 64] if name == "fp8_rowwise" else [64])
    # Both round a product once to bf16, the contract from fp64, the loop from its fp32 sum: a sum
    # at a rounding boundary may take the neighbouring bf16 value, one ulp (<= 2^-7 relative;
    # measured: 1 element in 8192 on torch 2.11, none on 2.13).
    for what, g, r in zip(("y", "dx"), got, ref):
        assert bool(((g.double() - r.double()).abs() <= 2.0**-7 * r.double().abs()).all()), what
    assert_bitwise_equal(got[2], ref[2], "dW")
