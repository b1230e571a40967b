"""`tq.Recipe` as a value object, its validation, and the training layer's errors for bad input.

Every error test checks the message: it must name the bad value and say what is allowed or what to do.
"""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest
import torch

import tqcompile as tq

G = tq.Granularity
NAMES = list(tq.recipes.RECIPES)
FP8 = tq.Float8Quantizer()


@pytest.mark.parametrize("name", NAMES)
def test_named_recipe_is_a_value(name):
    recipe = tq.recipes.get(name)
    assert isinstance(recipe, tq.Recipe)
    assert recipe.name == name
    again = tq.recipes.RECIPES[name]()
    assert again == recipe and again is not recipe and hash(again) == hash(recipe)
    assert len({recipe, again}) == 1
    code, names = recipe.__fx_repr__()
    assert all(isinstance(v, type) for v in names.values()), "__fx_repr__ must name classes only (no modules)"
    assert eval(code, dict(names)) == recipe
    assert pickle.loads(pickle.dumps(recipe)) == recipe
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.fprop_input = FP8


def test_recipes_differ_by_value():
    recipes = [tq.recipes.get(n) for n in NAMES]
    assert len(set(recipes)) == len(recipes)
    assert tq.recipes.fp8_delayed(8) != tq.recipes.fp8_delayed(16)
    changed = dataclasses.replace(tq.recipes.mxfp8(), wgrad_grad=None, wgrad_input=None)
    assert changed != tq.recipes.mxfp8() and changed.wgrad_grad is None


def test_nvfp4_round_to_nearest_gradients():
    """`nvfp4(stochastic_rounding=False)`: only the two gradient quantizers change, and the name says so."""
    sr, rne = tq.recipes.nvfp4(), tq.recipes.nvfp4(stochastic_rounding=False)
    assert rne.name == "nvfp4_rne" and rne != sr
    assert sr.dgrad_grad.stochastic_rounding and sr.wgrad_grad.stochastic_rounding
    assert not rne.dgrad_grad.stochastic_rounding and not rne.wgrad_grad.stochastic_rounding
    same = ("fprop_input", "fprop_weight", "dgrad_weight", "wgrad_input")
    assert all(getattr(rne, f) == getattr(sr, f) for f in same)
    assert rne.wgrad_grad.hadamard
    x = torch.randn(64, 64)
    y1, y2 = (tq.nn.Linear(64, 64, recipe=rne) for _ in range(2))
    y2.load_state_dict(y1.state_dict())
    g = [torch.autograd.grad(m(x).square().sum(), m.weight)[0] for m in (y1, y2)]
    assert torch.equal(g[0], g[1])  # deterministic: no random draw in the gradient


