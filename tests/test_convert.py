"""`tq.convert` and `tq.nn.conversion_plan`: which layers are swapped, what is kept, what is reported."""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
from torch import nn

import tqcompile as tq
from tqcompile.testing.compile import assert_bitwise_equal
from tqcompile.testing.numerics import sqnr

RECIPE = tq.recipes.fp8_tensorwise()


class ScaledLinear(nn.Linear):
    """A subclass that keeps nn.Linear's forward and adds an attribute and a method."""

    def __init__(self, *args, gain: float = 2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = gain

    def describe(self) -> str:
        return f"ScaledLinear(gain={self.gain})"


class ClampedLinear(nn.Linear):
    """Overrides forward without declaring Linear semantics: convert cannot know what it computes."""

    def forward(self, x):
        return super().forward(x).clamp(-1, 1)


class ResidualLinear(nn.Linear):
    """Overrides forward and declares that it computes through super().forward."""

    tq_linear_semantics = True

    def forward(self, x):
        return super().forward(x) + x


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.scaled = ScaledLinear(128, 64)
        self.clamped = ClampedLinear(64, 64)
        self.residual = ResidualLinear(64, 64, bias=False)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)


def _convert_quietly(model, recipe=RECIPE, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tq.convert(model, recipe, **kwargs)
    return [w for w in caught if issubclass(w.category, tq.nn.ConversionWarning)]


def test_linear_and_subclasses_are_converted():
    model = Block()
    converted_ids = {id(model.up), id(model.scaled)}
    warned = _convert_quietly(model)
    assert isinstance(model.up, tq.nn.Linear) and type(model.up) is tq.nn.Linear
    assert id(model.up) in converted_ids, "converted in place, same object"
    # A subclass becomes a class inheriting from both; its attributes and methods are kept.
    assert isinstance(model.scaled, ScaledLinear) and isinstance(model.scaled, tq.nn.Linear)
    assert model.scaled.gain == 2.0 and model.scaled.describe() == "ScaledLinear(gain=2.0)"
    assert model.scaled.recipe == RECIPE
    assert isinstance(model.residual, ResidualLinear) and isinstance(model.residual, tq.nn.Linear)
    assert not isinstance(model.clamped, tq.nn.Linear) and type(model.clamped) is ClampedLinear
    assert type(model.norm) is nn.LayerNorm
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "left 1 layer(s) in high precision" in message
    assert "clamped (ClampedLinear): ClampedLinear overrides forward" in message and "tq_linear_semantics = True" in message


def test_is_converted_is_the_one_answer():
    class OwnRecipe(nn.Identity):  # a user's module with a `recipe` attribute of its own is not converted
        recipe = "mine"

    model = nn.Sequential(
        nn.Linear(32, 32), nn.TransformerEncoderLayer(32, 2, 64, batch_first=True), OwnRecipe(), nn.Linear(32, 32)
    )
    tq.convert(model, RECIPE, filter_fn=lambda m, fqn: fqn != "3")
    converted = {name for name, m in model.named_modules() if tq.nn.is_converted(m)}
    assert converted == {"0", "1", "1.self_attn", "1.self_attn.out_proj", "1.linear1", "1.linear2"}
    assert all(isinstance(model.get_submodule(n), tq.nn.QuantizedModule) for n in converted)
    assert not tq.nn.is_converted(model[2]) and not tq.nn.is_converted(model[3])
    grouped = tq.nn.GroupedLinear(2, 32, 32, recipe=RECIPE)
    assert tq.nn.is_converted(grouped) and grouped.recipe == RECIPE


def test_converted_subclass_class_is_shared():
    a, b = ScaledLinear(32, 32), ScaledLinear(32, 32)
    tq.convert(a, RECIPE)
    tq.convert(b, RECIPE)
    assert type(a) is type(b) and type(a).__name__ == "QuantizedScaledLinear"


def test_declared_subclass_runs_super_forward_quantized():
    torch.manual_seed(0)
    layer = ResidualLinear(64, 64)
    x = torch.randn(32, 64)
    high_precision = layer(x)
    direct = tq.nn.Linear(64, 64, recipe=RECIPE)
    direct.load_state_dict(layer.state_dict())
    tq.convert(layer, RECIPE)
    out = layer(x)
    # The residual is added in high precision to a quantized GEMM: exactly the direct layer's output plus x.
    assert_bitwise_equal(out, direct(x) + x)
    # And it is quantized: the difference from high precision is a quantization-sized one. Two
    # E4M3 operands give the GEMM an SQNR of 28.5 dB (derived in tests/test_linear_numerics.py; the
    # uniform init of the weight changes the per-operand constant by 0.03 dB), so within the same
    # 1.5 dB margin on both sides: not a high-precision result, not a broken one.
    bias = layer.bias.detach()
    gemm_sqnr = sqnr(high_precision - x - bias, out - x - bias)
    assert 28.5 - 1.5 <= gemm_sqnr <= 28.5 + 1.5


def test_filter_fn_gets_the_fqn():
    model = nn.Sequential(Block(), nn.Sequential(nn.Linear(64, 64)))
    seen = []

    def keep(module, fqn):
        seen.append(fqn)
        return not fqn.endswith("head")

    _convert_quietly(model, filter_fn=keep)
    assert set(seen) == {"0.up", "0.scaled", "0.clamped", "0.residual", "0.head", "1.0"}
    assert isinstance(model[0].up, tq.nn.Linear) and isinstance(model[1][0], tq.nn.Linear)
    assert type(model[0].head) is nn.Linear


def test_layers_the_recipe_cannot_serve_are_skipped_and_reported():
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 100), nn.Linear(100, 128))
    with pytest.warns(tq.nn.ConversionWarning) as record:
        tq.convert(model, tq.recipes.fp8_blockwise())
    assert len(record) == 1
    message = str(record[0].message)
    assert "left 2 layer(s) in high precision" in message
    assert "  2 (Linear): fprop_weight operand of shape (100, 256)" in message and "pad it with 28 zeros to 128" in message
    assert "  3 (Linear): fprop_input operand of shape (128, 100)" in message
    assert isinstance(model[0], tq.nn.Linear)
    assert type(model[2]) is nn.Linear and type(model[3]) is nn.Linear


