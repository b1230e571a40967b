"""`tq.distributed.QuantizedWeight` in one process: transparent outside FSDP2 (the multi-process
behaviour is in tests/distributed/test_fsdp_gloo.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tqcompile as tq
from tqcompile.distributed.fsdp_layout import _transpose_payload
from tqcompile.testing.compile import assert_bitwise_equal


def _model(recipe: tq.Recipe, wrap: bool) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    return tq.convert(model, recipe, fsdp_quantized_all_gather=wrap)


def _train(model: torch.nn.Module, precompute: bool = False) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g)
    losses = []
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            tq.distributed.precompute_scales(model)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["fp8_tensorwise", "mxfp8", "fp8_delayed"])
def test_wrapped_weights_train_like_plain_ones(name):
    recipe = tq.recipes.get(name)
    wrapped = _model(recipe, True)
    assert isinstance(wrapped[0].weight.data, tq.distributed.QuantizedWeight)
    assert not isinstance(_model(recipe, False)[0].weight.data, tq.distributed.QuantizedWeight)
    assert _train(wrapped, precompute=True) == _train(_model(recipe, False))
    # Optimizer state and the weights' math are plain tensors; the parameter keeps its wrapper.
    assert isinstance(wrapped[0].weight.data, tq.distributed.QuantizedWeight)


def test_state_dict_saves_plain_tensors(tmp_path):
    model = _model(tq.recipes.fp8_tensorwise(), True)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert type(loaded["0.weight"]) is torch.Tensor
    assert torch.equal(loaded["0.weight"], model[0].weight._tensor)
    other = _model(tq.recipes.fp8_tensorwise(), True)
    with torch.no_grad():
        other[0].weight.mul_(2)
    other.load_state_dict(loaded)
    assert isinstance(other[0].weight.data, tq.distributed.QuantizedWeight)
    assert torch.equal(other[0].weight._tensor, model[0].weight._tensor)


def test_recipes_that_cannot_gather_quantized_stay_plain():
    for name in tq.recipes.RECIPES:
        assert tq.distributed.quantized_all_gather_reason(tq.recipes.get(name)) is None, name
    base = tq.recipes.fp8_tensorwise()
    mixed = dataclasses.replace(base, name="mixed", dgrad_weight=tq.Float8Quantizer(granularity=tq.Granularity.ROWWISE))
    assert "different weight quantizers" in tq.distributed.quantized_all_gather_reason(mixed)
    assert not isinstance(_model(mixed, True)[0].weight.data, tq.distributed.QuantizedWeight)


@pytest.mark.parametrize(
    "quantizer",
    [
        tq.Float8Quantizer(),
        tq.Float8Quantizer(granularity=tq.Granularity.BLOCKWISE_2D, block_size=16),
        tq.NVFP4Quantizer(block_2d=True),
    ],
)
def test_local_transpose_is_the_columnwise_usage(quantizer):
    # What the FSDP2 gather derives locally instead of gathering it: bit for bit the columnwise usage.
    x = torch.randn(64, 96) * torch.logspace(-3, 3, 96)
    q = tq.quantize(x, quantizer, rowwise=True, columnwise=True)
    assert_bitwise_equal(_transpose_payload(q._data, quantizer), q._data_t)
    assert_bitwise_equal(q._scale_inv.t().contiguous(), q._scale_inv_t)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


@pytest.mark.parametrize(
    "quantizer, transpose, byte_transpose",
    [
        (tq.Float8Quantizer(), True, True),
        (tq.IntQuantizer(), True, True),
        (tq.IntQuantizer(format=tq.Format.INT4), True, False),  # two elements a byte: repacked, not byte-transposed
        (tq.Float8Quantizer(granularity=tq.Granularity.BLOCKWISE_2D, block_size=16), True, False),  # scale grid transposes
        (tq.NVFP4Quantizer(block_2d=True), True, False),
        (tq.NVFP4Quantizer(block_2d=True, hadamard=True), False, False),  # transformed along the last dim
        (tq.Float8Quantizer(granularity=tq.Granularity.ROWWISE), False, False),
        (tq.MXQuantizer(), False, False),
    ],
)
def test_the_two_transpose_questions_say_what_quantize_does(quantizer, transpose, byte_transpose):
    # FSDP2's gather derives dgrad's usage where `columnwise_is_transpose` (transposing scales and
    # repacking nibbles); tensor parallelism where `columnwise_is_byte_transpose` (bytes only, the
    # same scale tensor). Each answer must be what quantizing the columnwise usage really gives.
    assert quantizer.columnwise_is_transpose() is transpose
    assert quantizer.columnwise_is_byte_transpose() is byte_transpose
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 96)
    q = tq.quantize(x, quantizer, rowwise=True, columnwise=True)
    derived = _same_bytes(_transpose_payload(q._data, quantizer), q._data_t) and _same_bytes(q._scale_inv.t(), q._scale_inv_t)
    assert derived is transpose
    byte_copied = _same_bytes(q._data.view(torch.uint8).t(), q._data_t) and _same_bytes(q._scale_inv, q._scale_inv_t)
    assert byte_copied is byte_transpose


def test_quantized_tensor_as_strided_identity_and_is_pinned():
    q = tq.quantize(torch.randn(32, 64), tq.MXQuantizer())
    same = torch.as_strided(q, (32, 64), (64, 1), 0)
    assert isinstance(same, tq.QuantizedTensor) and same._data.data_ptr() == q._data.data_ptr()
    with pytest.raises(NotImplementedError, match="as_strided only as the identity"):
        torch.as_strided(q, (16, 64), (64, 1), 0)
    assert q.is_pinned() is False


def test_dcp_round_trip_of_a_quantized_tensor(tmp_path):
    # torch.distributed.checkpoint asks is_pinned before it copies a tensor; it then saves the
    # inner tensors (flatten) and loads into a QuantizedTensor of the same quantizer, in place.
    import torch.distributed.checkpoint as dcp

    q = tq.quantize(torch.randn(64, 64), tq.MXQuantizer(), columnwise=True)
    # One process, on purpose: DCP says it assumed so (torch 2.13 warns even when told no_dist=True).
    with pytest.warns(UserWarning, match="assuming the intent is to save in a single process"):
        dcp.save({"q": q}, checkpoint_id=tmp_path)
    state = {"q": tq.quantize(torch.zeros(64, 64), tq.MXQuantizer(), columnwise=True)}
    with pytest.warns(UserWarning, match="assuming the intent is to load in a single process"):
        dcp.load(state, checkpoint_id=tmp_path)
    assert isinstance(state["q"], tq.QuantizedTensor)
    assert_bitwise_equal(
        {n: getattr(state["q"], n) for n in ("_data", "_scale_inv", "_data_t", "_scale_inv_t")},
        {n: getattr(q, n) for n in ("_data", "_scale_inv", "_data_t", "_scale_inv_t")},
    )


def test_enable_quantized_all_gather_keeps_a_tied_weight_plain():
    """Called directly with `model`, it refuses to wrap a weight another module shares (wrapping would
    untie it: the new Parameter would train apart from the embedding's)."""
    emb = torch.nn.Embedding(256, 128)
    head = tq.nn.Linear(128, 256, bias=False, recipe=tq.recipes.mxfp8())
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    with pytest.warns(tq.distributed.QuantizedAllGatherWarning, match=r"layer '1': its weight is shared with 0\.weight"):
        assert not tq.distributed.enable_quantized_all_gather(head, "1", model=model)
    assert head.weight is emb.weight
    untied = tq.nn.Linear(128, 256, bias=False, recipe=tq.recipes.mxfp8())
    assert tq.distributed.enable_quantized_all_gather(untied, "2", model=torch.nn.Sequential(emb, untied))
    assert isinstance(untied.weight, tq.distributed.QuantizedWeight)
