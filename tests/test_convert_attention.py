"""`tq.convert` on torch's attention layers: nn.MultiheadAttention gets a quantized forward with
nn.MultiheadAttention's semantics, TransformerEncoderLayer loses its fast path, and a layer whose
parent reads its weight directly is skipped when the parent is not converted."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile.nn.attention import _mha_forward
from tqcompile.testing.compile import assert_bitwise_equal
from tqcompile.testing.numerics import sqnr

RECIPE = tq.recipes.fp8_tensorwise()
E, H = 64, 4


def _float_projection(x, weight, bias, slot):
    return F.linear(x, weight, bias)


def _inputs(batch_first: bool, unbatched: bool, lengths: tuple[int, int], dims: tuple[int, int, int], same: str, batch: int = 3):
    """query, key, value; `same`: "qkv" (self-attention, one tensor), "kv" (key is value) or "" (all different)."""

    def make(n, d):
        if unbatched:
            return torch.randn(n, d)
        return torch.randn(batch, n, d) if batch_first else torch.randn(n, batch, d)

    tgt_len, src_len = lengths
    q = make(tgt_len, dims[0])
    if same == "qkv":
        return q, q, q
    k = make(src_len, dims[1])
    return (q, k, k) if same == "kv" else (q, k, make(src_len, dims[2]))


# (MHA kwargs, forward case): a spread over every option nn.MultiheadAttention.forward has.
CASES = [
    (dict(), dict(same="qkv", need_weights=True)),
    (dict(batch_first=True), dict(same="qkv", need_weights=False, attn_mask="causal")),
    (dict(batch_first=True), dict(same="qkv", need_weights=True, attn_mask="causal_hint")),
    (dict(bias=False), dict(same="kv", need_weights=True, average=False, attn_mask="bool")),
    (dict(kdim=40, vdim=24, batch_first=True), dict(same="", need_weights=False, key_padding_mask="bool")),
    (dict(kdim=40, vdim=24), dict(same="", need_weights=True, key_padding_mask="float", attn_mask="float3d")),
    (dict(add_bias_kv=True), dict(same="qkv", need_weights=False, attn_mask="bool", key_padding_mask="bool")),
    (dict(add_zero_attn=True, batch_first=True), dict(same="", need_weights=True, key_padding_mask="bool")),
    (dict(add_bias_kv=True, add_zero_attn=True, kdim=40, vdim=40), dict(same="kv", need_weights=False, attn_mask="float3d")),
    (dict(), dict(same="qkv", need_weights=True, unbatched=True, attn_mask="float3d", key_padding_mask="bool")),
    (dict(batch_first=True), dict(same="", need_weights=False, unbatched=True, key_padding_mask="float")),
]


def _case(mha_kwargs, case, seed=0):
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, **mha_kwargs)
    if mha.bias_k is not None:
        nn.init.normal_(mha.bias_k)
        nn.init.normal_(mha.bias_v)
    unbatched = case.get("unbatched", False)
    same = case["same"]
    tgt_len, src_len = 16, (16 if same == "qkv" else 24)
    q, k, v = _inputs(mha.batch_first, unbatched, (tgt_len, src_len), (E, mha.kdim, mha.vdim), same)
    b = 1 if unbatched else 3
    kwargs = dict(need_weights=case["need_weights"], average_attn_weights=case.get("average", True))
    mask = case.get("attn_mask")
    if mask in ("causal", "causal_hint"):
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(tgt_len)
        kwargs["is_causal"] = mask == "causal"
    elif mask == "bool":
        kwargs["attn_mask"] = torch.rand(tgt_len, src_len) < 0.3
        kwargs["attn_mask"][:, 0] = False  # every query keeps one key
    elif mask == "float3d":
        kwargs["attn_mask"] = torch.randn(b * H, tgt_len, src_len)
    kpm = case.get("key_padding_mask")
    if kpm is not None:
        padded = torch.zeros(b, src_len, dtype=torch.bool)
        padded[:, -5:] = True
        if kpm == "float":
            padded = torch.zeros(b, src_len).masked_fill(padded, -1e4)
        if kpm == "bool" and mask is not None and mask != "bool":
            padded = torch.zeros(b, src_len).masked_fill(padded, float("-inf"))  # torch wants matching mask types
        kwargs["key_padding_mask"] = padded[0] if unbatched else padded
    return mha, (q, k, v), kwargs


def _call(forward, q, k, v, kwargs):
    return forward(
        q,
        k,
        v,
        kwargs.get("key_padding_mask"),
        kwargs["need_weights"],
        kwargs.get("attn_mask"),
        kwargs["average_attn_weights"],
        kwargs.get("is_causal", False),
    )


@pytest.mark.parametrize("mha_kwargs,case", CASES)
def test_attention_semantics_match_torch(mha_kwargs, case):
    """The quantized forward's attention, with float projections, is nn.MultiheadAttention's: same
    output and attention weights for every option, in training (dropout 0) and in eval + no_grad."""
    mha, (q, k, v), kwargs = _case(mha_kwargs, case)
    for train in (True, False):
        mha.train(train)
        with torch.set_grad_enabled(train):
            expected = mha(q, k, v, **kwargs)
            got = _mha_forward(mha, q, k, v, *_call(lambda *a: a, q, k, v, kwargs)[3:], _float_projection)
        torch.testing.assert_close(got[0], expected[0], atol=2e-5, rtol=1e-4)
        if kwargs["need_weights"]:
            torch.testing.assert_close(got[1], expected[1], atol=2e-6, rtol=1e-4)
        else:
            assert got[1] is None and expected[1] is None


# SQNR of a converted MHA's output against the float one, fp8_tensorwise. Each projection is a
# GEMM of two E4M3 operands, 28.5 dB (tests/test_linear_numerics.py). The attention output carries
# v's noise and, through the softmax, q's and k's (about 27 dB); the output projection adds its own
# 28.5 dB: 10*log10(1 / (10**-2.7 + 10**-2.85)) = 24.7 dB. Measured over the cases below and 5
# seeds: 22.8 to 26.2 dB (how much the q/k noise moves the softmax depends on the masks and on how
# sharp the scores are). The band is 24.5 +- 2 dB: quantized (a float path gives > 100 dB), not broken.
MHA_SQNR, MARGIN = 24.5, 2.0


@pytest.mark.parametrize("mha_kwargs,case", CASES[:9])
def test_converted_mha_is_quantized_and_trains(mha_kwargs, case):
    mha, (q, k, v), kwargs = _case(mha_kwargs, case)
    reference = copy.deepcopy(mha)
    tq.convert(mha, RECIPE)
    assert type(mha).__name__ == "QuantizedMultiheadAttention" and isinstance(mha.out_proj, tq.nn.Linear)
    assert set(mha.state_dict()) == set(reference.state_dict()), "same state_dict keys"
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, weights = mha(q, k, v, **kwargs)
    expected, expected_weights = reference(q, k, v, **kwargs)
    assert MHA_SQNR - MARGIN <= sqnr(expected, out) <= MHA_SQNR + MARGIN
    if kwargs["need_weights"]:
        assert weights.shape == expected_weights.shape and sqnr(expected_weights, weights) > 20
    out.square().mean().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_mha_with_delayed_scaling_keeps_fp32_histories_per_projection():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    # out_proj stays nn.Linear here: this checks the histories the attention layer itself owns.
    tq.convert(mha, tq.recipes.fp8_delayed(4), filter_fn=lambda m, fqn: fqn != "out_proj")
    x = torch.randn(2, 16, E)
    mha(x, x, x)[0].sum().backward()
    assert mha.amax_history_in_proj_input[0] == x.abs().max() and mha.amax_history_in_proj_weight[0] > 0
    assert not mha.amax_history_q_input.any(), "self-attention runs one packed GEMM"
    y = torch.randn(2, 8, E)
    mha(y, x, x)[0].sum().backward()  # cross-attention: one GEMM per projection, each with its history
    assert mha.amax_history_q_input[0] == y.abs().max() and mha.amax_history_k_input[0] == x.abs().max()
    assert "amax_history_q_input" in mha.state_dict(), "persistent (tests/test_delayed_scaling.py)"
    mha.to(torch.bfloat16)
    assert mha.in_proj_weight.dtype == torch.bfloat16 and mha.amax_history_q_input.dtype == torch.float32
    assert mha.amax_history_q_input[0] == y.abs().max(), "kept, not rounded through bf16"
    out = mha(x.bfloat16(), x.bfloat16(), x.bfloat16())[0]
    assert out.dtype == torch.bfloat16


class SaysHello(nn.MultiheadAttention):
    """A subclass that keeps nn.MultiheadAttention's forward."""

    def hello(self) -> str:
        return f"hello from {self.num_heads} heads"


