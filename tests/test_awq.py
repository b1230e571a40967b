"""AWQ's pure functions (tqcompile.calibration.awq): the scale search lowers the output error where
a few input channels are salient and never picks worse than no scaling; its losses are the layers'
output errors under `max` calibration's rounding; the clipping search never increases the output
error; the clamped weight is what `max` calibration of a clipped amax computes (Int, FP8, NVFP4)
or at least re-derives the clipped block scales (MX)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tqcompile as tq
from tqcompile.calibration import fake_quantize
from tqcompile.calibration.algorithms import AWQ
from tqcompile.calibration.awq import awq_clip, awq_scales, awq_search
from tqcompile.calibration.fake_quant import round_to_nearest
from tqcompile.calibration.gptq import hessian
from tqcompile.formats import Format
from tqcompile.kernels import reference
from tqcompile.kernels.reference import e2m1_decode, e2m1_encode, nvfp4_tensor_scale, unit_amax
from tqcompile.ops import amax as tensor_amax
from tqcompile.quantizers import Float8Quantizer, Granularity, IntQuantizer, MXQuantizer, NVFP4Quantizer, ScaleRounding

INT4_G128 = IntQuantizer(Format.INT4, Granularity.BLOCKWISE_1D, block_size=128)
INT4_G32 = IntQuantizer(Format.INT4, Granularity.BLOCKWISE_1D, block_size=32)
QUANTIZERS = {
    "int4_g128": INT4_G128,
    "int4_g32": INT4_G32,
    "int4_channel": IntQuantizer(Format.INT4, Granularity.ROWWISE),
    "int8_channel": IntQuantizer(Format.INT8, Granularity.ROWWISE),
    "int8_tensor": IntQuantizer(Format.INT8),
    "fp8_tensor": Float8Quantizer(),
    "fp8_channel": Float8Quantizer(granularity=Granularity.ROWWISE),
    "fp8_1x128": Float8Quantizer(granularity=Granularity.BLOCKWISE_1D),
    "fp8_32x32": Float8Quantizer(granularity=Granularity.BLOCKWISE_2D, block_size=32),
    "mxfp8": MXQuantizer(Format.E4M3),
    "mxfp4": MXQuantizer(Format.E2M1),
    "mxfp4_rceil": MXQuantizer(Format.E2M1, ScaleRounding.RCEIL),
    "nvfp4": NVFP4Quantizer(),
    "nvfp4_2d": NVFP4Quantizer(block_2d=True),
}


def _salient(seed: int, out_f: int = 64, in_f: int = 256, n: int = 384, salient: int = 4, boost: float = 20.0):
    """Inputs with a few salient channels (mean|x| `boost` times the rest), Gaussian weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_f, generator=g)
    x[:, torch.randperm(in_f, generator=g)[:salient]] *= boost
    return x, 0.02 * torch.randn(out_f, in_f, generator=g)


def _err(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    """The output error measured on the inputs themselves (not through the Hessian)."""
    return float(((x.double() @ (w - q).double().T) ** 2).sum())


def _awq_weight(w: torch.Tensor, q, s: torch.Tensor) -> torch.Tensor:
    """What the model computes with after folding s: RTN(W diag(s)), the input divided by s."""
    return round_to_nearest(w * s, q) / s


@pytest.mark.parametrize("name, bound", [("int4_g128", 0.6), ("int4_g32", 0.6), ("nvfp4", 0.6)])
def test_awq_beats_round_to_nearest_on_salient_channels(name, bound):
    q = QUANTIZERS[name]
    x, w = _salient(0)
    s = awq_scales([w], [q], hessian(x), x.abs().mean(0))
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all()) and s.dtype == torch.float32
    assert _err(w, _awq_weight(w, q, s), x) < bound * _err(w, round_to_nearest(w, q), x)


def test_awq_scales_shared_by_layers_that_read_one_input():
    x, w = _salient(1)
    w2 = 0.05 * torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    qs = [INT4_G32, NVFP4Quantizer()]
    res = awq_search([w, w2], qs, hessian(x), x.abs().mean(0))
    total = sum(_err(wi, _awq_weight(wi, qi, res.scales), x) for wi, qi in zip((w, w2), qs))
    rtn = sum(_err(wi, round_to_nearest(wi, qi), x) for wi, qi in zip((w, w2), qs))
    assert res.ratio is not None and total < 0.6 * rtn


