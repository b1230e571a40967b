"""The demo's picture: training loss per run, each recipe's loss gap to bf16, and the step time per run."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from tqcompile.demo.training import BASELINE, DemoConfig, RunResult

__all__ = ["ema", "plot_losses"]


def ema(values: Sequence[float], span: float) -> list[float]:
    """Exponential moving average with `alpha = 2 / (span + 1)`, bias-corrected (as Adam's moments)
    so that the first points are averages of what came so far, not pulled towards zero."""
    if span < 1:
        raise ValueError(f"ema: span={span}; allowed: >= 1")
    alpha, acc, weight, out = 2 / (span + 1), 0.0, 0.0, []
    for v in values:
        acc = (1 - alpha) * acc + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(acc / weight)
    return out


def plot_losses(results: Sequence[RunResult], path: str, cfg: DemoConfig | None = None, layout: str | None = None) -> str:
    """Write the demo's picture to `path` (PNG) and return a one-line note of what happened.

    Three panels: the training loss per run (smoothed), each recipe's loss gap to bf16 step by
    step (smoothed: the per-step gap is noise around a small mean), and the median step time per
    run, labelled with its ratio to bf16's. `cfg` (optional) adds the device and model size to the
    title, `layout` (optional, e.g. "FSDP2 2 = 2 processes") the parallel layout of a sharded run.

    matplotlib is a dependency of tqcompile; if it was removed anyway, nothing is written and the
    note says so."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"plot skipped: matplotlib is not installed (pip install matplotlib), so {path} was not written"
    ran = [r for r in results if r.losses]
    base = next((r for r in ran if r.name == BASELINE), None)
    colors = {r.name: f"C{i}" for i, r in enumerate(ran)}
    n_steps = max((len(r.losses) for r in ran), default=0)
    span = max(5, n_steps // 8)  # smoothing: about an eighth of the run

    fig, (ax_loss, ax_gap, ax_time) = plt.subplots(1, 3, figsize=(15, 4.6), gridspec_kw={"width_ratios": [1, 1.3, 0.8]})
    for r in ran:
        ax_loss.plot(ema(r.losses, span), color=colors[r.name], label=r.name, linewidth=2.2 if r is base else 1.2)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss, nats/byte (EMA)")
    ax_loss.set_title("loss: the curves overlap")
    ax_loss.legend(fontsize=8)

    ax_gap.axhline(0.0, color=colors.get(BASELINE, "k"), linewidth=1.2, label=f"{BASELINE} (reference)")
    if base is None:
        ax_gap.text(0.5, 0.5, "no bf16 run to compare with", ha="center", va="center", transform=ax_gap.transAxes)
    else:
        smoothed_all = [0.0]
        for r in ran:
            if r is base:
                continue
            n = min(len(r.losses), len(base.losses))
            gap = [a - b for a, b in zip(r.losses[:n], base.losses[:n])]
            smoothed = ema(gap, span)
            smoothed_all += smoothed
            # Only the smoothed gap: the raw per-step gap is noise several times larger, which ran
            # off the axis as faint lines once the axis was scaled to the smoothed curves.
            ax_gap.plot(
                smoothed, color=colors[r.name], linewidth=1.8, label=f"{r.name}: final {r.final_loss() - base.final_loss():+.4f}"
            )
        low, high = min(smoothed_all), max(smoothed_all)
        pad = 0.25 * (high - low) or 1e-3
        ax_gap.set_ylim(low - pad, high + pad)
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel(f"loss - {BASELINE} loss, same step")
    ax_gap.set_title(f"gap to {BASELINE} (EMA, span {span}): above 0 = behind")
    ax_gap.legend(fontsize=8)

    timed = [r for r in ran if len(r.step_times_s) > 1]
    ms = [r.step_ms() for r in timed]
    # Whiskers: the 25th to 75th percentile of the wall step times, so a noisy (shared) machine shows.
    quartiles = [
        statistics.quantiles([1000 * t for t in r.step_times_s[1:]], n=4) if len(r.step_times_s) > 2 else [m, m, m]
        for r, m in zip(timed, ms)
    ]
    whiskers = [[max(0.0, m - q[0]) for m, q in zip(ms, quartiles)], [max(0.0, q[2] - m) for m, q in zip(ms, quartiles)]]
    cpu_ms = [r.step_cpu_ms() for r in timed]
    show_cpu = (cfg is None or cfg.device == "cpu") and bool(timed) and all(c is not None for c in cpu_ms)
    width = 0.4 if show_cpu else 0.8
    xs = [i - width / 2 if show_cpu else i for i in range(len(timed))]
    colors_t = [colors[r.name] for r in timed]
    bars = ax_time.bar(xs, ms, width, color=colors_t, yerr=whiskers, capsize=3, label="wall (median, quartiles)")
    labelled = [(bars, ms, [m + w for m, w in zip(ms, whiskers[1])])]
    if show_cpu:
        cpu_bars = ax_time.bar(
            [x + width for x in xs], cpu_ms, width, color=colors_t, alpha=0.45, hatch="//", label="CPU time (median)"
        )
        labelled.append((cpu_bars, cpu_ms, cpu_ms))
        ax_time.legend(fontsize=7, loc="upper left")
    # The ratio to bf16 goes on the last bar group: CPU time where shown (the work a step does,
    # whatever else the machine runs), otherwise wall time. The x label says which.
    ratio_of = "CPU time" if show_cpu else "wall time"
    for k, (group, values, tops) in enumerate(labelled):
        base_value = next((v for r, v in zip(timed, values) if r is base), None) if k == len(labelled) - 1 else None
        for bar, r, value, top in zip(group, timed, values, tops):
            label = f"{value:.0f}" + (f"\n{value / base_value:.1f}x" if base_value and r is not base else "")
            x = bar.get_x() + bar.get_width() / 2
            ax_time.annotate(label, (x, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax_time.set_xticks(range(len(timed)), [r.name for r in timed])
    # Say what the labels are: "2.4x" alone was read as a speed-up.
    ax_time.set_xlabel(
        "bar labels: median ms" + (f"; N.Nx = {ratio_of} / {BASELINE}'s" if base is not None and len(timed) > 1 else ""),
        fontsize=8,
    )
    ax_time.set_ylabel("ms per step (median; compiling step 1 left out)")
    device = cfg.device if cfg is not None else None
    ax_time.set_title("step time" + (" (CPU: FP8/FP4 emulated)" if device == "cpu" else ""))
    ax_time.tick_params(axis="x", labelrotation=30, labelsize=8)
    # Room above the tallest whisker for the labels and the legend: autoscaling ignores the whiskers.
    tallest = max((t for _, _, tops in labelled for t in tops), default=0.0)
    if tallest > 0:
        ax_time.set_ylim(0, 1.45 * tallest)

    for ax in (ax_loss, ax_gap, ax_time):
        ax.grid(alpha=0.3)
    if cfg is not None:
        mc = cfg.model_config()
        mlp = f"MoE {mc.n_experts} experts" if mc.n_experts else "dense MLP"
        where = f"{layout}, {cfg.device}" if layout else cfg.device
        fig.suptitle(
            f"tqcompile demo: GPT {mc.n_layer} layers, d_model {mc.d_model}, {mlp}; {cfg.steps} steps on {where}, "
            f"torch {torch.__version__}, backend {cfg.backend}",
            fontsize=10,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}: loss, loss gap to {BASELINE} and step time per recipe"
