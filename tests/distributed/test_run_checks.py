"""`tq.testing.run_checks` inside `run_ranks`: one spawn runs several named checks, and a failure
names the check and the rank that failed (not only a traceback), on the rank and in the test."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tqcompile.testing import CheckFailed, distributed, run_checks, run_ranks


def _rank_checks(rank: int, out_dir: str) -> None:
    def second() -> None:
        if rank == 1:
            raise ValueError(f"rank {rank} sees 1 != 0")

    results = run_checks(rank, [("first", lambda: dist.get_world_size()), ("second", second), ("third", lambda: 3)])
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_a_failed_check_is_named_with_its_rank(tmp_path) -> None:
    results = run_checks(0, [("one", lambda: 1), ("none", lambda: None)])
    assert results.keys() == {"one", "none", "timings"} and results["one"] == 1 and results["none"] is None
    assert results["timings"].keys() == {"one", "none"} and all(t >= 0 for t in results["timings"].values())
    with pytest.raises(CheckFailed, match=r"^rank 3: check 'two' failed: ZeroDivisionError: division by zero$") as failed:
        run_checks(3, [("one", lambda: 1), ("two", lambda: 1 / 0), ("never", lambda: pytest.fail("ran after a failure"))])
    assert isinstance(failed.value.__cause__, ZeroDivisionError)
    with pytest.raises(ValueError, match=r"check name 'timings' is taken"):
        run_checks(0, [("timings", lambda: 1)])
    # In a spawned rank, the check running is written down for a run killed at its deadline to name.
    check_file = tmp_path / "rank0.check"
    distributed._CHECK_FILE.append(check_file)
    try:
        assert run_checks(0, [("first", lambda: 1), ("second", lambda: check_file.read_text())])["second"] == "second"
        assert check_file.read_text() == "second"
    finally:
        distributed._CHECK_FILE.remove(check_file)

    with pytest.raises(AssertionError) as spawned:
        run_ranks(_rank_checks, 2, tmp_path, deadline_s=120)
    message = str(spawned.value)
    # The first line after the headline names the rank and the check; the traceback follows.
    headline = message.splitlines()[1]
    assert headline.endswith("CheckFailed: rank 1: check 'second' failed: ValueError: rank 1 sees 1 != 0"), message
    assert "Traceback" in message and "raise ValueError" in message, message
