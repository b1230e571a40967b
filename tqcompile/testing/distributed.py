"""Run a function on several CPU processes over gloo: fast failure, no hang. The one process
launcher of the tests, the benchmarks and `tqcompile demo --fsdp N --tp M`.

`spawn` is the launcher; `run_ranks` is its form for tests, which collects what each rank saved:

    def _checks(rank: int, out_dir: str) -> None:      # module level: the ranks are spawned
        results = run_checks(rank, [("parity", lambda: _parity(rank)), ("bytes", lambda: _bytes(rank))])
        torch.save(results, f"{out_dir}/rank{rank}.pt")

    ranks = tq.testing.distributed.run_ranks(_checks, 2, tmp_path)   # [rank 0's results, rank 1's]
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "run_ranks", "run_checks", "CheckFailed"]


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


def _entry(
    rank: int,
    fn: Callable[..., Any],
    args: tuple,
    world_size: int,
    workdir: str,
    threads: int | None,
    collective_timeout_s: float | None,
) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    # A file store, not a TCP port: nothing to race for with other jobs on the machine.
    timeout = {} if collective_timeout_s is None else {"timeout": datetime.timedelta(seconds=collective_timeout_s)}
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size, **timeout)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # torch.multiprocessing keeps only an Exception's message, and nothing of a BaseException
        # (pytest.fail's): keep every failed rank's traceback for the caller.
        Path(workdir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without running C++ static destructors: a gloo or functional-collective
    # thread can still be joinable then, and its std::thread destructor aborts the process ("terminate
    # called without an active exception", SIGABRT after the group was destroyed: 2 exits in 25
    # measured on torch 2.13, CPU), which failed a rank that had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 600.0,
    threads: int | None = 1,
    collective_timeout_s: float | None = None,
) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` new processes, each a rank of one gloo
    process group, and wait for all of them. The group is destroyed when `fn` returns or raises.

    `fn` and `args` must be picklable (a module-level function). Raises
    `torch.multiprocessing.ProcessRaisedException` with every failed rank's traceback as soon as one
    rank fails (the one torch reports may be a peer that only saw the failure, "Connection reset by
    peer"), `ProcessExitedException` if one dies without a traceback, and `TimeoutError` after
    `timeout_s`; the other processes are stopped in each case. `threads`: torch CPU threads per
    process (None: torch's default, which oversubscribes a small machine quickly).
    `collective_timeout_s`: how long a collective waits for its peers (None: torch's default).

    Example:
        >>> spawn(my_check, 2, ("some arg",), timeout_s=120)   # my_check(rank, world_size, "some arg")
    """
    if world_size < 1:
        raise ValueError(f"spawn: world_size={world_size}; allowed: an integer >= 1")
    with tempfile.TemporaryDirectory(prefix="tqcompile-spawn-") as workdir:
        context = mp.start_processes(
            _entry,
            args=(fn, args, world_size, workdir, threads, collective_timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1.0):  # raises as soon as a rank fails, after stopping the rest
                if time.monotonic() > deadline:
                    raise TimeoutError(f"spawn: {world_size} processes still running after {timeout_s:.0f} s; stopped them")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            traces = "".join(
                f"\n\n-- rank {path.stem.removeprefix('rank')} raised:\n{path.read_text()}"
                for path in sorted(Path(workdir).glob("rank*.error"))
            )
            if traces:
                raise mp.ProcessRaisedException(traces, e.error_index, e.error_pid) from None
            raise
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.terminate()
            for p in context.processes:
                p.join(5)
                if p.is_alive():  # stuck where SIGTERM is not acted on
                    p.kill()
                    p.join()


def _check_with_out_dir(rank: int, world_size: int, checks: Callable[[int, str], None], out_dir: str) -> None:
    _CHECK_FILE.append(Path(out_dir, f"rank{rank}.check"))
    checks(rank, out_dir)


def run_ranks(
    checks: Callable[[int, str], None], world: int, out_dir: str | Path, *, deadline_s: float = 600, timeout_s: float = 120
) -> list:
    """Run `checks(rank, out_dir)` on `world` spawned gloo ranks (`spawn`) and return what each rank
    saved with ``torch.save(..., f"{out_dir}/rank{rank}.pt")``, in rank order.

    A rank that raises fails the call at once (the others are stopped) with an AssertionError that
    holds every failed rank's traceback; ranks still running after `deadline_s` are stopped and the
    call fails. Each rank's collectives time out after `timeout_s`, and its process group is
    destroyed in any case. `checks` must be importable by name (a module-level function, or a
    `functools.partial` of one).
    """
    out_dir = str(out_dir)
    try:
        spawn(_check_with_out_dir, world, (checks, out_dir), timeout_s=deadline_s, collective_timeout_s=timeout_s)
    except TimeoutError as e:
        running = ", ".join(f"{p.stem} in {p.read_text()!r}" for p in sorted(Path(out_dir).glob("rank*.check")))
        raise AssertionError(f"the ranks did not finish within {deadline_s} s" + (f" ({running})" if running else "")) from e
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        # Each failed rank's last traceback line first (with run_checks: the rank and the check's name).
        blocks = str(e).split("\n\n-- rank ")[1:]
        headlines = "".join(f"{b.strip().splitlines()[-1]}\n" for b in blocks if b.strip())
        raise AssertionError(f"a rank failed:\n{headlines}{e}") from e
    return [torch.load(Path(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
