"""`tqcompile demo` end to end through `tqcompile.cli.main`, and its argument errors."""

from __future__ import annotations

import sys

import pytest
import torch

import tqcompile as tq
from tqcompile.cli import build_parser, main
from tqcompile.demo import RunResult, plot_losses

COLUMNS = ("recipe", "final loss", "vs bf16", "step ms", "1st step s", "graph breaks", "recompiles")


def test_demo_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["demo", "--recipes", "fp8_tensorwise", "--steps", "3", "--plot", "none"])
    out, err = capsys.readouterr()
    assert status == 0, out + err
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("recipe"))
    for col in COLUMNS:
        assert col in header, header
    rows = {ln.split()[0]: ln.split() for ln in lines[lines.index(header) + 2 :] if ln.strip() and not ln.startswith("final loss")}
    assert set(rows) == {"bf16", "fp8_tensorwise"}, out
    for name, cells in rows.items():
        # final loss, gap, step ms, 1st step s, graph breaks, recompiles
        assert float(cells[1]) > 0, cells
        assert cells[-2:] == ["0", "0"], f"{name}: graph breaks / recompiles {cells[-2:]}"
    assert rows["bf16"][2] == "-" and rows["fp8_tensorwise"][2].startswith(("+", "-")), rows
    assert f"torch {torch.__version__}" in out and "device: cpu" in out
    # Progress goes to stderr, one line for the first and one for the last step of each run.
    assert "[      fp8_tensorwise] step    0/3" in err and "step    2/3" in err, err


def test_unknown_recipe_names_the_allowed_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--recipes", "fp8_tensorwise,fp9"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'fp9'" in err
    for name in tq.recipes.RECIPES:
        assert name in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "1"], "allowed: an integer >= 2"),
        (["--steps", "many"], "allowed: an integer >= 2"),
        (["--threads", "0"], "allowed: an integer >= 1"),
        (["--backend", "tvm"], "inductor"),  # argparse: "invalid choice: ... (choose from ...)"
    ],
)
def test_bad_arguments_exit_with_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv, "--plot", "none"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given when no CUDA device exists")
def test_cuda_without_a_device_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--device", "cuda", "--plot", "none"])
    assert "no CUDA device" in capsys.readouterr().err


def test_recipes_all_and_defaults() -> None:
    parser = build_parser()
    assert parser.parse_args(["demo", "--recipes", "all"]).recipes == list(tq.recipes.RECIPES)
    args = parser.parse_args(["demo"])
    assert args.recipes == ["fp8_tensorwise", "mxfp8", "nvfp4"] and args.device == "cpu" and args.backend is None


def test_plot_is_skipped_with_a_note_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    path = tmp_path / "loss.png"
    note = plot_losses([RunResult("bf16", losses=[3.0, 2.0])], str(path))
    assert "matplotlib is not installed" in note and not path.exists()


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "loss.png"
    note = plot_losses([RunResult("bf16", losses=[3.0, 2.0]), RunResult("mxfp8", losses=[3.1, 2.1])], str(path))
    assert str(path) in note and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
