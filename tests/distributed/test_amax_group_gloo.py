"""`amax_group` across processes: two CPU ranks over gloo, compiled with `fullgraph=True`.

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
from tqcompile.testing import run_ranks
from tqcompile.testing.compile import CompileCounter, assert_bitwise_equal

WORLD_SIZE = 2
ROWS = 64  # rows per rank; a multiple of NVFP4's 16 so columnwise blocks never straddle ranks
COLS = 128

FP8 = tq.Float8Quantizer()
NVFP4 = tq.NVFP4Quantizer()
NVFP4_HADAMARD = tq.NVFP4Quantizer(hadamard=True, hadamard_seed=1)
MXFP8 = tq.MXQuantizer()


def _local_data(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    # Rank 1's values are larger, so rank 0's reduced amax differs from its local one.
    return torch.randn(ROWS, COLS, generator=g) * (1.0 + 3.0 * rank)


def _quantize(x, quantizer, group):
    qx = tq.quantize(x, quantizer, amax_group=group, rowwise=True, columnwise=True)
    return qx, qx.dequantize()


def _use(qx):
    return qx, qx.t().clone(), qx.dequantize()


def _rank_checks(rank: int, out_dir: str) -> None:
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
    torch.save(results, f"{out_dir}/rank{rank}.pt")




def _inner(qx: tq.QuantizedTensor) -> dict[str, torch.Tensor]:
    return {name: getattr(qx, name) for name in qx.__tensor_flatten__()[0]}


def test_amax_group_two_ranks(tmp_path):
    # A file store instead of a TCP port: nothing to race for with other jobs on the machine.
    ranks = run_ranks(_rank_checks, WORLD_SIZE, tmp_path)
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
