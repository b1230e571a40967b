"""FSDP2 with quantized all-gather, across two CPU processes over gloo, against one process.

One spawn runs every check (starting processes, importing torch and compiling are the slow part).
Each rank runs the single-process reference itself (same seeds: it is deterministic) and asserts
what it can alone; results both ranks must agree on are saved and compared by the test. Every
check of one rank runs under one gloo timeout, the spawn under a join deadline, so nothing hangs;
a rank that fails writes its traceback and the test fails at once.

Checks:
- planted outlier: the gathered weight equals `tq.quantize` of the whole weight, bit for bit, on
  both ranks, for each weight quantizer family (scales reduced over the shard group);
- parity: a few AdamW steps of the demo GPT with FSDP2=2 (the same full batch on both ranks) give
  exactly the single-process losses, for every recipe (reshard_after_forward True, and False for
  the recipes whose forward and backward gather different usages);
- MixedPrecisionPolicy(bf16): equal to FSDP2's own bf16 high-precision gather; uneven shards (dim 0
  not divisible by 2): equal to one process;
- bytes on the wire (a wrapper around the all-gather collective): per recipe against bf16;
- precompute_scales: bit-identical losses, and the all-gather hooks then run no collective;
- HSDP (replicate x shard mesh): the amax group is the shard dimension's;
- compile: blocks compiled with fullgraph=True, then sharded: no graph break, no recompile;
- DCP: FSDP2=2 -> one process and one process -> FSDP2=2, bit for bit; a checkpoint of another
  recipe gives a clear error;
- bad input: an amax group this rank is not in; ranks converted with different recipes; a shard that would cut 128x128 blocks (the
  layer is gathered in high precision with a warning naming it; checked with the parity).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tqcompile as tq
from tqcompile.demo.model import GPT, GPTConfig, is_quantized_layer
from tqcompile.testing import run_checks, run_ranks
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal

WORLD = 2
JOIN_DEADLINE_S = 400
CFG = GPTConfig(n_layer=1, d_model=128, n_head=4, mlp_hidden=512, seq_len=128)
STEPS = 3
# Recipes whose forward and backward gather different usages (scales along K only): they also run
# with reshard_after_forward=False, where one gather serves both passes.
TWO_USAGE = ("mxfp8", "fp8_rowwise")
BYTES_LIMIT = {"fp8_tensorwise": 0.55, "fp8_rowwise": 0.55, "fp8_blockwise": 0.55, "mxfp8": 0.55, "nvfp4": 0.30}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (1, CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _gpt(recipe: tq.Recipe, quantized_all_gather: bool = True) -> GPT:
    torch.manual_seed(0)
    return tq.convert(GPT(CFG), recipe, filter_fn=is_quantized_layer, fsdp_quantized_all_gather=quantized_all_gather)


def _train(model: nn.Module, forward=None, steps: int = STEPS, after_step=None) -> list[float]:
    """AdamW steps on one fixed batch (the same on every rank). foreach=False: the per-tensor
    update is the same code for a plain and a sharded parameter. Reseeds torch's generator, from
    which NVFP4's stochastic rounding draws."""
    x, y = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    forward = forward or model
    torch.manual_seed(2)
    if after_step is not None:
        after_step(model)
    losses = []
    for _ in range(steps):
        loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(model)
        losses.append(loss.item())
    return losses