def test_conversion_plan_reports_without_converting():
    model = Block()
    plan = {p.name: p for p in tq.nn.conversion_plan(model, RECIPE, filter_fn=lambda m, fqn: fqn != "head")}
    assert set(plan) == {"up", "scaled", "clamped", "residual"}
    assert (plan["up"].action, plan["up"].module_type, plan["up"].reason) == ("convert", "Linear", "")
    assert plan["scaled"].action == "convert" and plan["residual"].action == "convert"
    assert plan["clamped"].action == "skip" and "overrides forward" in plan["clamped"].reason
    assert type(model.up) is nn.Linear, "conversion_plan does not convert"
    _convert_quietly(model)
    plan = {p.name: p.action for p in tq.nn.conversion_plan(model, RECIPE)}
    assert plan == {
        "up": "already converted",
        "scaled": "already converted",
        "clamped": "skip",
        "residual": "already converted",
        "head": "already converted",
    }


def test_convert_is_idempotent_with_the_same_recipe():
    model = Block()
    _convert_quietly(model)
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # An equal recipe, not the same object.
    warned = _convert_quietly(model, tq.recipes.fp8_tensorwise())
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert_bitwise_equal(model.state_dict(), state)
    assert len(warned) == 1 and "clamped" in str(warned[0].message)


def test_convert_with_another_recipe_raises():
    model = nn.Sequential(nn.Linear(64, 64))
    tq.convert(model, RECIPE)
    with pytest.raises(
        ValueError,
        match=r"layer '0' is already converted with recipe 'fp8_tensorwise'; converting it again with 'mxfp8' is not supported",
    ):
        tq.convert(model, tq.recipes.mxfp8())
    assert model[0].recipe == RECIPE


