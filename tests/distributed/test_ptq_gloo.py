"""PTQ on two CPU ranks over gloo: distributed calibration, SyncBatchNorm/DDP orders, and an
expert-parallel checkpoint with torch.distributed.checkpoint.

One spawn runs every rank-side check (starting processes is the slow part); each rank saves what
it produced and the test compares, in this process, the ranks with each other and with
single-process runs built the other way:

1. distributed calibration: each rank calibrates on different data with ``amax_groups=[WORLD]``;
   every rank ends with the amaxes a single process gets on the union of the data (max, and
   percentile whose histograms are summed), with one collective per reduction, not per batch;
2. orders: quantize -> convert_sync_batchnorm; convert_sync_batchnorm -> quantize; DDP (on CPU
   DDP refuses SyncBatchNorm, so DDP wraps the BatchNorm model) -> quantize. Each state restores
   into a single-process model built another way: same keys, same summary rows, same outputs;
4. weight transforms (SmoothQuant then GPTQ), data-parallel: Hessians and channel maxima reduced,
   so every rank rounds the same weights, those of one process on the union of the data;
3. expert parallelism: each rank holds 2 of 4 experts; `tq.quant_state(model, expert_mesh=...)`
   (no collective) is saved with DCP, and loads bit for bit with EP=2 (on the ranks) and EP=1
   (here, one process);
5. the integer schemes (issue 28) on tiny Hugging Face models, data-parallel: GPTQ W4 g128 on the
   FULL grid, asymmetric W4 g32 with GPTQ and AWQ, INT3 g32 round to nearest and GPTQ, INT2 g32
   GPTQ, W8A8 dynamic and static with SmoothQuant (and GPTQ), FP8 KV cache with W4 GPTQ, on a
   2-layer Llama (the second decoder layer replayed on cached inputs) and a 2-layer Qwen3-MoE
   (per-expert Hessians and input amaxes; one whose rank 0 routes no token to some experts):
   every rank ends with the weights, amaxes and zero points of one process on the union of the
   data, and the checkpoint the ranks export together equals that process's export byte for byte;
6. the reduction of statistics: a tensor larger than a bucket is reduced in place (no copy);
7. `tq.quantize_checkpoint(..., data=mine, amax_groups=[WORLD])` from float checkpoints on disk
   (three of the cases of 5.): rank 0 writes and reports, rank 1 returns None, and the files equal
   those of the case's `tq.calibrate` + export and of one process on the union, byte for byte; a
   call one rank refuses (the writer's `out`, the other's data) raises on every rank, before any
   calibration.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

import tqcompile as tq
from tqcompile.testing import run_checks, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_models import tiny_hf_moe  # noqa: E402

WORLD_SIZE = 2
JOIN_TIMEOUT_S = 400  # 44 s measured at load ~28 on 2 cores before the integer schemes (5.); they made the spawn ~2.9x longer (13 -> 37 s at load ~10)
EXPERTS, LOCAL_EXPERTS, D, H = 4, 2, 32, 64


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return self.fc(F.relu(self.bn2(self.conv2(x))).mean((2, 3)))


def _cnn() -> CNN:
    torch.manual_seed(0)
    return CNN().eval()


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(2, 3, 8, 8, generator=g) * (1.0 + 2.0 * rank) for _ in range(3)]


def _tokens(expert: int) -> torch.Tensor:
    return torch.randn(6, D, generator=torch.Generator().manual_seed(50 + expert)) * (1.0 + expert)


def _experts(n: int, first: int) -> tq.nn.GroupedLinear:
    full = tq.nn.GroupedLinear(EXPERTS, D, H, recipe=tq.recipes.fp8_tensorwise())
    torch.manual_seed(1)
    full.reset_parameters()
    local = tq.nn.GroupedLinear(n, D, H, recipe=tq.recipes.fp8_tensorwise())
    with torch.no_grad():
        local.weight.copy_(full.weight[first : first + n])
    return local


TEST_IMAGES = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(99))
CONFIG = tq.configs.int8()


def _loop(batches):
    return lambda m: [m(x) for x in batches]


def _record(model) -> dict:
    with torch.no_grad():
        out = model(TEST_IMAGES)
    return {"state": tq.quant_state(model), "rows": tq.summary(model).rows, "out": out, "weights": model.state_dict()}


def _check_max_then_sync(rank: int, world, results: dict, out_dir: str) -> None:
    # 1 + 2a. quantize (distributed max calibration), then convert_sync_batchnorm.
    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(kwargs.get("op"))
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        a = tq.calibrate(_cnn(), CONFIG, _loop(_batches(rank)), amax_groups=[world], progress=False)
    finally:
        dist.all_reduce = all_reduce
    results["max_collectives"] = len(calls)  # 3 batches; one for the activations, one for the weights
    results["quantize_then_sync"] = _record(nn.SyncBatchNorm.convert_sync_batchnorm(a))


def _check_sync_then_max(rank: int, world, results: dict, out_dir: str) -> None:
    # 2b. convert_sync_batchnorm, then quantize (SyncBatchNorm runs on CPU in eval mode).
    b = nn.SyncBatchNorm.convert_sync_batchnorm(_cnn())
    results["sync_then_quantize"] = _record(tq.calibrate(b, CONFIG, _loop(_batches(rank)), amax_groups=[world], progress=False))


def _check_ddp_then_max(rank: int, world, results: dict, out_dir: str) -> None:
    # 2c. DDP (module.-prefixed names), then quantize.
    d = nn.parallel.DistributedDataParallel(_cnn())
    results["ddp_then_quantize"] = _record(tq.calibrate(d, CONFIG, _loop(_batches(rank)), amax_groups=[world], progress=False))


def _check_percentile(rank: int, world, results: dict, out_dir: str) -> None:
    # 1'. percentile: histograms summed over the group.
    p = tq.calibrate(
        _cnn(), CONFIG, _loop(_batches(rank)), algorithm="percentile", percentile=99.0, amax_groups=[world], progress=False
    )
    results["percentile"] = tq.quant_state(p)


def _check_data_parallel_moe(rank: int, world, results: dict, out_dir: str) -> None:
    # 1''. data-parallel MoE: each rank routes no token to a different expert; after the reduction
    #      every expert has an amax from the other rank's tokens (no idle-expert fallback, no warning).
    splits = [[6, 0, 6, 6], [6, 6, 0, 6]][rank]
    dp_moe = _experts(EXPERTS, 0)
    local_tokens = torch.cat([_tokens(e) * (1 + rank) for e, n in enumerate(splits) if n])
    with warnings.catch_warnings():
        warnings.simplefilter("error", tq.calibration.CalibrationWarning)
        tq.calibrate(dp_moe, tq.configs.fp8(), lambda m: m(local_tokens, splits), amax_groups=[world], progress=False)
    results["dp_moe_input_amax"] = dp_moe.input_quantizer.amax


def _check_expert_parallel(rank: int, world, results: dict, out_dir: str) -> None:
    # 3. expert parallelism: this rank's 2 experts, calibrated on the tokens routed to them.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    first = rank * LOCAL_EXPERTS
    moe = _experts(LOCAL_EXPERTS, first)
    tokens = [_tokens(first + i) for i in range(LOCAL_EXPERTS)]
    tq.calibrate(moe, tq.configs.fp8(), lambda m: m(torch.cat(tokens), [6] * LOCAL_EXPERTS), progress=False)
    banned = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "gather",
        "scatter",
        "barrier",
        "reduce_scatter_tensor",
    )
    saved_fns = {n: getattr(dist, n) for n in banned}

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran while building the checkpoint state")

    for n in banned:
        setattr(dist, n, no_collective)
    try:
        state = tq.quant_state(moe, expert_mesh=mesh)  # the traversal's input: built with no collective
    finally:
        for n, fn in saved_fns.items():
            setattr(dist, n, fn)
    from torch.distributed.tensor import DTensor, Shard

    weights = {"weight": DTensor.from_local(moe.weight.detach(), mesh, [Shard(0)], run_check=False)}
    dcp.save({"quant": state, "model": weights}, checkpoint_id=f"{out_dir}/ep_ckpt")
    # EP=2 load into a freshly built local model.
    fresh = tq.calibration.prepare(_experts(LOCAL_EXPERTS, first), tq.configs.fp8())
    dcp.load({"quant": tq.quant_state(fresh, expert_mesh=mesh)}, checkpoint_id=f"{out_dir}/ep_ckpt")
    with torch.no_grad():
        results["ep_out"] = moe(torch.cat(tokens), [6] * LOCAL_EXPERTS)
        results["ep_reloaded_out"] = fresh(torch.cat(tokens), [6] * LOCAL_EXPERTS)
    results["ep_amax"] = {s: getattr(moe, f"{s}_quantizer").amax for s in ("input", "weight")}
    results["ep_reloaded_amax"] = {s: getattr(fresh, f"{s}_quantizer").amax for s in ("input", "weight")}


class _NormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(self.norm(x))))


def _norm_mlp() -> _NormMLP:
    torch.manual_seed(2)
    return _NormMLP().eval()


def _mlp_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(30 + rank)
    return [torch.randn(16, D, generator=g) * (1.0 + rank) + torch.arange(D) / D for _ in range(3)]


TRANSFORMS = ("smoothquant", "gptq")


def _check_transforms_data_parallel(rank: int, world, results: dict, out_dir: str) -> None:
    # 4. SmoothQuant + GPTQ: statistics (Hessians, channel maxima) reduced over the ranks; a
    #    data-parallel MoE whose ranks each miss a different expert: every expert gets a Hessian.
    m = tq.calibrate(_norm_mlp(), CONFIG, _loop(_mlp_batches(rank)), algorithm=TRANSFORMS, amax_groups=[world], progress=False)
    results["transforms"] = {"weights": m.state_dict(), "state": tq.quant_state(m)}
    splits = [[6, 0, 6, 6], [6, 6, 0, 6]][rank]
    moe = _experts(EXPERTS, 0)
    local_tokens = torch.cat([_tokens(e) * (1 + rank) for e, n in enumerate(splits) if n])
    with warnings.catch_warnings():
        warnings.simplefilter("error", tq.calibration.CalibrationWarning)  # no expert rounded for lack of tokens
        tq.calibrate(moe, tq.configs.fp8(), lambda m: m(local_tokens, splits), algorithm="gptq", amax_groups=[world], progress=False)
    results["dp_moe_gptq_weight"] = moe.weight.detach().clone()


def _tiny_llama() -> nn.Module:
    import transformers

    # Input dims 128 and 256: whole g128 groups. Two decoder layers: the second is replayed on
    # the first one's cached, rounded outputs (tqcompile.calibration.replay).
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(3)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _tiny_qwen3_moe() -> nn.Module:
    return tiny_hf_moe("qwen3_moe", seed=4, hidden=64, intermediate=64, layers=2)


def _tiny_qwen3_moe_rank_routed() -> nn.Module:
    # Every hidden state is dominated by channel 0, -1 for tokens below 96 (all of rank 0's) and +1
    # above (some of rank 1's), and the router's expert 3 reads only that channel: rank 0 routes no
    # token to two experts of each layer, rank 1 some to every expert.
    model = _tiny_qwen3_moe()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = torch.where(torch.arange(128) < 96, -1.0, 1.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight[3] = 0.0
            layer.mlp.gate.weight[3, 0] = 8.0
    return model


def _token_batches(rank: int) -> list[torch.Tensor]:
    # Disjoint per rank: other seeds, token ranges that differ (both models have >= 128 tokens), so
    # one rank's statistics alone give other weights than the union's; and 2 batches on rank 0, 3 on
    # rank 1, so statistics averaged per rank (not weighted by tokens) would differ from the union's.
    g = torch.Generator().manual_seed(70 + rank)
    return [torch.randint(32 * rank, 32 * rank + 96, (2, 16), generator=g) for _ in range(2 + rank)]


def _token_loop(batches):
    return lambda m: [m(input_ids=b) for b in batches]


# name: (model, config, algorithm). Each runs once on the ranks (amax_groups=[WORLD], each rank on
# its own batches) and once here on the union of the batches.
INT_CASES = {
    "llama_w4g128_gptq": (_tiny_llama, tq.configs.int4_weight_only(128), "gptq"),
    "llama_w4g32_asym_gptq": (_tiny_llama, tq.configs.int4_weight_only(32, grid=tq.IntGrid.ASYMMETRIC), "gptq"),
    "llama_w4g32_asym_awq": (_tiny_llama, tq.configs.int4_weight_only(32, grid=tq.IntGrid.ASYMMETRIC), "awq"),
    # The parents' output errors summed over the ranks: every rank picks the union's scales.
    "llama_w4g32_awq_output_loss": (_tiny_llama, tq.configs.int4_weight_only(32), tq.AWQ(loss="output")),
    "llama_w3g32_rtn": (_tiny_llama, tq.configs.int_weight_only(3, 32), "max"),
    "llama_w3g32_gptq": (_tiny_llama, tq.configs.int_weight_only(3, 32), "gptq"),
    "llama_w2g32_gptq": (_tiny_llama, tq.configs.int_weight_only(2, 32), "gptq"),
    "llama_w8a8_smoothquant": (_tiny_llama, tq.configs.int8_dynamic(), "smoothquant"),
    "llama_w8a8_smoothquant_gptq": (_tiny_llama, tq.configs.int8_dynamic(), ("smoothquant", "gptq")),
    "llama_w8a8_static_smoothquant_gptq": (_tiny_llama, tq.configs.int8(), ("smoothquant", "gptq")),  # + activation amaxes
    "qwen3_moe_w4g32_gptq": (_tiny_qwen3_moe, tq.configs.int4_weight_only(32), "gptq"),
    "qwen3_moe_w8a8_smoothquant_gptq": (_tiny_qwen3_moe, tq.configs.int8_dynamic(), ("smoothquant", "gptq")),
    "qwen3_moe_idle_experts_w4g32_gptq": (_tiny_qwen3_moe_rank_routed, tq.configs.int4_weight_only(32), "gptq"),
    "qwen3_moe_idle_experts_w8a8_static_gptq": (_tiny_qwen3_moe_rank_routed, tq.configs.int8(), "gptq"),  # per-expert input amaxes
    "llama_w4g128_fp8_kv_gptq": (_tiny_llama, tq.configs.int4_weight_only(128).with_rules(tq.configs.fp8_kv_cache()), "gptq"),
    "qwen3_moe_w4g32_asym_awq": (_tiny_qwen3_moe, tq.configs.int4_weight_only(32, grid=tq.IntGrid.ASYMMETRIC), "awq"),
}

# The cases that also calibrate on rank 0's data alone, to show that the test would see a
# statistic left unreduced: one per statistic (Hessians, mean |x|, channel maxima, static
# activation amaxes, per-expert token counts). The others share these models and data.
REDUCTION_MATTERS = {
    "llama_w4g128_gptq",
    "llama_w4g32_asym_awq",
    "llama_w8a8_smoothquant",
    "llama_w8a8_static_smoothquant_gptq",
    "qwen3_moe_idle_experts_w4g32_gptq",
}


def _int_scheme(name: str, batches, export_to: str, amax_groups=()) -> dict:
    """Calibrate case `name` on `batches` and export it: what the comparison needs."""
    from tqcompile.calibration import replay

    build, config, algorithm = INT_CASES[name]
    captured, capture = [], replay.capture

    def recording_capture(*args, **kwargs):
        captured.append(capture(*args, **kwargs))
        return captured[-1]

    replay.capture = recording_capture
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", tq.calibration.CalibrationWarning)
            model = tq.calibrate(
                build(), config, _token_loop(batches), algorithm=algorithm, amax_groups=amax_groups, progress=False
            )
    finally:
        replay.capture = capture
    tq.export(model, export_to)  # under the process group: collective, rank 0 writes
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "state": tq.quant_state(model),
        "methods": [(r.name, r.method) for r in tq.summary(model).rows],
        "replayed": captured,  # per chain of decoder layers: whether its later layers ran on cached inputs
        "warnings": sorted(str(w.message) for w in caught if issubclass(w.category, tq.calibration.CalibrationWarning)),
    }


def _check_int_scheme(name: str, rank: int, world, results: dict, out_dir: str) -> None:
    results[name] = _int_scheme(name, _token_batches(rank), f"{out_dir}/export_{name}", amax_groups=[world])


# 7. `tq.quantize_checkpoint(..., data=, amax_groups=)`: the INT_CASES it runs on, from the float
#    checkpoints the fixture saves (one per model), each rank on its own batches.
LAYERWISE_CASES = ("llama_w4g32_asym_gptq", "llama_w8a8_static_smoothquant_gptq", "qwen3_moe_w4g32_gptq")


def _float_checkpoint(out_dir, name: str) -> str:
    return f"{out_dir}/float_{INT_CASES[name][0].__name__}"


def _layerwise(name: str, batches, out: str, src: str, amax_groups=()):
    _, config, algorithm = INT_CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tq.calibration.CalibrationWarning)  # layers a preset leaves in high precision
        return tq.quantize_checkpoint(src, out, config, data=batches, algorithm=algorithm, amax_groups=amax_groups, progress=False)


def _check_layerwise(name: str, rank: int, world, results: dict, out_dir: str) -> None:
    report = _layerwise(name, _token_batches(rank), f"{out_dir}/layerwise_{name}", _float_checkpoint(out_dir, name), [world])
    results[f"layerwise_{name}"] = None if report is None else len(report.rows)


def _check_layerwise_refused(rank: int, world, results: dict, out_dir: str) -> None:
    # 7'. A call one rank refuses is refused on every rank, before any calibration: the writing
    #     rank's `out` (an existing, non-empty directory), then rank 1's data (a string in it).
    from tqcompile.export import streaming

    occupied, name = Path(out_dir, "occupied"), "llama_w4g32_asym_gptq"
    if rank == 0:
        occupied.mkdir()
        (occupied / "notes.txt").write_text("not a checkpoint")
    dist.barrier()
    calibrations, calibrate = [], streaming.calibrate_layerwise
    streaming.calibrate_layerwise = lambda *a, **kw: calibrations.append(1) or calibrate(*a, **kw)
    errors = {}
    try:
        for what, out, data in (
            ("bad_out", occupied, _token_batches(rank)[:1]),
            ("bad_data", Path(out_dir, "never_written"), _token_batches(rank)[:1] + ["text"] * rank),
        ):
            try:
                _layerwise(name, data, str(out), _float_checkpoint(out_dir, name), [world])
            except Exception as e:
                errors[what] = f"{type(e).__name__}: {e}"
            else:
                errors[what] = None
    finally:
        streaming.calibrate_layerwise = calibrate
    results["layerwise_refused"] = {**errors, "calibrations": len(calibrations), "written": os.path.exists(Path(out_dir, "never_written"))}


def _check_reduce_stats_in_place(rank: int, world, results: dict, out_dir: str) -> None:
    # 6. A statistic as large as a layer's Hessian (a 14336-wide down_proj: 1.6 GB in float64) is
    #    reduced where it lies, not copied into a flat buffer beside itself (twice the memory);
    #    small ones still share one collective.
    from tqcompile.calibration.passes import REDUCE_BUCKET_BYTES, reduce_stats

    big = torch.full((REDUCE_BUCKET_BYTES // 8 + 1,), float(rank + 1), dtype=torch.float64)
    small = [torch.full((3,), float(rank + 1), dtype=torch.float64) for _ in range(2)]
    reduced, all_reduce = [], dist.all_reduce

    def recording_all_reduce(t, *args, **kwargs):
        reduced.append((t.data_ptr(), t.numel()))
        return all_reduce(t, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        reduce_stats([small[0], big, small[1]], [world], op=dist.ReduceOp.SUM)
    finally:
        dist.all_reduce = all_reduce
    results["reduce_stats"] = {
        "big_in_place": (big.data_ptr(), big.numel()) in reduced,
        "collectives": len(reduced),
        "sums": [float(big.min()), float(big.max()), *(float(t.sum()) for t in small)],
    }


def _rank_checks(rank: int, out_dir: str) -> None:
    world = dist.group.WORLD
    results: dict = {}
    checks = (
        _check_max_then_sync,
        _check_sync_then_max,
        _check_ddp_then_max,
        _check_percentile,
        _check_data_parallel_moe,
        _check_expert_parallel,
        _check_transforms_data_parallel,
        _check_reduce_stats_in_place,
    )
    named = [(c.__name__.removeprefix("_check_"), lambda c=c: c(rank, world, results, out_dir)) for c in checks]
    named += [(f"int_scheme_{n}", lambda n=n: _check_int_scheme(n, rank, world, results, out_dir)) for n in INT_CASES]
    named += [(f"layerwise_{n}", lambda n=n: _check_layerwise(n, rank, world, results, out_dir)) for n in LAYERWISE_CASES]
    named += [("layerwise_refused", lambda: _check_layerwise_refused(rank, world, results, out_dir))]
    results["timings"] = run_checks(rank, named)["timings"]
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _amaxes(state: dict) -> dict:
    # Every slot: input, weight, output; an attention's query, key and value (its KV cache).
    return {(n, s): v["amax"] for n, e in state["modules"].items() for s, v in e.items() if isinstance(v, dict) and "amax" in v}


def _assert_same_amaxes(a: dict, b: dict, what: str) -> None:
    x, y = _amaxes(a), _amaxes(b)
    assert list(x) == list(y), what
    for k in x:
        assert (x[k] is None and y[k] is None) or torch.equal(x[k], y[k]), f"{what}: {k}"


def _without_class(rows):
    return [dataclasses.replace(r, module_class="") for r in rows]


@pytest.fixture(scope="module")
def one_thread():
    # As on the ranks: the same matmul/conv blocking, so the same float sums when outputs are compared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, one_thread) -> tuple[Path, list]:
    """The one spawn every test of this file reads: (its directory, each rank's results)."""
    out_dir = tmp_path_factory.mktemp("ptq_ranks")
    for name in LAYERWISE_CASES:  # the float checkpoints the ranks share
        if not os.path.exists(_float_checkpoint(out_dir, name)):
            INT_CASES[name][0]().save_pretrained(_float_checkpoint(out_dir, name))
    return out_dir, run_ranks(_rank_checks, WORLD_SIZE, out_dir, deadline_s=JOIN_TIMEOUT_S)


def test_ptq_two_ranks(two_ranks, one_thread):
    tmp_path, ranks = two_ranks
    union = _batches(0) + _batches(1)

    # 1. Distributed calibration equals a single process on the union of the data.
    single = tq.calibrate(_cnn(), CONFIG, _loop(union), progress=False)
    single_p = tq.calibrate(_cnn(), CONFIG, _loop(union), algorithm="percentile", percentile=99.0, progress=False)
    for r, res in enumerate(ranks):
        assert res["max_collectives"] == 2, f"rank {r}: {res['max_collectives']} all_reduce calls; one per reduction expected"
        for order in ("quantize_then_sync", "sync_then_quantize", "ddp_then_quantize"):
            _assert_same_amaxes(res[order]["state"], tq.quant_state(single), f"rank {r} {order}")
        _assert_same_amaxes(res["percentile"], tq.quant_state(single_p), f"rank {r} percentile")
    local0 = tq.quant_state(tq.calibrate(_cnn(), CONFIG, _loop(_batches(0)), progress=False))
    assert not torch.equal(
        local0["modules"]["conv1"]["input"]["amax"], tq.quant_state(single)["modules"]["conv1"]["input"]["amax"]
    )

    union_tokens = [
        torch.cat([_tokens(e) * (1 + r) for r in range(WORLD_SIZE) if [[6, 0, 6, 6], [6, 6, 0, 6]][r][e]]) for e in range(EXPERTS)
    ]
    expected = torch.stack([t.abs().amax() for t in union_tokens])
    for r, res in enumerate(ranks):
        assert torch.equal(res["dp_moe_input_amax"], expected), f"rank {r} data-parallel MoE input amaxes"

    # 4. Weight transforms: every rank made the same weights; they are those of one process on the
    #    union of the data, bit for bit (float64 sums of float32 terms, exact here in any order:
    #    see test_int_schemes_two_ranks).
    t0 = ranks[0]["transforms"]
    for r, res in enumerate(ranks[1:], 1):
        for k, v in res["transforms"]["weights"].items():
            assert torch.equal(v, t0["weights"][k]), f"rank {r} {k}"
        _assert_same_amaxes(res["transforms"]["state"], t0["state"], f"rank {r} transforms")
    union_m = tq.calibrate(_norm_mlp(), CONFIG, _loop(_mlp_batches(0) + _mlp_batches(1)), algorithm=TRANSFORMS, progress=False)
    local_m = tq.calibrate(_norm_mlp(), CONFIG, _loop(_mlp_batches(0)), algorithm=TRANSFORMS, progress=False)
    for k in ("fc1.weight", "fc2.weight"):
        got, want, local = t0["weights"][k], union_m.state_dict()[k], local_m.state_dict()[k]
        assert torch.equal(got, want), k
        assert (local != want).float().mean() > 0.2, k  # the reduction matters: one rank's data alone gives other weights
    assert torch.equal(ranks[0]["dp_moe_gptq_weight"], ranks[1]["dp_moe_gptq_weight"])
    for r, res in enumerate(ranks):  # 6. a large statistic reduced in place, the small ones together
        assert res["reduce_stats"] == {"big_in_place": True, "collectives": 2, "sums": [3.0, 3.0, 9.0, 9.0]}, f"rank {r}"

    # 2. Every order gives the same state; each restores into a single-process model built another way.
    ref = ranks[0]["quantize_then_sync"]
    expected_classes = {
        "quantize_then_sync": ["Conv2d", "SyncBatchNorm", "Conv2d", "SyncBatchNorm", "Linear"],
        "sync_then_quantize": ["Conv2d", "SyncBatchNorm", "Conv2d", "SyncBatchNorm", "Linear"],
        "ddp_then_quantize": ["Conv2d", "BatchNorm2d", "Conv2d", "BatchNorm2d", "Linear"],
    }
    for order, classes in expected_classes.items():
        rec = ranks[0][order]
        assert [r.module_class for r in rec["rows"]] == classes, order
        assert _without_class(rec["rows"]) == _without_class(ref["rows"]), order
        assert list(rec["state"]["modules"]) == ["conv1", "bn1", "conv2", "bn2", "fc"], order  # no "module." prefix
        assert torch.equal(rec["out"], ref["out"]), order
        weights = {k.removeprefix("module."): v for k, v in rec["weights"].items()}
        for rebuilt in (_cnn(), nn.SyncBatchNorm.convert_sync_batchnorm(_cnn())):  # plain BatchNorm, and SyncBatchNorm
            model = tq.restore(rebuilt, rec["state"])
            model.load_state_dict(weights)
            _assert_same_amaxes(tq.quant_state(model), rec["state"], order)
            assert _without_class(tq.summary(model).rows) == _without_class(rec["rows"])
            with torch.no_grad():
                assert torch.equal(model(TEST_IMAGES), rec["out"]), order

    # 3. The EP=2 checkpoint: bit for bit on the ranks (EP=2) and in one process (EP=1).
    for r, res in enumerate(ranks):
        for s in ("input", "weight"):
            assert torch.equal(res["ep_reloaded_amax"][s], res["ep_amax"][s]), f"rank {r} EP=2 {s}"
        assert torch.equal(res["ep_reloaded_out"], res["ep_out"]), f"rank {r} EP=2 output"
    full = tq.calibration.prepare(_experts(EXPERTS, 0), tq.configs.fp8())
    loaded_weights = {"weight": torch.empty(EXPERTS, H, D)}
    with pytest.warns(UserWarning, match="assuming the intent is to load in a single process"):  # EP=1: one process, on purpose
        dcp.load({"quant": tq.quant_state(full), "model": loaded_weights}, checkpoint_id=str(tmp_path / "ep_ckpt"))
    assert torch.equal(full.weight, loaded_weights["weight"])
    for s in ("input", "weight"):
        assert torch.equal(getattr(full, f"{s}_quantizer").amax, torch.cat([res["ep_amax"][s] for res in ranks])), f"EP=1 {s}"
    # ... and equals calibrating all 4 experts in one process.
    one = tq.calibrate(
        _experts(EXPERTS, 0),
        tq.configs.fp8(),
        lambda m: m(torch.cat([_tokens(e) for e in range(EXPERTS)]), [6] * EXPERTS),
        progress=False,
    )
    _assert_same_amaxes(tq.quant_state(full), tq.quant_state(one), "EP=1 vs single-process calibration")
    with torch.no_grad():
        y = full(torch.cat([_tokens(e) for e in range(EXPERTS)]), [6] * EXPERTS)
    assert torch.equal(y, torch.cat([res["ep_out"] for res in ranks]))
    copy.deepcopy(full)  # a restored model is an ordinary module


def _digests(path: str) -> dict[str, str]:
    return {f: hashlib.sha256(Path(path, f).read_bytes()).hexdigest() for f in sorted(os.listdir(path))}


@pytest.mark.parametrize("name", list(INT_CASES))
def test_int_schemes_two_ranks(name, two_ranks, one_thread, tmp_path):
    """Issue 28: data-parallel calibration of the integer schemes equals one process on the union
    of the data, bit for bit: weights, amaxes and zero points (an asymmetric amax holds
    (-min, max)), what each layer got, the warnings, and the exported checkpoint's bytes.

    Bit for bit although the ranks sum their statistics in another order than one process: each
    batch's ``XᵀX`` and ``sum|x|`` are float32 values (the same on a rank and here: one thread
    each) added in float64, which has 29 more mantissa bits, so the sums are exact, whatever their
    order, unless an entry's batch terms differ in magnitude by about 2**29 or more (a nearly
    cancelling off-diagonal entry; none here: a last-bit difference there could flip a GPTQ
    rounding tie on a large model). Maxima do not depend on the order at all."""
    out_dir, ranks = two_ranks
    union = _token_batches(0) + _token_batches(1)
    single = _int_scheme(name, union, str(tmp_path / "single"))
    for r, res in enumerate(ranks):
        got = res[name]
        assert list(got["weights"]) == list(single["weights"]), f"rank {r}"
        for k, v in got["weights"].items():
            assert torch.equal(v, single["weights"][k]), f"rank {r} {name}: weight {k} differs from one process on the union"
        _assert_same_amaxes(got["state"], single["state"], f"rank {r} {name}")
        assert got["methods"] == single["methods"], f"rank {r} {name}"
        assert got["warnings"] == single["warnings"], f"rank {r} {name}"
        assert got["replayed"] == ([] if INT_CASES[name][2] == "max" else [True]), f"rank {r} {name}: {got['replayed']}"
    exported = _digests(str(out_dir / f"export_{name}"))
    assert "config.json" in exported and exported == _digests(str(tmp_path / "single")), name
    if name in REDUCTION_MATTERS:
        # The reduction matters: rank 0's data alone gives other weights.
        local = _int_scheme(name, _token_batches(0), str(tmp_path / "local"))
        assert any(not torch.equal(v, single["weights"][k]) for k, v in local["weights"].items()), name
        if "idle_experts" in name:  # alone, rank 0 rounds 2 experts a layer (both GEMMs) to nearest; with rank 1's tokens, none
            assert sum(line.endswith("(its Hessian is empty)") for w in local["warnings"] for line in w.splitlines()) == 8
            assert single["warnings"] == [], single["warnings"]


@pytest.mark.parametrize("name", LAYERWISE_CASES)
def test_layerwise_two_ranks(name, two_ranks, one_thread, tmp_path):
    """Issue 28: `tq.quantize_checkpoint(..., data=mine, amax_groups=[WORLD])` from a float
    checkpoint on disk, each rank with its own (uneven) batches: rank 0 writes and returns the
    report, rank 1 None, and the files are byte for byte (a) what the same case's
    `tq.calibrate(..., amax_groups)` + export on the ranks wrote and (b) what one process's
    `quantize_checkpoint` on the union of the batches writes."""
    out_dir, ranks = two_ranks
    assert ranks[0][f"layerwise_{name}"] and ranks[1][f"layerwise_{name}"] is None, name
    got = _digests(str(out_dir / f"layerwise_{name}"))
    assert "config.json" in got and got == _digests(str(out_dir / f"export_{name}")), f"{name}: (a) differs from tq.calibrate + export"
    _layerwise(name, _token_batches(0) + _token_batches(1), str(tmp_path / "single"), _float_checkpoint(out_dir, name))
    assert got == _digests(str(tmp_path / "single")), f"{name}: (b) differs from one process on the union"


def test_layerwise_refused_on_every_rank(two_ranks):
    """A call that one rank refuses (the writer's `out`, another rank's data) raises on every rank
    with that rank's reason, before any calibration: none is left waiting in a collective."""
    _, ranks = two_ranks
    r0, r1 = ranks[0]["layerwise_refused"], ranks[1]["layerwise_refused"]
    assert r0["bad_out"].startswith("ExportError: tq.export: directory") and "exists and is not empty" in r0["bad_out"], r0
    assert r1["bad_out"].startswith("ExportError: tq.quantize_checkpoint: rank 0 refused the call: ExportError: tq.export: directory"), r1
    assert r1["bad_data"].startswith("TypeError: tq.quantize_checkpoint: data[1] is a str"), r1
    assert r0["bad_data"].startswith("ExportError: tq.quantize_checkpoint: rank 1 refused the call: TypeError: tq.quantize_checkpoint: data[1] is a str"), r0
    for r, res in enumerate((r0, r1)):
        assert res["calibrations"] == 0 and not res["written"], f"rank {r}: {res}"
