"""The sharded demo (`tqcompile demo --fsdp N --tp M`), its process launcher, and
`count_collective_bytes`, on CPU with gloo.

Starting processes and compiling are the slow part here: each spawn runs several checks, every
spawn has a time limit, and a failing rank fails the test at once (`tq.testing.distributed.spawn`).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tqcompile.cli import main
from tqcompile.testing.comm import count_collective_bytes
from tqcompile.testing.distributed import run_ranks, spawn

N = 1000  # float32 elements per rank


def _counter_checks(rank: int, world_size: int) -> None:
    """Every collective's bytes counted exactly, in eager code and inside a compiled graph."""
    x = torch.full((N,), float(rank))
    with count_collective_bytes() as wire:
        out = torch.empty(world_size * N)
        dist.all_gather_into_tensor(out, x)  # c10d in-place op
        y = x.clone()
        dist.all_reduce(y)
        g = funcol.all_gather_tensor(x.to(torch.bfloat16), 0, dist.group.WORLD)  # functional op
        g = funcol.wait_tensor(g)
    assert torch.equal(out, torch.arange(world_size).repeat_interleave(N).float())
    assert g.shape == (world_size * N,)
    assert wire.bytes["all_gather"] == world_size * N * 4 + world_size * N * 2, wire
    assert wire.calls["all_gather"] == 2 and wire.calls["all_reduce"] == 1, wire
    assert wire.bytes["all_reduce"] == N * 4, wire
    assert wire.dtypes["all_gather"] == {torch.float32, torch.bfloat16}, wire

    # A collective a DTensor op issues inside its own dispatch (sort has no sharded strategy:
    # DTensor all-gathers the shards first) is counted too.
    mesh = init_device_mesh("cpu", (world_size,))
    d = distribute_tensor(torch.arange(world_size * N, dtype=torch.float32).flip(0), mesh, [Shard(0)])
    with count_collective_bytes() as wire:
        d.sort(dim=0)
    assert wire.bytes["all_gather"] == world_size * N * 4 and wire.calls["all_gather"] == 1, wire

    # Collectives that torch.compile put in a graph are counted when the graph runs (aot_eager),
    # and the mode does not stop Dynamo compiling (it is off while Dynamo traces).
    group_name = dist.group.WORLD.group_name

    def gather_u8(t: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_gather_tensor(t.view(torch.uint8), 0, group_name)).sum()

    compiled = torch.compile(gather_u8, backend="aot_eager", fullgraph=True)
    compiled(x)  # compile outside the mode
    with count_collective_bytes() as wire:
        compiled(x)
        compiled(x)
    assert wire.bytes["all_gather"] == 2 * world_size * N * 4 and wire.calls["all_gather"] == 2, wire
    wire.reset()
    assert not wire.bytes and not wire.calls


def test_count_collective_bytes_two_processes() -> None:
    spawn(_counter_checks, 2, timeout_s=240)


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("planted failure on rank 1")
    dist.barrier()  # rank 0 would wait here forever for rank 1


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(600)


def _rank0_fails_a_check(rank: int, out_dir: str) -> None:
    if rank == 0:
        pytest.fail("planted check failure on rank 0")  # a BaseException, not an Exception
    dist.barrier()


def test_spawn_fails_fast_and_times_out(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="planted failure on rank 1"):
        spawn(_rank1_raises, 2, timeout_s=120)
    with pytest.raises(TimeoutError, match="still running after 8 s"):
        spawn(_sleeps, 2, timeout_s=8)
    assert time.monotonic() - start < 110  # neither waited for its rank-0 process to finish
    # run_ranks, the tests' form of the same launcher: the failed rank's traceback, as an AssertionError,
    # without waiting for the peer in its barrier (its collective would wait 300 s, past the deadline).
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)a rank failed:.*-- rank 0 raised:.*planted check failure on rank 0"):
        run_ranks(_rank0_fails_a_check, 2, tmp_path, deadline_s=120, timeout_s=300)
    assert time.monotonic() - start < 110


def _table_rows(out: str) -> tuple[str, dict[str, list[str]]]:
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("recipe"))
    body = lines[lines.index(header) + 2 :]
    rows = {}
    for ln in body:
        if not ln.strip():
            break
        rows[ln.split()[0]] = re.split(r"\s{2,}", ln.strip())
    return header, rows


DOCS = Path(__file__).resolve().parents[2] / "docs"