def test_convert_a_bare_linear_returns_it():
    layer = nn.Linear(32, 16)
    assert tq.convert(layer, RECIPE) is layer and isinstance(layer, tq.nn.Linear)


def test_state_dicts_load_across_conversion():
    torch.manual_seed(0)
    reference = Block()
    checkpoint = reference.state_dict()
    model = Block()
    _convert_quietly(model)
    assert set(model.state_dict()) == set(checkpoint), "same keys as the unconverted model"
    model.load_state_dict(checkpoint)
    assert_bitwise_equal(model.state_dict(), checkpoint)
    # tq.nn.Linear loads an nn.Linear checkpoint as is, strictly; delayed-scaling histories (persistent,
    # absent from it) start at zeros (tests/test_delayed_scaling.py).
    plain = nn.Linear(64, 32)
    layer = tq.nn.Linear(64, 32, recipe=tq.recipes.fp8_delayed(8))
    layer.load_state_dict(plain.state_dict())
    assert_bitwise_equal({k: layer.state_dict()[k] for k in ("weight", "bias")}, plain.state_dict())


def test_converted_model_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    tq.convert(model, tq.recipes.mxfp8())
    x = torch.randn(32, 64)
    model(x).pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_hooks_registered_before_conversion_still_fire():
    layer = ScaledLinear(32, 16)
    calls = []
    layer.register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    tq.convert(layer, RECIPE)
    layer(torch.randn(4, 32))
    assert calls == ["QuantizedScaledLinear"]


def test_registered_converter_reports_unsupported_modules_before_converting_any():
    """A converter's `unsupported_reason` is asked during planning: refused modules are skipped and
    reported, and nothing is half converted because a converter raised midway."""

    class Custom(nn.Module):
        def __init__(self, ok: bool):
            super().__init__()
            self.ok = ok
            self.converted_with = None

    calls = []

    @tq.nn.register_converter(Custom, unsupported_reason=lambda m, r: None if m.ok else "this one is not ok")
    def _convert(module, recipe):
        calls.append(module)
        module.converted_with = recipe.name

    model = nn.Sequential(Custom(ok=True), Custom(ok=False))
    plan = tq.nn.conversion_plan(model, tq.recipes.mxfp8())
    assert [(p.name, p.action, p.reason) for p in plan] == [("0", "convert", ""), ("1", "skip", "this one is not ok")]
    with pytest.warns(tq.nn.ConversionWarning, match=r"1 \(Custom\): this one is not ok"):
        tq.convert(model, tq.recipes.mxfp8())
    assert calls == [model[0]] and model[0].converted_with == "mxfp8" and model[1].converted_with is None


def test_model_with_converted_subclasses_pickles_and_saves(tmp_path):
    """The class made for a converted subclass (QuantizedScaledLinear) cannot be found by name, so
    pickling names the two classes it is made of; before, pickle failed with `attribute lookup failed`."""
    import io
    import pickle

    torch.manual_seed(0)
    model = Block()
    _convert_quietly(model, tq.recipes.fp8_delayed(4))
    x = torch.randn(8, 64)
    expected = model.head(model.residual(model.scaled(model.up(x))))
    for restored in (pickle.loads(pickle.dumps(model)), pickle.loads(pickle.dumps(model, protocol=0))):
        assert type(restored.scaled) is type(model.scaled) and type(restored.residual) is type(model.residual)
        assert restored.scaled.gain == 2.0 and restored.scaled.recipe == model.scaled.recipe
        assert_bitwise_equal(restored.state_dict(), model.state_dict())
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert type(loaded.scaled).__name__ == "QuantizedScaledLinear" and isinstance(loaded.scaled, ScaledLinear)
    # The delayed-scaling histories travel with the pickled module.
    assert_bitwise_equal(loaded.scaled.amax_history_input, model.scaled.amax_history_input)
    assert_bitwise_equal(loaded.head(loaded.residual(loaded.scaled(loaded.up(x)))), expected)
    # The state_dict holds only tensors: it loads with weights_only=True, into a fresh converted model.
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = Block()
    _convert_quietly(fresh, tq.recipes.fp8_delayed(4))  # the histories are in the state_dict
    fresh.load_state_dict(state)
    assert_bitwise_equal(fresh.state_dict(), model.state_dict())


