"""HSDP with a real replicate dimension, and QAT under FSDP2, on four CPU processes over gloo.

tests/distributed/test_fsdp_gloo.py checks HSDP on a (1, 2) mesh only, where the replicate dimension
does nothing. Here the mesh is (2 replicas, 2 shards): the amax of a weight must be reduced over
its shard group (2 ranks), not the world, and the two replicas must compute the one-process
losses bit for bit, with and without `precompute_scales`. A calibrated (QAT) model sharded with
the stock `fully_shard` over four ranks, its blocks compiled with fullgraph=True first, must
also train exactly as in one process, with no graph break. The wrong order (fully_shard, then
tq.calibrate or tq.restore) raises an error naming the module and the order, and so does torch's
own ColwiseParallel on a converted layer (naming tqcompile's styles). One spawn runs every check.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile.testing import CompileCounter, run_checks

WORLD = 4
STEPS = 3


class _Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def _train(model: nn.Module, precompute: bool = False) -> list[float]:
    x, y = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            tq.distributed.precompute_scales(model)
        losses.append(loss.item())
    return losses


def _converted(recipe: str, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return tq.convert(_Net(), tq.recipes.get(recipe), filter_fn=lambda m, fqn: fqn != "head", **kwargs)


def _calibrated(config: str) -> nn.Module:
    torch.manual_seed(0)
    model = _Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tq.calibration.CalibrationWarning)  # the head stays off
        tq.calibrate(model, getattr(tq.configs, config)(), lambda m: m(_data()[0]), progress=False)
    return model


def _check_hsdp() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for recipe in ("fp8_tensorwise", "mxfp8", "nvfp4"):
        reference = _train(_converted(recipe, fsdp_quantized_all_gather=False))
        for precompute in (False, True):
            model = _converted(recipe)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            results["hsdp", recipe, precompute] = (_train(model, precompute), reference)
        model.blocks[0].unshard()
        weight = model.blocks[0].up.weight
        results["hsdp group", recipe] = (type(weight).__name__, weight.amax_group_name, mesh["shard"].get_group().group_name)
        model.blocks[0].reshard()
    return results


def _check_qat_fsdp4() -> dict:
    from torch.distributed.fsdp import fully_shard

    results = {}
    for config in ("int8", "nvfp4"):
        reference = _train(_calibrated(config))
        model = _calibrated(config)
        counter = CompileCounter("aot_eager")
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=counter, fullgraph=True)
            fully_shard(model.blocks[i])
        fully_shard(model)
        results["qat", config] = (_train(model), reference, counter.graph_breaks, counter.frame_count)
    return results


def _check_quantize_after_shard_refused() -> None:
    from torch.distributed.fsdp import fully_shard

    # Calibrating or restoring after fully_shard used to fail at the first forward inside DTensor
    # dispatch ("tqcompile.quantize.default got mixed torch.Tensor and DTensor").
    state = tq.quant_state(_calibrated("int8"))
    for who, quantize in (
        ("tq.calibrate", lambda m: tq.calibrate(m, tq.configs.int8(), lambda mm: mm(_data()[0]), progress=False)),
        ("tq.restore", lambda m: tq.restore(m, state)),
    ):
        torch.manual_seed(0)
        model = _Net()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        with pytest.raises(ValueError, match=rf"{who}: module 'blocks.0.norm' is already sharded: its weight is a DTensor"):
            quantize(model)
        assert not any(isinstance(m, tq.calibration.FakeQuantModule) for m in model.modules()), who  # unchanged


def _check_torch_tp_style_refused() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    # torch's own TP style on a converted layer used to fail in DTensor dispatch ("Operator
    # tqcompile.amax.default does not have a sharding strategy registered").
    layer = tq.convert(nn.Sequential(nn.Linear(64, 128)), tq.recipes.fp8_tensorwise(), fsdp_quantized_all_gather=False)
    parallelize_module(layer, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",)), {"0": ColwiseParallel()})
    with pytest.raises(
        TypeError, match=r"recipe 'fp8_tensorwise'\): its weight is a DTensor placed \(Shard\(dim=0\),\) on a mesh of 4"
    ):
        layer(torch.randn(8, 64))


def _checks(rank: int, out_dir: str) -> None:
    done = run_checks(
        rank,
        [
            ("hsdp", _check_hsdp),
            ("qat_fsdp4", _check_qat_fsdp4),
            ("quantize_after_shard_refused", _check_quantize_after_shard_refused),
            ("torch_tp_style_refused", _check_torch_tp_style_refused),
        ],
    )
    torch.save({**done["hsdp"], **done["qat_fsdp4"]}, f"{out_dir}/rank{rank}.pt")


def test_hsdp_2x2_and_qat_fsdp4_equal_one_process(tmp_path):
    ranks = tq.testing.run_ranks(functools.partial(_checks), WORLD, tmp_path, deadline_s=400)  # 126 s measured at load ~28 on 2 cores
    for rank, results in enumerate(ranks):
        for key, value in results.items():
            if key[0] == "hsdp":
                assert value[0] == value[1], (rank, key, value)
            elif key[0] == "hsdp group":
                kind, group, shard_group = value
                assert kind == "QuantizedTensor", (rank, key, kind)
                assert group == shard_group, (rank, key, group, shard_group)
            else:
                losses, reference, breaks, frames = value
                assert losses == reference, (rank, key, losses, reference)
                # One graph per block at most (the second block's input requires grad), no break.
                assert breaks == 0 and frames <= 2, (rank, key, breaks, frames)