def test_per_layer_hessians_for_layers_that_see_different_tokens():
    # MoE experts behind one norm: one scale vector, each expert's error on its own tokens.
    (x1, w1), (x2, w2) = _salient(11), _salient(12)
    res = awq_search([w1, w2], [INT4_G32, INT4_G32], [hessian(x1), hessian(x2)], torch.cat((x1, x2)).abs().mean(0))
    s = res.scales
    n = x1.shape[0]
    assert res.loss == pytest.approx(
        2 / n * sum(_err(w, _awq_weight(w, INT4_G32, s), x) for w, x in ((w1, x1), (w2, x2))), rel=1e-4
    )
    assert res.loss < 0.8 * res.identity_loss
    with pytest.raises(ValueError, match=r"1 Hessians for 2 weights"):
        awq_search([w1, w2], [INT4_G32, INT4_G32], [hessian(x1)], x1.abs().mean(0))


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(sorted(QUANTIZERS)), st.booleans(), st.sampled_from([0.0, 20.0]))
def test_search_losses_are_the_output_errors_and_never_above_identity(seed, name, duo, boost):
    q = QUANTIZERS[name]
    x, w = _salient(seed, boost=boost)
    res = awq_search([w], [q], hessian(x), x.abs().mean(0), AWQ(grid=5, duo_scaling=duo))
    n = x.shape[0]
    # tr(D H D^T) with H = 2 X^T X / n is 2/n times the summed squared output error.
    assert res.loss == pytest.approx(2 / n * _err(w, _awq_weight(w, q, res.scales), x), rel=1e-4)
    assert res.identity_loss == pytest.approx(2 / n * _err(w, round_to_nearest(w, q), x), rel=1e-4)
    assert res.loss <= res.identity_loss
    if res.ratio is None:
        assert torch.equal(res.scales, torch.ones(256))


def _on_grid(q, g: torch.Generator) -> torch.Tensor:
    """A (128, 256) weight that round to nearest leaves exactly as it is (power-of-two scales)."""
    if isinstance(q, IntQuantizer):
        w = torch.randint(-7, 8, (128, 256), generator=g).float()
        w[:, :: q.block_size] = 7.0  # each 32-block's amax 7: scale 7 / (7 * 2**-6) = 2**6 exactly
        return w * 2.0**-6
    if isinstance(q, Float8Quantizer):
        w = (100 * torch.randn(128, 256, generator=g)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        w[:, 0] = 448.0
        return w * 2.0**-10
    return round_to_nearest(0.02 * torch.randn(128, 256, generator=g), q)  # NVFP4 round to nearest is idempotent


def test_identity_wins_when_the_weight_is_already_on_the_grid():
    # RTN of a weight on its own grid is exact: every scaling moves it off the grid, so only the
    # identity has zero loss.
    x, _ = _salient(2)
    for q in (INT4_G32, QUANTIZERS["fp8_channel"], NVFP4Quantizer()):
        on_grid = _on_grid(q, torch.Generator().manual_seed(2))
        assert torch.equal(round_to_nearest(on_grid, q), on_grid)
        res = awq_search([on_grid], [q], hessian(x), x.abs().mean(0))
        assert res.ratio is None and res.loss == 0.0 and torch.equal(res.scales, torch.ones(256))


def test_round_to_nearest_is_what_tq_calibrate_computes():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(256, 64))
    tq.calibrate(model, tq.configs.int4_weight_only(block_size=32), lambda m: m(torch.randn(4, 256)), progress=False)
    lin = model[0]
    assert torch.equal(lin.weight_quantizer(lin.weight), round_to_nearest(lin.weight.detach(), lin.weight_quantizer.quantizer))
    assert lin.weight_quantizer.quantizer == dataclasses.replace(INT4_G32, grid=tq.IntGrid.FULL)  # the preset's grid