def test_lazy_linear_is_skipped_until_materialised():
    """A LazyLinear's in_features is known only after its first forward; converting it before used
    to be planned, then crashed in forward. It is skipped with the fix, and converts once materialised."""
    model = nn.Sequential(nn.LazyLinear(64), nn.GELU(), nn.Linear(64, 32))
    with pytest.warns(tq.nn.ConversionWarning) as record:
        tq.convert(model, RECIPE)
    message = str(record[0].message)
    assert "left 1 layer(s) in high precision" in message
    assert "0 (LazyLinear): LazyLinear has uninitialized (lazy) parameters" in message
    assert "run one forward first (it then becomes a Linear), then convert" in message
    assert isinstance(model[2], tq.nn.Linear) and not isinstance(model[0], tq.nn.Linear)
    x = torch.randn(16, 48)
    model(x).sum().backward()  # runs (the lazy layer materialises in high precision)
    assert type(model[0]) is nn.Linear and model[0].in_features == 48
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tq.convert(model, RECIPE)
    assert type(model[0]) is tq.nn.Linear
    model(x).sum().backward()


class TiedLM(nn.Module):
    """An embedding whose weight the output head shares (tied embeddings, as in GPT-2 and Llama)."""

    def __init__(self):
        super().__init__()
        self.embed, self.body, self.lm_head = nn.Embedding(64, 32), nn.Linear(32, 32, bias=False), nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(self.body(self.embed(tokens)))


def test_fsdp_quantized_all_gather_keeps_tied_weights_tied():
    # Wrapping the head's weight in a QuantizedWeight made it a new Parameter: the embedding kept
    # training its own copy, and an FSDP2 run (where this wrapping is the default) drifted from the
    # one-process run (1.4% in loss after 3 AdamW steps of a tied Llama-style model).
    model = TiedLM()
    with pytest.warns(tq.distributed.QuantizedAllGatherWarning, match=r"'lm_head'.*shared with embed\.weight"):
        tq.convert(model, RECIPE, fsdp_quantized_all_gather=True)
    assert model.lm_head.weight is model.embed.weight
    assert len(list(model.parameters())) == 2
    assert isinstance(model.lm_head, tq.nn.Linear)  # its GEMMs still run quantized
    assert isinstance(model.body.weight.data, tq.distributed.QuantizedWeight)  # untied weights still gather quantized
    # One module registered under two names is not a tie: it still gathers quantized.
    shared = nn.Linear(32, 32)
    aliased = nn.ModuleDict({"a": shared, "b": shared})
    with warnings.catch_warnings():
        warnings.simplefilter("error", tq.distributed.QuantizedAllGatherWarning)
        tq.convert(aliased, RECIPE, fsdp_quantized_all_gather=True)
    assert isinstance(aliased["b"].weight.data, tq.distributed.QuantizedWeight)


def test_convert_after_fully_shard_names_the_layer_and_the_order(tmp_path):
    # Sharding first made the first forward fail inside FSDP2's lazy init with
    # "'QuantizedWeight' object has no attribute '_local_tensor'", which names neither the layer nor the fix.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(
            ValueError, match=r"layer '0' is already sharded: its weight is a DTensor.*Convert the unsharded model first"
        ):
            tq.convert(model, RECIPE)
        assert not any(isinstance(m, tq.nn.Linear) for m in model.modules())  # nothing converted
    finally:
        dist.destroy_process_group()