def _shard_gpt(model: GPT, **kwargs) -> GPT:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _check_planted_outlier(rank: int, results: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    for name in ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4"):
        torch.manual_seed(0)
        layer = nn.Linear(128, 256, bias=False)
        with torch.no_grad():
            layer.weight[200, 3] = 100.0  # rank 1's shard (rows 128..255)
        full = layer.weight.detach().clone()
        tq.convert(layer, tq.recipes.get(name))
        assert isinstance(layer.weight.data, tq.distributed.QuantizedWeight), type(layer.weight.data)
        fully_shard(layer, reshard_after_forward=False)
        layer.unshard()
        gathered = layer.weight
        assert isinstance(gathered, tq.QuantizedTensor), type(gathered)
        assert gathered.amax_group_name == dist.group.WORLD.group_name
        # Cloned: reshard() frees the storage of the gathered tensors.
        results[f"outlier_{name}"] = ({n: getattr(gathered, n).clone() for n in gathered.__tensor_flatten__()[0]}, full)
        layer.reshard()


def _check_parity(rank: int, results: dict) -> None:
    for name in tq.recipes.RECIPES:
        recipe = tq.recipes.get(name)
        reference = _train(_gpt(recipe))
        for reshard in (True, False) if name in TWO_USAGE else (True,):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", tq.distributed.QuantizedAllGatherWarning)
                losses = _train(_shard_gpt(_gpt(recipe), reshard_after_forward=reshard))
            assert losses == reference, (name, reshard, losses, reference)
            cut = [str(w.message) for w in caught if issubclass(w.category, tq.distributed.QuantizedAllGatherWarning)]
            if name == "fp8_blockwise":
                # d_model 128 sharded 2 ways gives 64-row shards: 128x128 blocks would be cut, so
                # those layers are gathered in high precision, with a warning naming them.
                assert any("'blocks.0.attn.proj'" in m and "128x128" in m and "multiple of 256" in m for m in cut), cut
                assert not any("blocks.0.mlp.fc'" in m for m in cut), cut  # 512 rows: 256-row shards keep blocks whole
            else:
                assert not cut, cut
        results[f"parity_{name}"] = reference


def _mlp(recipe: tq.Recipe, hidden: int, quantized_all_gather: bool, d: int = 128) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, hidden, bias=False), nn.GELU(), nn.Linear(hidden, d, bias=False))
    return tq.convert(model, recipe, fsdp_quantized_all_gather=quantized_all_gather)


def _train_mlp(model: nn.Module, steps: int = STEPS) -> list[float]:
    g = torch.Generator().manual_seed(3)
    d = model[0].in_features
    x, y = torch.randn(128, d, generator=g), torch.randn(128, d, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _shard_mlp(model: nn.Sequential, **kwargs) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0], **kwargs)
    fully_shard(model[2], **kwargs)
    fully_shard(model, **kwargs)
    return model


def _check_mixed_precision_and_uneven(rank: int, results: dict) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for name in ("fp8_tensorwise", "fp8_rowwise", "mxfp8"):
        recipe = tq.recipes.get(name)
        # bf16 parameters on the wire: the quantized gather of the bf16 shard equals gathering bf16
        # and quantizing after, bit for bit.
        hp = _train_mlp(_shard_mlp(_mlp(recipe, 256, False), mp_policy=bf16))
        quantized = _train_mlp(_shard_mlp(_mlp(recipe, 256, True), mp_policy=bf16))
        assert quantized == hp, (name, quantized, hp)
    for name in ("fp8_tensorwise", "fp8_rowwise"):
        # 131 rows over 2 ranks: shards of 66 and 65 rows (the second padded).
        recipe = tq.recipes.get(name)
        reference = _train_mlp(_mlp(recipe, 131, True))
        for reshard in (True, False):
            losses = _train_mlp(_shard_mlp(_mlp(recipe, 131, True), reshard_after_forward=reshard))
            assert losses == reference, (name, reshard, losses, reference)


@contextlib.contextmanager
def _count_all_gather_bytes():
    """Count the bytes each rank contributes to FSDP2's all-gathers, by wrapping the collective it
    calls (`dist.all_gather_single` in torch 2.13, `dist.all_gather_into_tensor` before)."""
    counted = {"bytes": 0, "calls": 0}
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def wrap(original):
        def counting(output, input, *args, **kwargs):
            counted["bytes"] += input.numel() * input.element_size()
            counted["calls"] += 1
            return original(output, input, *args, **kwargs)

        return counting

    for n in names:
        setattr(dist, n, wrap(originals[n]))
    try:
        yield counted
    finally:
        for n in names:
            setattr(dist, n, originals[n])


