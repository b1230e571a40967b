"""`amax_group` across processes: two CPU ranks over gloo, compiled with `fullgraph=True`:
`tq.quantize` with a group, and `tq.nn.GroupedLinear`'s per-expert amaxes.

One spawn runs every check (starting processes and compiling are the slow part): each rank holds
different data, runs the compiled code, asserts what it can see alone and saves its results;
the test then compares the ranks with each other and with a single-process quantization of the
concatenated data, which is what an amax reduced over the group must reproduce bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import tqcompile as tq
from tqcompile.testing import run_checks, run_ranks
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal

WORLD_SIZE = 2
ROWS = 64  # rows per rank; a multiple of NVFP4's 16 so columnwise blocks never straddle ranks
COLS = 128

FP8 = tq.Float8Quantizer()
NVFP4 = tq.NVFP4Quantizer()
NVFP4_HADAMARD = tq.NVFP4Quantizer(hadamard=True, hadamard_seed=1)
MXFP8 = tq.MXQuantizer()
E, D, H = 4, 64, 128  # GroupedLinear: experts, in and out features


def _local_data(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    # Rank 1's values are larger, so rank 0's reduced amax differs from its local one.
    return torch.randn(ROWS, COLS, generator=g) * (1.0 + 3.0 * rank)


def _quantize(x, quantizer, group):
    qx = tq.quantize(x, quantizer, amax_group=group, rowwise=True, columnwise=True)
    return qx, qx.dequantize()


def _use(qx):
    return qx, qx.t().clone(), qx.dequantize()


def _check_quantize(rank: int) -> dict:
    world = dist.group.WORLD
    x = _local_data(rank)
    results: dict = {"local_amax": tq.ops.amax(x, FP8)}

    # 1. A ProcessGroup object as a graph argument; the same group by name; equal quantizers.
    counter = CompileCounter("aot_eager")
    quantize = torch.compile(_quantize, backend=counter, fullgraph=True)
    qx, deq = quantize(x, FP8, world)
    assert_bitwise_equal((qx, deq), _quantize(x, FP8, world))
    assert qx.amax_group_name == world.group_name and qx.amax_group is world, (qx.amax_group_name, qx.amax_group)
    assert_bitwise_equal(quantize(x, dataclasses.replace(FP8), world), (qx, deq))
    assert (counter.frame_count, counter.recompiles) == (1, 0), counter
    assert_bitwise_equal(quantize(x, FP8, world.group_name), (qx, deq))
    results["fp8"] = qx

    # 2. A QuantizedTensor carrying its amax group as a graph input, and new ones as outputs.
    use = torch.compile(_use, backend=counter, fullgraph=True)
    used = use(qx)
    assert_bitwise_equal(used, _use(qx))
    assert used[1].amax_group_name == world.group_name and used[1].amax_group is world
    other = quantize(x * 0.5, FP8, world)[0]
    assert_bitwise_equal(use(other), _use(other))

    # 3. NVFP4 reduces its tensor-level amax; with the Hadamard transform both usages' amaxes
    #    (different there) are reduced in one collective.
    results["nvfp4"] = quantize(x, NVFP4, world)[0]
    results["nvfp4_hadamard"] = quantize(x, NVFP4_HADAMARD, world)[0]

    # 4. Scales that are all local (MX): the group is recorded, nothing is reduced.
    mx = quantize(x, MXFP8, world)[0]
    assert mx.amax_group_name == world.group_name
    unreduced = tq.quantize(x, MXFP8, rowwise=True, columnwise=True)
    for name in ("_data", "_scale_inv", "_data_t", "_scale_inv_t"):
        assert_bitwise_equal(getattr(mx, name), getattr(unreduced, name), f"mx.{name}")
    assert mx._amax is None and mx._amax_t is None
    results["counts"] = (counter.frame_count, counter.recompiles, counter.graph_breaks)

    # 5. A group this rank is not in: new_group(ranks=[0]) gives rank 1 NON_GROUP_MEMBER.
    only_rank0 = dist.new_group(ranks=[0])
    if rank == 0:
        alone = quantize(x, FP8, only_rank0)[0]
        assert_bitwise_equal(alone._amax, results["local_amax"], "amax over a group of one")
    else:
        assert only_rank0 is dist.GroupMember.NON_GROUP_MEMBER
        message = "not a member of the process group"
        with pytest.raises(ValueError, match=message):
            tq.quantize(x, FP8, amax_group=only_rank0)
        # Under fullgraph=True Dynamo reports an exception raised while tracing as an Unsupported
        # error whose text carries the original ValueError.
        with pytest.raises(Exception, match=message):
            quantize(x, FP8, only_rank0)
    return results


def _rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    counts = torch.tensor([16, 0, 48, 32]) if rank == 0 else torch.tensor([32, 16, 0, 48])
    # Rank 1's tokens are larger, so every expert it serves has a larger amax there.
    return torch.randn(int(counts.sum()), D, generator=g) * (1.0 + 3.0 * rank), counts


def _check_grouped(rank: int) -> dict:
    from tqcompile.ops import grouped_gemm as gops

    group = dist.group.WORLD
    x, counts = _rank_data(rank)
    results = {}
    for name in ("fp8_tensorwise", "nvfp4"):
        torch.manual_seed(0)
        layer = tq.nn.GroupedLinear(E, D, H, recipe=tq.recipes.get(name), amax_group=group)
        counter = CompileCounter("aot_eager")
        compiled = torch.compile(layer, backend=counter, fullgraph=True)
        y = compiled(x, counts)
        assert counter.graph_breaks == 0 and counter.frame_count == 1, counter
        # The same GEMM with the amax reduced by hand: what the layer must have used.
        q = layer.recipe.fprop_input
        ends = counts.cumsum(0)
        local = gops.grouped_amax(x, q, ends, False)
        reduced = local.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        qx = gops.grouped_quantize(x, q, ends, reduced, None, False)
        w = layer.weight.detach().reshape(E * H, D)
        w_ends = torch.arange(1, E + 1) * H
        w_amax = gops.grouped_amax(w, layer.recipe.fprop_weight, w_ends, False)
        qw = gops.grouped_quantize(w, layer.recipe.fprop_weight, w_ends, w_amax, None, False)
        amax_or_none = reduced if name == "nvfp4" else None
        w_amax_or_none = w_amax if name == "nvfp4" else None
        expected = gops.grouped_gemm_tn(
            *qx, amax_or_none, q, *qw, w_amax_or_none, layer.recipe.fprop_weight, ends, False, x.dtype
        )
        assert torch.equal(y, expected), f"{name}: y differs from the GEMM with the group-reduced amax"
        results[name] = {"local": local, "reduced": reduced}
    return results


def _rank_checks(rank: int, out_dir: str) -> None:
    checks = [("quantize", lambda: _check_quantize(rank)), ("grouped_linear", lambda: _check_grouped(rank))]
    torch.save(run_checks(rank, checks), f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    """One spawn for both tests (starting two processes costs more than either check)."""
    # 97 s measured on a 2-core machine at load ~28 (both checks, start-up included): about 3x that.
    return run_ranks(_rank_checks, WORLD_SIZE, tmp_path_factory.mktemp("amax_group"), deadline_s=300)


def _inner(qx: tq.QuantizedTensor) -> dict[str, torch.Tensor]:
    return {name: getattr(qx, name) for name in qx.__tensor_flatten__()[0]}


def test_amax_group_two_ranks(ranks):
    ranks = [r["quantize"] for r in ranks]
    full = torch.cat([_local_data(r) for r in range(WORLD_SIZE)])

    global_amax = tq.ops.amax(full, FP8)
    assert_bitwise_equal(global_amax, torch.maximum(ranks[0]["local_amax"], ranks[1]["local_amax"]))
    assert ranks[0]["local_amax"] < global_amax, "the data must make the reduction observable on rank 0"

    for key, quantizer in (("fp8", FP8), ("nvfp4", NVFP4), ("nvfp4_hadamard", NVFP4_HADAMARD)):
        reference = tq.quantize(full, quantizer, rowwise=True, columnwise=True)
        for r, res in enumerate(ranks):
            qx = res[key]
            assert qx.amax_group_name is not None and qx.amax_group_name == ranks[0][key].amax_group_name
            # Each rank's quantization is the single-process quantization of the whole tensor,
            # restricted to its rows (both usages; the slice also keeps the tensor amaxes).
            assert_bitwise_equal(_inner(qx), _inner(reference[r * ROWS : (r + 1) * ROWS]), f"rank {r} {key}")
        assert_bitwise_equal(ranks[0][key]._amax, ranks[1][key]._amax, f"{key} amax across ranks")
    # A Hadamard-transformed tensor has different rowwise and columnwise amaxes; both were reduced.
    assert ranks[0]["nvfp4_hadamard"]._amax != ranks[0]["nvfp4_hadamard"]._amax_t

    for r, res in enumerate(ranks):
        # Compiles: _quantize for FP8 (the equal quantizer reuses it), for the group name instead of
        # the object, then NVFP4, NVFP4+Hadamard, MXFP8; _use once. No graph breaks anywhere.
        assert res["counts"] == (6, 4, 0), f"rank {r}: (graphs, recompiles, graph breaks) = {res['counts']}"


def test_amax_group_reduces_per_expert_amaxes(ranks):
    """With `amax_group`, each expert's activation amax is the max over the ranks of that expert's
    tokens (an (E,) MAX all-reduce, traced under fullgraph=True), and the layer's output is the
    grouped GEMM quantized with it, bit for bit."""
    ranks = [r["grouped_linear"] for r in ranks]
    for name in ("fp8_tensorwise", "nvfp4"):
        local = [r[name]["local"] for r in ranks]
        want = torch.maximum(*local)
        for r in ranks:
            assert torch.equal(r[name]["reduced"], want)
        # Every expert with tokens on rank 0 gets a larger amax from rank 1 (experts 0 and 3).
        assert (want[[0, 3]] > local[0][[0, 3]]).all() and local[0][1] == 0 and want[1] > 0