def test_dead_channels_and_zero_statistics_give_finite_scales():
    x, w = _salient(4)
    x[:, 3] = 0.0  # a channel that is always zero: mean 0, a zero row and column in H
    w[:, 5] = 0.0  # a weight column that is all zero: w_mean 0 there
    for duo in (True, False):
        for xm in (x.abs().mean(0), torch.zeros(256)):
            res = awq_search([w], [INT4_G32], hessian(x), xm, AWQ(grid=10, duo_scaling=duo))
            s = res.scales
            assert bool(torch.isfinite(s).all()) and float(s.min()) >= 1e-2 and float(s.max()) <= 1e2, (duo, s)
    # A layer kept in high precision adds nothing; with no quantized layer the identity stays.
    with_router = awq_search([w, torch.randn(8, 256)], [INT4_G32, None], hessian(x), x.abs().mean(0))
    assert torch.equal(with_router.scales, awq_scales([w], [INT4_G32], hessian(x), x.abs().mean(0)))
    res = awq_search([torch.randn(8, 256)], [None], hessian(x), x.abs().mean(0))
    assert res.ratio is None and res.loss == 0.0
    assert torch.equal(awq_clip(w, None, hessian(x)), w)
    # An all-zero layer: nothing to gain, the identity stays.
    res = awq_search([torch.zeros(16, 256)], [INT4_G32], hessian(x), x.abs().mean(0))
    assert res.ratio is None and res.loss == 0.0


def test_bad_inputs_name_the_value():
    x, w = _salient(5)
    h, xm = hessian(x), x.abs().mean(0)
    with pytest.raises(ValueError, match=r"x_mean"):
        awq_scales([w], [INT4_G32], h, torch.where(torch.arange(256) == 7, torch.nan, xm))
    with pytest.raises(ValueError, match=r"x_mean"):
        awq_scales([w], [INT4_G32], h, -xm)
    with pytest.raises(ValueError, match=r"weights\[1\] has shape \(8, 128\)"):
        awq_scales([w, torch.randn(8, 128)], [INT4_G32, INT4_G32], h, xm)
    with pytest.raises(ValueError, match=r"h has shape \(128, 128\)"):
        awq_scales([w], [INT4_G32], h[:128, :128], xm)
    with pytest.raises(ValueError, match=r"2 weights and 1 quantizers"):
        awq_scales([w, w], [INT4_G32], h, xm)
    with pytest.raises(ValueError, match=r"not supported"):
        awq_scales([w], [NVFP4Quantizer(hadamard=True)], h, xm)
    with pytest.raises(ValueError, match=r"not supported"):
        awq_clip(w, IntQuantizer(granularity=Granularity.ROWWISE, axis=0), h)
    with pytest.raises(ValueError, match=r"NaN or Inf"):
        awq_clip(torch.where(w > 0.03, torch.inf, w), INT4_G32, h)
    with pytest.raises(ValueError, match=r"multiple of the block size 128"):
        awq_clip(torch.randn(4, 96), INT4_G128, h[:96, :96])


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(sorted(QUANTIZERS)), st.sampled_from([0.0, 20.0]))
def test_clip_never_increases_the_output_error(seed, name, boost):
    q = QUANTIZERS[name]
    x, w = _salient(seed, boost=boost)
    clipped = awq_clip(w, q, hessian(x), AWQ(clip_grid=8))
    assert _err(w, round_to_nearest(clipped, q), x) <= _err(w, round_to_nearest(w, q), x) * (1 + 1e-6)
    assert bool((clipped.abs() <= w.abs()).all())  # only ever shrinks


@pytest.mark.parametrize("name", ["int4_g128", "int4_g32", "nvfp4"])
def test_clip_lowers_the_error_after_awq(name):
    q = QUANTIZERS[name]
    x, w = _salient(6)
    h = hessian(x)
    s = awq_scales([w], [q], h, x.abs().mean(0))
    scaled_h = h / (s[:, None] * s[None, :]).double()  # the Hessian of the inputs divided by s
    clipped = awq_clip(w * s, q, scaled_h)
    assert _err(w, round_to_nearest(clipped, q) / s, x) < 0.95 * _err(w, _awq_weight(w, q, s), x)


