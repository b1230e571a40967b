"""Run a check on several CPU processes over gloo, for tests: fast failure, no hang.

    def _checks(rank: int, out_dir: str) -> None:      # module level: the ranks are spawned
        results = run_checks(rank, [("parity", lambda: _parity(rank)), ("bytes", lambda: _bytes(rank))])
        torch.save(results, f"{out_dir}/rank{rank}.pt")

    ranks = tq.testing.distributed.run_ranks(_checks, 2, tmp_path)   # [rank 0's results, rank 1's]
"""

from __future__ import annotations

import datetime
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "run_checks", "CheckFailed"]


# In a rank started by run_ranks: the file where run_checks writes the name of the check it is in,
# so that a run killed at its deadline can say which checks were still running.
_CHECK_FILE: list[Path] = []


class CheckFailed(AssertionError):
    """A named check failed on a rank; the message names both, and the original error is its cause."""


def run_checks(rank: int, checks: Iterable[tuple[str, Callable[[], object]]]) -> dict:
    """Run named checks in order on this rank; return ``{name: what the check returned}`` plus
    ``"timings"``: ``{name: seconds}``.

    One spawn running several checks saves starting processes (the slow part on CPU), but a bare
    traceback would not say which check broke: a check that raises stops the rank with a
    `CheckFailed` naming the check and the rank, chained to the original error, and `run_ranks`
    puts that line first in its failure message.
    """
    results: dict = {}
    timings: dict[str, float] = {}
    for name, check in checks:
        if name == "timings" or name in results:
            raise ValueError(f"check name {name!r} is taken: names must be unique and not 'timings'")
        for where in _CHECK_FILE:
            where.write_text(name)
        start = time.perf_counter()
        try:
            results[name] = check()
        except Exception as e:
            raise CheckFailed(f"rank {rank}: check {name!r} failed: {type(e).__name__}: {e}") from e
        timings[name] = time.perf_counter() - start
    results["timings"] = timings
    return results


def _worker(rank: int, checks: Callable[[int, str], None], world: int, out_dir: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    _CHECK_FILE.append(Path(out_dir, f"rank{rank}.check"))
    # A file store, not a TCP port: nothing to race for with other jobs on the machine.
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        checks(rank, out_dir)
    except BaseException:
        # torch.multiprocessing shows only a failed rank's exception type and message: keep the trace.
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(
    checks: Callable[[int, str], None], world: int, out_dir: str | Path, *, deadline_s: float = 600, timeout_s: float = 120
) -> list:
    """Run `checks(rank, out_dir)` on `world` spawned gloo ranks and return what each rank saved
    with ``torch.save(..., f"{out_dir}/rank{rank}.pt")``, in rank order.

    A rank that raises fails the call at once (the others are killed) with every failed rank's
    traceback; ranks still running after `deadline_s` are killed and the call fails. Each rank's
    collectives time out after `timeout_s`, and its process group is destroyed in any case.
    `checks` must be importable by name (a module-level function, or a `functools.partial` of one).
    """
    out_dir = str(out_dir)
    context = mp.start_processes(
        _worker, args=(checks, world, out_dir, timeout_s), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + deadline_s
    try:
        # join() raises as soon as one rank fails (and terminates the others).
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                running = ", ".join(f"{p.stem} in {p.read_text()!r}" for p in sorted(Path(out_dir).glob("rank*.check")))
                raise AssertionError(f"the ranks did not finish within {deadline_s} s" + (f" ({running})" if running else ""))
    except Exception as e:
        for p in context.processes:
            if p.is_alive():
                p.kill()
        errors = [p.read_text() for p in sorted(Path(out_dir).glob("rank*.error"))]
        # Each rank's last traceback line first (with run_checks: the rank and the check's name).
        headlines = "".join(f"{t.strip().splitlines()[-1]}\n" for t in errors if t.strip())
        traces = "\n".join(errors)
        raise AssertionError(f"a rank failed:\n{headlines}{traces or e}") from e
    return [torch.load(Path(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
