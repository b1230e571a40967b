"""Start a function on every rank of a CPU process group, or join the group `torchrun` made.

`spawn` starts `world_size` processes on this machine (torch.multiprocessing, "spawn" start
method), each with a gloo process group on a free localhost port; a rank that raises makes
`spawn` raise at once (the others are terminated), and a run past `timeout_s` is terminated and
raises `TimeoutError`, so a caller (a test, the demo) never hangs. `init_from_torchrun` joins the
group whose `RANK` / `WORLD_SIZE` / `LOCAL_RANK` environment `torchrun` set (NCCL on CUDA, gloo
otherwise). Both destroy the process group when the function returns or raises.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "under_torchrun", "spawn", "process_group"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True when this process was started by `torchrun` (its RANK, WORLD_SIZE and LOCAL_RANK are set)."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


@contextmanager
def process_group(backend: str, rank: int | None = None, world_size: int | None = None) -> Iterator[None]:
    """Init the default process group (from the environment when rank/world_size are None, as
    under torchrun), and destroy it on exit, whatever happened inside."""
    if rank is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, threads: int | None) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    if threads is not None:
        torch.set_num_threads(threads)
    with process_group("gloo", rank, world_size):
        fn(rank, world_size, *args)


def spawn(
    fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 600.0, threads: int | None = 1
) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` new processes, each in a gloo process
    group, and wait for all of them.

    `fn` and `args` must be picklable (a module-level function). Raises
    `torch.multiprocessing.ProcessRaisedException` (with the rank's traceback) as soon as one rank
    raises, `ProcessExitedException` if one dies, and `TimeoutError` after `timeout_s`; the other
    processes are terminated in each case. `threads`: torch CPU threads per process (None: torch's
    default, which oversubscribes a small machine quickly).
    """
    if world_size < 1:
        raise ValueError(f"spawn: world_size={world_size}; allowed: an integer >= 1")
    ctx = mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args, threads), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):  # raises as soon as a rank fails, after terminating the rest
            if time.monotonic() > deadline:
                raise TimeoutError(f"spawn: {world_size} processes still running after {timeout_s:.0f} s; terminated them")
    except mp.ProcessRaisedException as e:
        # The rank torch reports may be a peer that only saw the failure ("Connection reset by
        # peer"); give every rank's traceback, so the one that failed first is in the message.
        traces = _tracebacks(ctx.error_files)
        if len(traces) > 1:
            raise mp.ProcessRaisedException("".join(traces), e.error_index, e.error_pid) from None
        raise
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)


def _tracebacks(error_files: list[str]) -> list[str]:
    """The tracebacks that failed ranks wrote (torch.multiprocessing pickles them into these files)."""
    traces = []
    for rank, path in enumerate(error_files):
        try:
            with open(path, "rb") as fh:
                traces.append(f"\n\n-- rank {rank} raised:\n{pickle.load(fh)}")
        except (OSError, EOFError, pickle.UnpicklingError):  # this rank wrote nothing: it did not raise
            pass
    return traces