def test_bf16_weights_are_rounded_as_the_model_stores_them():
    x, w = _salient(7)
    wb = w.bfloat16()
    clipped = awq_clip(wb, INT4_G32, hessian(x))
    assert clipped.dtype == torch.bfloat16 and not torch.equal(clipped, wb)
    assert _err(wb.float(), round_to_nearest(clipped, INT4_G32).float(), x) <= _err(wb.float(), round_to_nearest(wb, INT4_G32).float(), x)
    # The search rounds the folded weight to the model's dtype before quantizing it, as the model will.
    res = awq_search([wb], [INT4_G32], hessian(x), x.abs().mean(0))
    folded = (wb.float() * res.scales).bfloat16().float()
    want = 2 / x.shape[0] * _err(wb.float(), round_to_nearest(folded, INT4_G32) / res.scales, x)
    assert res.scales.dtype == torch.float32 and res.loss == pytest.approx(want, rel=1e-4)


def _clamp_units(w: torch.Tensor, q, bound: torch.Tensor) -> torch.Tensor:
    """`w` clamped per scale unit to `bound` (unit_amax's shape)."""
    gran, _, block = q.layout()
    if gran is Granularity.BLOCKWISE_1D:
        bound = bound.repeat_interleave(block, -1)
    elif gran is Granularity.BLOCKWISE_2D:
        bound = bound.repeat_interleave(block, -1).repeat_interleave(block, -2)
    return torch.minimum(torch.maximum(w, -bound), bound)


@pytest.mark.parametrize(
    "name", ["int4_g32", "int4_channel", "int8_tensor", "fp8_tensor", "fp8_channel", "fp8_1x128", "fp8_32x32"]
)
def test_clamping_equals_quantizing_with_the_clipped_amax_int_fp8(name):
    q = QUANTIZERS[name]
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(8))
    bound = 0.7 * unit_amax(w, q)
    clamped = _clamp_units(w, q, bound)
    assert torch.equal(unit_amax(clamped, q), bound)  # `max` calibration finds exactly the clipped amax
    assert torch.equal(round_to_nearest(clamped, q), fake_quantize(w, q, amax=bound))


@pytest.mark.parametrize("block_2d", [False, True])
def test_clamping_equals_the_clipped_block_scales_nvfp4(block_2d):
    # Blocks clipped, the tensor amax kept (awq_clip keeps the blocks that hold it): the result
    # equals NVFP4 arithmetic with each block scale from its clipped amax and unclamped elements
    # (beyond the bound they encode 6, as the bound does).
    q = NVFP4Quantizer(block_2d=block_2d)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(9))
    w[0, 0] = 10.0  # the tensor amax, in a block left unclipped
    amax = unit_amax(w, q)
    bound = torch.where(amax == 10.0, amax, 0.6 * amax)
    clamped = _clamp_units(w, q, bound)
    assert torch.equal(unit_amax(clamped, q), bound) and float(tensor_amax(clamped, q)) == 10.0
    s_enc = nvfp4_tensor_scale(torch.tensor(10.0), q)
    s_blk = (torch.div(bound, torch.tensor(6.0)) * s_enc).to(torch.float8_e4m3fn).float()
    s_blk = s_blk.repeat_interleave(16, -1)
    if block_2d:
        s_blk = s_blk.repeat_interleave(16, -2)
    expected = e2m1_decode(e2m1_encode(w * s_enc / s_blk)) * (s_blk / s_enc)
    assert torch.equal(round_to_nearest(clamped, q), expected)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "mxfp4_rceil"])
def test_clamping_rederives_the_clipped_block_scales_mx(name):
    # MX has no static amax: its block scales come from the data, so the clamped weight is the only
    # way to clip, and its scales are those of the clipped amaxes.
    q = QUANTIZERS[name]
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(10))
    bound = 0.6 * unit_amax(w, q)
    clamped = _clamp_units(w, q, bound)
    assert torch.equal(unit_amax(clamped, q), bound)
    # A block holding only its bound gets the scale the MX rule gives that amax.
    probe = torch.zeros_like(w)
    probe[:, ::32] = bound
    assert torch.equal(reference.quantize(clamped, q, None, None)[1], reference.quantize(probe, q, None, None)[1])