class ScaledAttention(nn.MultiheadAttention):
    def forward(self, query, key, value, **kwargs):
        out, weights = super().forward(query, key, value, **kwargs)
        return 2 * out, weights


def test_mha_subclasses_convert_or_are_skipped_and_pickle():
    model = nn.ModuleDict({"hello": SaysHello(E, H), "scaled": ScaledAttention(E, H)})
    with pytest.warns(tq.nn.ConversionWarning) as record:
        tq.convert(model, RECIPE)
    message = str(record[0].message)
    assert "left 2 layer(s) in high precision" in message
    assert "scaled (ScaledAttention): ScaledAttention overrides forward" in message
    assert "scaled.out_proj (NonDynamicallyQuantizableLinear): scaled (ScaledAttention) is not converted" in message
    assert "reads its weight directly: nn.MultiheadAttention.forward reads out_proj.weight" in message
    assert type(model.hello).__name__ == "QuantizedSaysHello" and model.hello.hello() == "hello from 4 heads"
    assert isinstance(model.hello.out_proj, tq.nn.Linear) and not isinstance(model.scaled.out_proj, tq.nn.Linear)
    x = torch.randn(8, 2, E)
    restored = pickle.loads(pickle.dumps(model))
    assert type(restored.hello) is type(model.hello) and type(restored.hello.out_proj) is type(model.hello.out_proj)
    assert_bitwise_equal(restored.hello(x, x, x), model.hello(x, x, x))


