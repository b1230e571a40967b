"""`tqcompile demo` end to end through `tqcompile.cli.main`, and its argument errors."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tqcompile as tq
from tqcompile.cli import build_parser, main
from tqcompile.demo import GPT, DemoConfig, GPTConfig, RunResult, ema, final_window, format_table, plot_losses, quantize_model

ROOT = Path(__file__).resolve().parents[1]

COLUMNS = ("recipe", "final loss", "vs bf16", "step ms", "cpu ms", "1st step s", "graph breaks", "recompiles")


def test_demo_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = main(["demo", "--recipes", "fp8_tensorwise", "--steps", "3", "--plot", "none"])
    out, err = capsys.readouterr()
    # The compiled optimizer step tells the LR scheduler it stepped (tq.optim.compile_optimizer_step).
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in caught]
    # The footer names the window that was averaged: 3 steps ran, so 3, not "the last 5".
    assert "final loss: mean of the last 3 steps;" in out, out
    assert status == 0, out + err
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("recipe"))
    for col in COLUMNS:
        assert col in header, header
    rows = {
        ln.split()[0]: ln.split() for ln in lines[lines.index(header) + 2 :] if ln.strip() and not ln.startswith("final loss")
    }
    assert set(rows) == {"bf16", "fp8_tensorwise"}, out
    for name, cells in rows.items():
        # final loss, gap, step ms, cpu ms, 1st step s, graph breaks, recompiles
        assert float(cells[1]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0, cells
        assert cells[-2:] == ["0", "0"], f"{name}: graph breaks / recompiles {cells[-2:]}"
    assert rows["bf16"][2] == "-" and rows["fp8_tensorwise"][2].startswith(("+", "-")), rows
    assert f"torch {torch.__version__}" in out and "device: cpu" in out
    # Progress goes to stderr, one line for the first and one for the last step of each run.
    assert "[      fp8_tensorwise] step    0/3" in err and "step    2/3" in err, err
    # ... said before the silent compile, with the unit of each time, the compiling step apart.
    lines = err.splitlines()
    compiling = lines.index(
        "[      fp8_tensorwise] compiling (the first step compiles forward, backward and the optimizer step) ..."
    )
    assert lines[compiling + 1].startswith("[      fp8_tensorwise] step    0/3  loss "), err
    assert re.search(r"step    0/3  loss \d\.\d{4}  compile \+ step +\d+\.\d s$", lines[compiling + 1]), err
    assert re.search(r"^\[      fp8_tensorwise\] step    2/3  loss \d\.\d{4}  step time +\d+\.\d ms$", err, re.M), err
    # The dense model has no router: the table does not say one stays in bf16.
    assert "(lm_head stays bf16 autocast)" in out and "router" not in out, out


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


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"tqcompile {tq.__version__}"


def test_short_version_flag_is_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    # argparse users expect -V for --version (python -V, pip -V); it printed a usage error.
    with pytest.raises(SystemExit) as exc:
        main(["-V"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"tqcompile {tq.__version__}"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_help_lists_the_recipes(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for name in tq.recipes.RECIPES:
        assert name in text, f"{name} missing from:\n{text}"


def test_the_table_names_the_router_only_for_a_moe_model() -> None:
    runs = [RunResult("bf16", losses=[3.0, 2.0], step_times_s=[5.0, 0.1])]
    assert "(lm_head and router stay bf16 autocast)" in format_table(runs, DemoConfig(steps=2, n_experts=4))
    dense = format_table(runs, DemoConfig(steps=2))
    assert "(lm_head stays bf16 autocast)" in dense and "router" not in dense, dense


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "tqcompile.cli", *argv], capture_output=True, text=True, env=env, timeout=300)


def test_help_and_version_print_no_warnings() -> None:
    # Without numpy, `import torch` printed "Failed to initialize NumPy" on every command (numpy is
    # a dependency now); stderr must be clean, `--help` included.
    for argv in (["--help"], ["demo", "--help"], ["--version"]):
        proc = _cli(*argv)
        assert proc.returncode == 0, proc.stderr
        # Nothing at all: torch 2.14's deprecation lines (its renamed opaque-type API) start with "W1127 ...".
        assert proc.stderr == "", f"{argv}: {proc.stderr}"
    assert proc.stdout.strip() == f"tqcompile {tq.__version__}"


@pytest.mark.parametrize("where", ["missing directory", "a directory", "under a file", "read-only directory"])
def test_an_unwritable_plot_path_is_a_usage_error_before_any_training(where: str, tmp_path, capsys) -> None:
    # It trained every run, then died in PIL's savefig with a long traceback.
    (tmp_path / "a_file").write_text("")
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    if where == "read-only directory" and os.access(read_only, os.W_OK):
        pytest.skip("this user (root) can write to a read-only directory")
    path = {
        "missing directory": tmp_path / "no_such_dir" / "loss.png",
        "a directory": tmp_path,
        "under a file": tmp_path / "a_file" / "loss.png",
        "read-only directory": read_only / "loss.png",
    }[where]
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--recipes", "fp8_tensorwise", "--steps", "2", "--plot", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--plot {path}: " in err and "--plot none" in err, err
    assert "steps each" not in err and "step    0" not in err, err  # no run started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "read_only"]  # the check leaves nothing behind
    if where == "missing directory":  # --results is checked the same way
        with pytest.raises(SystemExit) as exc:
            main(["demo", "--recipes", "fp8_tensorwise", "--steps", "2", "--plot", "none", "--results", str(path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"--results {path}: its directory" in err and "step    0" not in err, err


def test_final_window_never_exceeds_the_steps_that_ran() -> None:
    assert [final_window(n) for n in (2, 3, 5, 49, 50, 150, 1000)] == [2, 3, 5, 5, 5, 15, 100]
    assert RunResult("bf16", losses=[4.0, 2.0, 3.0]).final_loss() == 3.0


def test_a_refused_recipe_is_one_line_not_a_row_of_dashes() -> None:
    # What the demo does with --moe and a recipe that cannot serve the experts (2-D blocks on tokens).
    two_d = dataclasses.replace(tq.recipes.fp8_blockwise(), name="fp8_delayed", fprop_input=tq.recipes.fp8_blockwise().fprop_weight)
    with pytest.raises(ValueError) as exc:
        quantize_model(GPT(GPTConfig(n_layer=2, n_experts=4)), two_d)
    reason = str(exc.value)
    assert "cannot serve 4 layers (blocks.0.mlp.w_in, blocks.0.mlp.w_out, blocks.1.mlp.w_in, blocks.1.mlp.w_out): " in reason
    assert reason.count("2-D blocks") == 1, reason  # the reason is said once, not once per layer
    cfg = DemoConfig(steps=3, n_experts=4)
    base = RunResult("bf16", losses=[3.0, 2.5, 2.0], step_times_s=[5.0, 0.1, 0.1])
    table = format_table([base, RunResult("fp8_delayed", error=reason)], cfg)
    lines = table.splitlines()
    mentions = [ln for ln in lines if "fp8_delayed" in ln]
    assert mentions == [f"fp8_delayed: not run: {reason}"], table
    separator = next(i for i, ln in enumerate(lines) if ln.startswith("recipe")) + 1
    rows = [ln for ln in lines[separator + 1 :] if ln.strip() and not ln.startswith(("final loss", "fp8_delayed"))]
    assert [r.split()[0] for r in rows] == ["bf16"], table


def test_ema_is_bias_corrected() -> None:
    assert ema([2.0, 2.0, 2.0], span=9) == pytest.approx([2.0, 2.0, 2.0])
    alpha = 2 / (3 + 1)
    assert ema([0.0, 1.0], span=3) == pytest.approx([0.0, alpha / (1 - (1 - alpha) ** 2)])
    with pytest.raises(ValueError, match="allowed: >= 1"):
        ema([1.0], span=0)


def test_plot_is_skipped_with_a_note_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    path = tmp_path / "loss.png"
    note = plot_losses([RunResult("bf16", losses=[3.0, 2.0])], str(path))
    assert "matplotlib is not installed" in note and not path.exists()


def test_plot_writes_a_png_with_the_gap_and_the_step_times(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.figure  # a dependency: the README's install command gives it

    saved: list[matplotlib.figure.Figure] = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k))[1])
    path = tmp_path / "loss.png"
    results = [
        RunResult(
            "bf16", losses=[3.0, 2.0, 1.5, 1.2], step_times_s=[5.0, 0.04, 0.04, 0.05], step_cpu_times_s=[4.0, 0.03, 0.03, 0.03]
        ),
        RunResult(
            "mxfp8", losses=[3.1, 2.1, 1.6, 1.3], step_times_s=[6.0, 0.11, 0.12, 0.11], step_cpu_times_s=[5.0, 0.1, 0.1, 0.1]
        ),
        RunResult("fp8_delayed", error="recipe 'fp8_delayed' cannot serve ..."),
    ]
    note = plot_losses(results, str(path), DemoConfig(steps=4))
    assert str(path) in note and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = saved
    ax_loss, ax_gap, ax_time = fig.axes
    (gap_curve,) = [ln for ln in ax_gap.get_lines() if ln.get_label().startswith("mxfp8")]
    assert gap_curve.get_ydata() == pytest.approx([0.1] * 4)  # mxfp8 - bf16 at each step, smoothed
    assert [t.get_text() for t in ax_time.get_xticklabels()] == ["bf16", "mxfp8"]
    # Median ms after the first step: wall time, then CPU time (the work, whatever else the machine runs).
    assert [round(p.get_height()) for p in ax_time.patches] == [40, 110, 30, 100]
    assert "3.3x" in [t.get_text().split("\n")[-1] for t in ax_time.texts]  # mxfp8 / bf16, by CPU time
    # The picture says what "3.3x" is, and draws nothing outside its axes: faint raw-gap lines ran off the gap panel.
    assert ax_time.get_xlabel() == "bar labels: median ms; N.Nx = CPU time / bf16's"
    low, high = ax_gap.get_ylim()
    for line in ax_gap.get_lines():
        assert all(low <= y <= high for y in line.get_ydata()), (line.get_label(), line.get_ydata(), (low, high))