def _documented_megabytes(layout: str) -> dict[str, str]:
    """recipe -> the MB/step that docs/distributed.md states for `layout`, in the output of
    benchmarks/bench_distributed.py pasted there (columns: layout, recipe, gathered MB/step, ...)."""
    lines = (DOCS / "distributed.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("layout ") and "gathered MB/step" in ln)
    end = lines.index("```", start)
    rows = [ln.split() for ln in lines[start + 2 : end] if ln.startswith(f"{layout} ")]
    assert rows, f"docs/distributed.md has no {layout} rows of bench_distributed.py's output"
    return {row[1]: row[2] for row in rows}


def test_demo_fsdp2_prints_the_bytes_gathered(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import tqcompile.distributed as tqd

    picture = tmp_path / "fsdp2.png"
    status = main(["demo", "--fsdp", "2", "--recipes", "fp8_tensorwise", "--steps", "2", "--plot", str(picture)])
    out, err = capfd.readouterr()
    assert status == 0, out + err
    header, rows = _table_rows(out)
    assert "gathered MB/step" in header and "vs bf16 bytes" in header, header
    assert set(rows) == {"bf16", "fp8_tensorwise"}, out
    cols = re.split(r"\s{2,}", header.strip())
    for cells in rows.values():
        cell = dict(zip(cols, cells))
        assert float(cell["final loss"]) > 0, cell
        assert float(cell["gathered MB/step"]) > 0, cell
        assert cell["graph breaks"] == "0" and cell["recompiles"] == "0", cell
    assert dict(zip(cols, rows["bf16"]))["vs bf16 bytes"] == "1.00x"
    fp8_mb, bf16_mb = (float(dict(zip(cols, rows[n]))["gathered MB/step"]) for n in ("fp8_tensorwise", "bf16"))
    if hasattr(tqd, "QuantizedWeight"):  # FSDP2 gathers converted weights quantized: the column shows it
        assert fp8_mb < 0.6 * bf16_mb, out
    else:  # stock fully_shard gathers every weight in bf16
        assert fp8_mb == bf16_mb, out
    assert "FSDP2 2 = 2 processes, gloo" in out
    # Rank 0 alone reports progress: one line per step and run.
    assert err.count("[                bf16] step    0/2") == 1, err
    # Said before the processes start and before each run compiles: never a silent wait.
    lines = err.splitlines()
    assert lines[0].startswith("tqcompile demo: bf16 + fp8_tensorwise over FSDP2 2 = 2 processes (gloo, cpu)"), err
    assert lines[0].endswith("starting 2 processes ..."), err
    assert lines.index(
        "[                bf16] compiling (the first step compiles forward, backward and the optimizer step) ..."
    ) < (next(i for i, ln in enumerate(lines) if ln.startswith("[                bf16] step    0/2"))), err
    # The sharded run draws the picture too, and says so.
    assert f"plot written to {picture}" in out and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out
    # docs/distributed.md's FSDP2=2 figures are this table's (bytes do not depend on the machine).
    documented = _documented_megabytes("FSDP2=2")
    assert documented["bf16"] == f"{bf16_mb:.3f}" and documented["fp8_tensorwise"] == f"{fp8_mb:.3f}", (documented, out)


def test_demo_tp2_gathers_quantized_activations(capfd: pytest.CaptureFixture[str]) -> None:
    status = main(["demo", "--tp", "2", "--recipes", "fp8_tensorwise", "--steps", "2", "--plot", "none"])
    out, err = capfd.readouterr()
    assert status == 0, out + err
    header, rows = _table_rows(out)
    cols = re.split(r"\s{2,}", header.strip())
    assert set(rows) == {"bf16", "fp8_tensorwise"}, out
    cells = {name: dict(zip(cols, row)) for name, row in rows.items()}
    for cell in cells.values():
        assert float(cell["final loss"]) > 0 and float(cell["gathered MB/step"]) > 0, cell
        assert cell["graph breaks"] == "0" and cell["recompiles"] == "0", cell
    # bf16 (torch's styles) gathers its sequence-parallel activations in high precision; tqcompile's
    # styles gather fp8_tensorwise's quantized (the lm_head's input and logits stay high precision).
    assert float(cells["fp8_tensorwise"]["gathered MB/step"]) < 0.7 * float(cells["bf16"]["gathered MB/step"]), out
    assert "TP 2 (+SP) = 2 processes, gloo" in out
    documented = _documented_megabytes("TP=2")
    for name in ("bf16", "fp8_tensorwise"):
        assert documented[name] == cells[name]["gathered MB/step"], (documented, out)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fsdp", "3"], "--fsdp 3 must divide the batch of 2 sequences"),
        (["--fsdp", "0"], "--fsdp 0; allowed: an integer >= 1"),
        (["--tp", "3"], "--tp 3 must divide the 4 heads"),
        (["--tp", "2", "--moe"], "tensor parallelism of MoE blocks is not supported"),
    ],
)
def test_bad_layouts_are_refused_before_starting_processes(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *argv, "--steps", "2", "--plot", "none"]) == 2
    assert message in capsys.readouterr().err


def test_sharded_table_says_what_its_columns_and_layout_are() -> None:
    # The TP-only table claimed "then fully_shard; FSDP2 gathers in bf16 ..." although no FSDP2 ran,
    # and unlike the one-process table it did not say that "final loss" is a mean of the last steps
    # (a new user read 5.21 as the last loss, printed as 4.88 just above it).
    from tqcompile.demo import DemoConfig, format_sharded_table
    from tqcompile.demo.sharded import ShardedRunResult

    cfg = DemoConfig(steps=5)
    runs = [ShardedRunResult("bf16", losses=[5.0, 4.0, 3.0, 2.0, 1.0], step_times_s=[1.0, 0.1], all_gather_bytes=100)]
    tp_only = format_sharded_table(runs, cfg, fsdp=1, tp=2)
    assert "fully_shard" not in tp_only and "FSDP2 gathers" not in tp_only and "TP styles, then blocks compiled" in tp_only
    assert "final loss: mean of the last 5 steps" in tp_only
    assert re.search(r"^bf16\s+3\.0000\s", tp_only, re.M)
    assert "then fully_shard: FSDP2 gathers in bf16" in format_sharded_table(runs, cfg, fsdp=2, tp=1)


def test_parallelize_refuses_a_model_other_than_the_demo_gpt() -> None:
    # A user's own model failed deep inside with "'Llama' object has no attribute 'blocks'".
    from torch import nn

    from tqcompile.demo import parallelize

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8)])

    with pytest.raises(TypeError, match=r"shards tqcompile\.demo\.GPT only, got Llama; for your own model.*fully_shard"):
        parallelize(Llama(), mesh=None)