def _check_bytes(rank: int, results: dict) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    ratios = {}
    for name, limit in BYTES_LIMIT.items():
        recipe = tq.recipes.get(name)
        per_mode = {}
        for quantized in (False, True):
            # 256 x 256 weights: 128-row shards keep every block whole (128x128 included).
            model = _shard_mlp(_mlp(recipe, 256, quantized, d=256), mp_policy=bf16)
            _train_mlp(model, steps=1)  # the first step sets up FSDP's buffers; count the second
            with _count_all_gather_bytes() as counted:
                _train_mlp(model, steps=1)
            assert counted["calls"] > 0, "no all-gather was counted"
            per_mode[quantized] = counted["bytes"]
        ratios[name] = per_mode[True] / per_mode[False]
        assert ratios[name] <= limit, (name, ratios[name], per_mode)
    results["bytes_ratio"] = ratios


def _check_precompute(rank: int, results: dict) -> None:
    from tqcompile.distributed import fsdp_amax, precompute

    calls = {"n": 0}
    original = fsdp_amax.all_reduce_amax
    modules = (fsdp_amax, precompute)  # the all-gathers' and precompute_scales' reductions

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    for name in ("fp8_tensorwise", "fp8_rowwise", "nvfp4", "fp8_delayed"):
        recipe = tq.recipes.get(name)
        plain = results[f"parity_{name}"]  # what FSDP2 without precompute_scales gave (= one process)
        model = _shard_gpt(_gpt(recipe))
        for module in modules:
            module.all_reduce_amax = counting
        try:
            calls["n"] = 0
            precomputed = _train(model, after_step=tq.distributed.precompute_scales)
        finally:
            for module in modules:
                module.all_reduce_amax = original
        assert precomputed == plain, (name, precomputed, plain)
        # One all-reduce per precompute_scales call (one shard group), none in the all-gathers.
        assert calls["n"] == STEPS + 1, (name, calls["n"])


def _check_hsdp(rank: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard"))
    recipe = tq.recipes.fp8_tensorwise()
    reference = _train(_gpt(recipe))
    model = _shard_gpt(_gpt(recipe), mesh=mesh, reshard_after_forward=False)
    assert _train(model) == reference
    model.blocks[0].unshard()
    weight = model.blocks[0].attn.qkv.weight
    assert isinstance(weight, tq.QuantizedTensor), type(weight)
    assert weight.amax_group_name == mesh["shard"].get_group().group_name
    model.blocks[0].reshard()


def _check_bad_input(rank: int, results: dict) -> None:
    # An amax group this rank is not in (new_group(ranks=[0]) gives rank 1 NON_GROUP_MEMBER).
    only_rank0 = dist.new_group(ranks=[0])
    if rank == 1:
        with pytest.raises(ValueError, match="not a member of the process group"):
            tq.nn.Linear(128, 128, recipe=tq.recipes.fp8_tensorwise(), amax_group=only_rank0)
    # Ranks that converted with different recipes: every rank raises at the first gather (no hang).
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layer = tq.convert(nn.Sequential(nn.Linear(128, 256, bias=False)), tq.recipes.get(("fp8_tensorwise", "mxfp8")[rank]))
    fully_shard(layer)
    with pytest.raises(
        ValueError, match=r"layer '0': the ranks of the group disagree .*recipe: rank 0 has 'fp8_tensorwise' .*rank 1 has 'mxfp8'"
    ):
        layer(torch.randn(32, 128))


def _check_compile(rank: int, results: dict) -> None:
    counts = {}
    for name in ("fp8_tensorwise", "mxfp8"):
        recipe = tq.recipes.get(name)
        reference = _train(_gpt(recipe))
        torch.compiler.reset()
        counter = CompileCounter("aot_eager")
        model = _gpt(recipe)
        # The torchtitan order: compile each block with fullgraph=True, then shard it.
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=counter, fullgraph=True)
        losses = _train(_shard_gpt(model))
        assert counter.graph_breaks == 0, counter.break_reasons
        assert counter.frame_count == len(model.blocks) and counter.recompiles == 0, counter
        assert losses == reference, (name, losses, reference)
        counts[name] = (counter.frame_count, counter.recompiles, counter.graph_breaks)
    results["compile_counts"] = counts