def test_recipe_loads_with_weights_only():
    import io

    buf = io.BytesIO()
    torch.save({"recipe": tq.recipes.nvfp4()}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["recipe"] == tq.recipes.nvfp4()


def test_unknown_recipe_name():
    with pytest.raises(ValueError, match=r"unknown recipe 'fp9'; allowed: fp8_tensorwise, .*nvfp4"):
        tq.recipes.get("fp9")


def test_unknown_recipe_key_names_it_and_the_allowed():
    """`RECIPES["fp8"]` raised a bare KeyError('fp8')."""
    with pytest.raises(KeyError, match=r"^unknown recipe 'fp8'; allowed: fp8_tensorwise, .*nvfp4, fp8_delayed"):
        tq.recipes.RECIPES["fp8"]
    assert "fp8" not in tq.recipes.RECIPES and tq.recipes.RECIPES.get("fp8") is None
    assert tq.recipes.RECIPES["mxfp8"]() == tq.recipes.mxfp8()


# ---------------------------------------------------------------------------------------------
# Invalid recipes
# ---------------------------------------------------------------------------------------------
def test_non_quantizer_field():
    with pytest.raises(ValueError, match=r"Recipe 'bad': dgrad_grad=torch.float8_e5m2 is not allowed; allowed: a tq.Quantizer$"):
        tq.Recipe("bad", FP8, FP8, torch.float8_e5m2, FP8)
    with pytest.raises(ValueError, match=r"fprop_weight=None is not allowed; allowed: a tq.Quantizer$"):
        tq.Recipe("bad", FP8, None, FP8, FP8)
    # wgrad fields may be None, but not any other non-quantizer.
    with pytest.raises(ValueError, match=r"wgrad_input='e4m3' is not allowed; allowed: a tq.Quantizer or None \(high-precision wgrad\)"):
        tq.Recipe("bad", FP8, FP8, FP8, FP8, FP8, "e4m3")


@pytest.mark.parametrize("which", ["wgrad_grad", "wgrad_input"])
def test_only_one_wgrad_field_none(which):
    with pytest.raises(ValueError, match="wgrad_grad and wgrad_input must both be quantizers or both None"):
        dataclasses.replace(tq.recipes.fp8_rowwise(), **{which: None})


def test_mismatched_hadamard_in_one_gemm():
    base = tq.recipes.nvfp4()
    with pytest.raises(ValueError, match=r"wgrad_grad=NVFP4Quantizer\(.*hadamard=True.*\) and wgrad_input=.* operands of one GEMM.*same hadamard_seed"):
        dataclasses.replace(base, wgrad_input=tq.NVFP4Quantizer())
    with pytest.raises(ValueError, match="same hadamard_seed"):
        dataclasses.replace(base, wgrad_input=tq.NVFP4Quantizer(hadamard=True, hadamard_seed=1))
    with pytest.raises(ValueError, match=r"fprop_input=.* and fprop_weight=.* are operands of one GEMM"):
        dataclasses.replace(base, fprop_input=tq.NVFP4Quantizer(hadamard=True))
    # Both operands of one GEMM with the same transform is fine (it cancels in the product).
    both = dataclasses.replace(base, fprop_input=tq.NVFP4Quantizer(hadamard=True), fprop_weight=tq.NVFP4Quantizer(block_2d=True, hadamard=True))
    assert both.fprop_input.hadamard


@pytest.mark.parametrize(
    "quantizer",
    [tq.Float8Quantizer(granularity=G.ROWWISE), tq.Float8Quantizer(granularity=G.BLOCKWISE_1D), tq.MXQuantizer(), tq.NVFP4Quantizer()],
    ids=["rowwise", "1x128", "mx", "nvfp4"],
)
def test_delayed_scaling_needs_tensorwise_fp8(quantizer):
    with pytest.raises(ValueError, match=r"delayed scaling \(amax_history_len=4\) needs tensorwise Float8Quantizers; fprop_input="):
        tq.Recipe("bad", quantizer, quantizer, quantizer, quantizer, amax_history_len=4)


@pytest.mark.parametrize("length", [-1, 2.0, "16"])
def test_bad_history_length(length):
    with pytest.raises(ValueError, match=re.escape(f"amax_history_len={length!r}; allowed: an int >= 0")):
        dataclasses.replace(tq.recipes.fp8_tensorwise(), amax_history_len=length)


# ---------------------------------------------------------------------------------------------
# Bad input to the training layer
# ---------------------------------------------------------------------------------------------
def test_shape_the_recipe_cannot_serve_names_the_padding():
    with pytest.raises(
        ValueError,
        match=r"tq.nn.Linear: recipe 'fp8_blockwise' cannot serve in_features=100, out_features=128: .*"
        r"is 100, not a multiple of the block size 128; pad it with 28 zeros to 128",
    ):
        tq.nn.Linear(100, 128, recipe=tq.recipes.fp8_blockwise())
    with pytest.raises(ValueError, match=r"out_features=40: .*is 40, not a multiple of the block size 16; pad it with 8 zeros to 48"):
        tq.nn.Linear(64, 40, recipe=tq.recipes.nvfp4())
    with pytest.raises(ValueError, match=r"tq.nn.GroupedLinear: recipe 'mxfp8' cannot serve in_features=48.*pad it with 16 zeros to 64"):
        tq.nn.GroupedLinear(2, 48, 64, recipe=tq.recipes.mxfp8())


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_input_dtype_not_supported(dtype):
    layer = tq.nn.Linear(32, 16, recipe=tq.recipes.fp8_tensorwise())
    with pytest.raises(TypeError, match=rf"input dtype {dtype} is not supported; allowed: torch.float32, torch.bfloat16, torch.float16"):
        layer(torch.ones(4, 32).to(dtype))


def test_weight_dtype_not_supported():
    layer = tq.nn.Linear(32, 16, recipe=tq.recipes.fp8_tensorwise(), dtype=torch.float64)
    with pytest.raises(TypeError, match=r"x.dtype=torch.float64 is not supported; allowed: .*cast first"):
        layer(torch.ones(4, 32))


def test_quantizer_passed_as_recipe():
    q = tq.Float8Quantizer()
    msg = r"recipe must be a tq.Recipe \(e.g. tq.recipes\..*\), got Float8Quantizer"
    with pytest.raises(TypeError, match="tq.nn.Linear: " + msg):
        tq.nn.Linear(32, 16, recipe=q)
    with pytest.raises(TypeError, match="tq.nn.GroupedLinear: " + msg):
        tq.nn.GroupedLinear(2, 32, 16, recipe=q)
    with pytest.raises(TypeError, match="linear: " + msg):
        tq.nn.linear(torch.ones(4, 32), torch.ones(16, 32), None, q)
    with pytest.raises(TypeError, match="tq.convert: " + msg):
        tq.convert(torch.nn.Linear(32, 16), q)
    with pytest.raises(TypeError, match=r"recipe must be a tq.Recipe .*got str"):
        tq.nn.Linear(32, 16, recipe="mxfp8")


def test_in_features_mismatch():
    layer = tq.nn.Linear(32, 16, recipe=tq.recipes.fp8_tensorwise())
    with pytest.raises(ValueError, match="input last dim 48 does not match weight in_features 32"):
        layer(torch.ones(4, 48))


def test_delayed_recipe_without_histories():
    with pytest.raises(ValueError, match="recipe 'fp8_delayed' uses delayed scaling; pass amax_histories"):
        tq.nn.linear(torch.ones(4, 32), torch.ones(16, 32), None, tq.recipes.fp8_delayed())


@pytest.mark.parametrize(
    ("name", "tokens", "block", "padded"),
    [("fp8_blockwise", 100, 128, 128), ("mxfp8", 40, 32, 64), ("nvfp4", 40, 16, 48)],
)
def test_token_count_the_blocks_do_not_divide(name, tokens, block, padded):
    """The token count is known only at run time: the wgrad operands are blocked along it."""
    layer = tq.nn.Linear(128, 128, recipe=tq.recipes.get(name))
    x = torch.randn(tokens, 128, requires_grad=True)
    with pytest.raises(
        ValueError,
        match=rf"shape \(128, {tokens}\).* is {tokens}, not a multiple of the block size {block}; pad it with {padded - tokens} zeros to {padded}",
    ):
        layer(x).sum().backward()


def test_token_count_needs_no_blocks_for_rowwise_recipes():
    layer = tq.nn.Linear(128, 64, recipe=tq.recipes.fp8_rowwise())
    x = torch.randn(3, 7, 128, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad.shape == x.shape and layer.weight.grad.shape == (64, 128)


def test_grouped_linear_bad_input():
    experts = tq.nn.GroupedLinear(2, 32, 16, recipe=tq.recipes.fp8_tensorwise())
    with pytest.raises(ValueError, match=r"expected x of shape \(2, tokens, 32\) or m_splits, got \(3, 4, 32\)"):
        experts(torch.ones(3, 4, 32))
    with pytest.raises(ValueError, match=r"m_splits=\[1, 2\] must have 2 entries summing to x.shape\[0\]=4"):
        experts(torch.ones(4, 32), m_splits=[1, 2])
    with pytest.raises(ValueError, match="num_experts=0; allowed: an int >= 1"):
        tq.nn.GroupedLinear(0, 32, 16, recipe=tq.recipes.fp8_tensorwise())
    two_d = dataclasses.replace(tq.recipes.fp8_blockwise(), fprop_input=tq.recipes.fp8_blockwise().fprop_weight)
    with pytest.raises(ValueError, match="2-D blocks on a token operand would mix tokens of different experts"):
        tq.nn.GroupedLinear(2, 128, 128, recipe=two_d)