def test_a_child_whose_parent_reads_its_weight_is_skipped_with_the_parent():
    """Filtering out (or failing to convert) a module that reads its children's weights skips those
    children too: converted, they would never run."""
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, 128, batch_first=True), num_layers=2, enable_nested_tensor=False
    )
    plan = {p.name: p for p in tq.nn.conversion_plan(model, RECIPE, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))}
    assert {p.action for p in plan.values()} == {"skip"} and set(plan) == {
        f"layers.{i}.{c}" for i in range(2) for c in ("self_attn.out_proj", "linear1", "linear2")
    }
    assert plan["layers.0.linear1"].reason == (
        "layers.0 (TransformerEncoderLayer) is not converted (filter_fn excluded it) and reads its weight directly: "
        "its inference fast path (eval() under no_grad) passes it to torch._transformer_encoder_layer_fwd"
    )
    assert plan["layers.1.self_attn.out_proj"].reason.startswith("layers.1.self_attn (MultiheadAttention) is not converted")
    # Keeping one layer whole in high precision by name leaves the other converted.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tq.convert(model, RECIPE, filter_fn=lambda m, fqn: not fqn.startswith("layers.1"))
    assert type(model.layers[0]).__name__ == "QuantizedTransformerEncoderLayer" and isinstance(
        model.layers[0].linear1, tq.nn.Linear
    )
    assert type(model.layers[1]) is nn.TransformerEncoderLayer and type(model.layers[1].linear1) is nn.Linear
    # An encoder layer with nothing converted under it is not listed: there is nothing to adapt.
    plan = tq.nn.conversion_plan(nn.TransformerEncoderLayer(48, H, 100), tq.recipes.mxfp8())  # no multiple of 32
    assert [(p.name, p.action) for p in plan] == [
        ("self_attn", "skip"),
        ("self_attn.out_proj", "skip"),
        ("linear1", "skip"),
        ("linear2", "skip"),
    ]
    plan = tq.nn.conversion_plan(nn.TransformerEncoderLayer(E, H, 100), tq.recipes.mxfp8())  # self_attn converts
    assert [(p.name, p.action) for p in plan] == [
        ("", "convert"),
        ("self_attn", "convert"),
        ("self_attn.out_proj", "convert"),
        ("linear1", "skip"),
        ("linear2", "skip"),
    ]