def _check_checkpoint(rank: int, results: dict, out_dir: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)  # whole tensors on every rank
    recipe = tq.recipes.fp8_tensorwise()
    # FSDP2=2 -> files (loaded into one process by the test).
    model = _shard_gpt(_gpt(recipe))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    x, y = _data()
    model(x, y).backward()
    opt.step()
    tq.distributed.checkpoint.save(model, opt, out_dir / "from_fsdp")
    results["saved_model"] = get_model_state_dict(model, options=full)
    results["saved_optim"] = get_optimizer_state_dict(model, opt, options=full)

    # One process (written by the test before the spawn) -> FSDP2=2.
    model = _shard_gpt(_gpt(recipe))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    tq.distributed.checkpoint.load(model, opt, out_dir / "single")
    results["loaded_model"] = get_model_state_dict(model, options=full)
    results["loaded_optim"] = get_optimizer_state_dict(model, opt, options=full)

    other = _shard_gpt(_gpt(tq.recipes.mxfp8()))
    with pytest.raises(tq.distributed.checkpoint.CheckpointMismatchError, match=r"layer 'blocks.0.attn.qkv': checkpoint recipe"):
        tq.distributed.checkpoint.load(other, None, out_dir / "single")


def _rank_checks(rank: int, out_dir: str) -> None:
    out = Path(out_dir)
    results: dict = {}

    def run(check: str) -> None:
        fn = globals()[f"_check_{check}"]
        fn(rank, results, out) if check == "checkpoint" else fn(rank, results)

    results["timings"] = run_checks(rank, [(check, lambda c=check: run(c)) for check in CHECKS])["timings"]
    torch.save(results, out / f"rank{rank}.pt")


def _single_process_checkpoint(path: Path) -> tuple[dict, dict]:
    """A trained one-process model and optimizer, saved for the ranks to load (no process group:
    `tq.convert` leaves the weights plain here)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _gpt(tq.recipes.fp8_tensorwise(), quantized_all_gather=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    torch.manual_seed(5)
    x, y = _data()
    for _ in range(2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    tq.distributed.checkpoint.save(model, opt, path)
    return get_model_state_dict(model), get_optimizer_state_dict(model, opt)


CHECKS = [
    "planted_outlier",
    "parity",
    "mixed_precision_and_uneven",
    "bytes",
    "precompute",
    "hsdp",
    "bad_input",
    "compile",
    "checkpoint",
]


def test_fsdp2_quantized_all_gather(tmp_path):
    single_model, single_optim = _single_process_checkpoint(tmp_path / "single")
    ranks = run_ranks(_rank_checks, WORLD, tmp_path, deadline_s=JOIN_DEADLINE_S, timeout_s=90)

    # Planted outlier: each rank's gathered weight is the one-process quantization of the whole weight.
    for name in ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4"):
        q = tq.recipes.get(name).fprop_weight
        for r, res in enumerate(ranks):
            inner, full = res[f"outlier_{name}"]
            expected = tq.quantize(full, q, rowwise=True, columnwise=True)
            assert_bitwise_equal(inner, {n: getattr(expected, n) for n in expected.__tensor_flatten__()[0]}, f"rank {r} {name}")
    # The parity references are the same computation on both ranks.
    for name in tq.recipes.RECIPES:
        assert ranks[0][f"parity_{name}"] == ranks[1][f"parity_{name}"]
    assert ranks[0]["bytes_ratio"] == ranks[1]["bytes_ratio"]
    assert ranks[0]["compile_counts"] == {"fp8_tensorwise": (1, 0, 0), "mxfp8": (1, 0, 0)}

    # DCP, FSDP2=2 -> one process: the saved sharded state comes back whole, bit for bit.
    model = _gpt(tq.recipes.fp8_tensorwise(), quantized_all_gather=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    tq.distributed.checkpoint.load(model, opt, tmp_path / "from_fsdp")
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    assert_bitwise_equal(get_model_state_dict(model), ranks[0]["saved_model"])
    assert_bitwise_equal(get_optimizer_state_dict(model, opt), ranks[0]["saved_optim"])
    # One process -> FSDP2=2.
    for res in ranks:
        assert_bitwise_equal(res["loaded_model"], single_model)
        assert_bitwise_equal(res["loaded_optim"], single_optim)
    print(
        "per-check seconds (rank 0):",
        {k: round(v, 1) for k, v in ranks[0]["timings"].items()},
        "bytes ratio:",
        ranks[0]["bytes_ratio"],
    )