def _tiny_llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


LLAMA_DATA = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]


@pytest.mark.parametrize("block", ["self_attn", "mlp"])
def test_output_loss_scores_candidates_by_the_parent_blocks_output_error(monkeypatch, block):
    """`AWQ(loss="output")`: a candidate for q/k/v (gate/up) is scored by the attention's (MLP's)
    output error over every batch with those weights rounded as the fold makes them: recomputed
    here on the float model, and the scales folded are the least-loss candidate's."""
    import copy

    from tqcompile.calibration import awq_output

    model = _tiny_llama()
    float_model = copy.deepcopy(model)
    seen = []  # (consumer names, s, loss) of every candidate scored
    real = awq_output.parent_loss

    def recording(fold, parent, calls, groups):
        fn = real(fold, parent, calls, groups)
        names = sorted(n for n, m in model.named_modules() if any(m is u for u in fold.consumers))

        def loss(s):
            value = fn(s)
            seen.append((names, s.clone(), value))
            return value

        return loss

    monkeypatch.setattr(awq_output, "parent_loss", recording)
    from tqcompile.calibration import smoothing

    monkeypatch.setattr(smoothing, "parent_loss", recording)
    tq.calibrate(model, tq.configs.int4_weight_only(32), lambda m: [m(x) for x in LLAMA_DATA],
                 algorithm=AWQ(loss="output", clip=False, grid=6), progress=False)
    names = {"self_attn": ["q_proj", "k_proj", "v_proj"], "mlp": ["gate_proj", "up_proj"]}[block]
    want = sorted(f"model.layers.0.{block}.{n}" for n in names)
    scored = [(s, v) for n, s, v in seen if n == want]
    assert len(scored) == 7  # the identity and grid=6 candidates
    # The loss recomputed on the float model: layer 0's block on its float inputs, its layers rounded.
    fl = float_model.model.layers[0]
    parent = getattr(fl, block)
    calls = []
    h = parent.register_forward_pre_hook(
        lambda m, a, kw: calls.append((a, {k: None if k == "past_key_values" else v for k, v in kw.items()})), with_kwargs=True
    )
    with torch.no_grad():
        for x in LLAMA_DATA:
            float_model(x)
    h.remove()
    q = tq.IntQuantizer(tq.Format.INT4, tq.Granularity.BLOCKWISE_1D, block_size=32, grid=tq.IntGrid.FULL)
    first = lambda y: y[0] if isinstance(y, tuple) else y  # noqa: E731
    out = lambda: [first(parent(*a, **kw)) for a, kw in calls]  # noqa: E731
    with torch.no_grad():
        ref = out()
        originals = {n: getattr(parent, n).weight.clone() for n in names}
        for s, value in scored:
            for n in names:
                getattr(parent, n).weight.copy_(round_to_nearest(originals[n] * s, q) / s)
            got = out()
            mse = sum(float((g - r).double().pow(2).sum()) for g, r in zip(got, ref)) / sum(r.numel() for r in ref)
            assert mse == pytest.approx(value, rel=1e-5)
    best = min(scored, key=lambda t: t[1])[0]
    norm = "input_layernorm" if block == "self_attn" else "post_attention_layernorm"
    folded = getattr(float_model.model.layers[0], norm).weight / getattr(model.model.layers[0], norm).weight
    torch.testing.assert_close(folded, best, rtol=1e-6, atol=0)


def test_output_loss_is_recorded_and_a_bad_loss_is_refused():
    assert repr(AWQ()) == "AWQ(grid=20, duo_scaling=True, clip=True, clip_grid=20, max_shrink=0.5)"  # as recorded before `loss`
    assert repr(AWQ(loss="output")).endswith("loss='output')")
    with pytest.raises(ValueError, match=r"loss='block'.*allowed: 'hessian', 'output'"):
        AWQ(loss="block")