# torch's own note, once per process, when its encoder fast path builds a nested tensor (the float
# reference here does, on purpose); a warn-once cannot be asserted reliably, so it is ignored here only.
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_encoder_nested_tensor_path_is_turned_off():
    """In eval + no_grad with a padding mask nn.TransformerEncoder packs the batch into a nested
    tensor; a converted encoder takes the padded batch instead and matches the float model to FP8 precision."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 128, batch_first=True), num_layers=2).eval()
    assert model.use_nested_tensor
    reference = copy.deepcopy(model)
    tq.convert(model, RECIPE)
    assert not model.use_nested_tensor and reference.use_nested_tensor
    src = torch.randn(3, 16, E)
    kpm = torch.zeros(3, 16, dtype=torch.bool)
    kpm[0, -6:] = True
    with torch.no_grad():
        out, expected = model(src, src_key_padding_mask=kpm), reference(src, src_key_padding_mask=kpm)
    keep = ~kpm  # torch's nested path returns zeros at padded positions
    assert sqnr(expected[keep], out[keep]) > 20
    with pytest.raises(ValueError, match="nested tensor input is not supported"):
        model.layers[0](torch.nested.nested_tensor([torch.randn(4, E), torch.randn(6, E)]))


def test_converted_mha_applies_dropout_only_in_training():
    torch.manual_seed(0)
    mha = tq.convert(nn.MultiheadAttention(E, H, dropout=0.5, batch_first=True), RECIPE)
    x = torch.randn(2, 16, E)
    for need_weights in (False, True):
        mha.eval()
        assert_bitwise_equal(mha(x, x, x, need_weights=need_weights)[0], mha(x, x, x, need_weights=need_weights)[0])
        mha.train()
        torch.manual_seed(1)
        first = mha(x, x, x, need_weights=need_weights)[0]
        torch.manual_seed(2)
        assert not torch.equal(first, mha(x, x, x, need_weights=need_weights)[0])
        torch.manual_seed(1)
        assert_bitwise_equal(first, mha(x, x, x, need_weights=need_weights)[0])


def test_converting_transformer_layers_again_is_a_no_op_or_refused():
    model = nn.Sequential(nn.TransformerEncoderLayer(E, H, 128), nn.TransformerDecoderLayer(E, H, 128))
    tq.convert(model, RECIPE)
    classes = {name: type(m) for name, m in model.named_modules()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tq.convert(model, tq.recipes.fp8_tensorwise())
    assert {name: type(m) for name, m in model.named_modules()} == classes
    plan = {p.name: p.action for p in tq.nn.conversion_plan(model, RECIPE)}
    assert plan["0"] == plan["0.self_attn"] == plan["1.multihead_attn"] == plan["1.linear2"] == "already converted"
    assert "1" not in plan, "a decoder layer has no fast path: nothing to convert"
    with pytest.raises(ValueError, match="layer '0' is already converted with recipe 'fp8_tensorwise'"):
        tq.convert(model, tq.recipes.mxfp8())
    restored = pickle.loads(pickle.dumps(model.eval()))
    assert {name: type(m) for name, m in restored.named_modules()} == classes
    x = torch.randn(8, 2, E)
    with torch.no_grad():
        assert_bitwise_equal(restored[0](x), model[0](x))


def test_mha_histories_start_at_zero_after_meta_initialisation():
    """Converted on the meta device and materialised with `to_empty`, the histories the attention
    layer owns are zeros, not uninitialised memory."""
    with torch.device("meta"):
        mha = nn.MultiheadAttention(E, H, batch_first=True)
    tq.convert(mha, tq.recipes.fp8_delayed(4), filter_fn=lambda m, fqn: fqn != "out_proj")
    assert mha.amax_history_in_proj_input.is_meta
    mha.to_empty(device="cpu")
    histories = {n: b for n, b in mha.named_buffers() if n.startswith("amax_history_")}
    assert len(histories) == 12 and all(b.dtype == torch.float32 and not b.any() for b in histories.values())
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_(0, 0.1)
        for b in histories.values():
            b.fill_(7.0)
    mha._reset_parameters()
    assert not any(getattr(mha, n).any() for n in histories), "reset_parameters starts the histories over"
