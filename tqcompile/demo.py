"""`tqcompile demo`: train the same small GPT once in bf16 and once per recipe, compiled with
`fullgraph=True`, and compare losses, step times and what the compiler did.

Every run starts from the same initial weights (the bf16 model's, loaded into each converted
model), sees the same batches in the same order, and reseeds torch's global generator (NVFP4's
stochastic rounding draws its seeds there). What differs between runs is only the recipe.

Precision: parameters and optimizer state are fp32 in every run and the model runs under
`torch.autocast(dtype=torch.bfloat16)`. The bf16 baseline is exactly that; a recipe run
additionally runs the GEMMs of the blocks' linears (attention, MLP, MoE experts) in the recipe's
formats, while the embeddings, norms, attention itself, router and lm_head stay as in the baseline.

What is compiled: the model's forward and loss, `torch.compile(model, fullgraph=True)` (its
backward is compiled with it by AOTAutograd), and the AdamW step, also with `fullgraph=True`
(`tq.optim.compile_optimizer_step`). The learning rate is a tensor so the schedule never recompiles.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

import tqcompile as tq
from tqcompile.models.gpt import GPT, GPTConfig, quantize_model
from tqcompile.testing.compile import CompileCounter

__all__ = [
    "DemoConfig",
    "RunResult",
    "final_window",
    "ema",
    "load_corpus",
    "batch_offsets",
    "train",
    "run_demo",
    "format_table",
    "plot_losses",
]

BASELINE = "bf16"
DEFAULT_RECIPES = ("fp8_tensorwise", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """One demo run's settings (shared by every recipe in it)."""

    steps: int = 150
    batch_size: int = 2
    seq_len: int = 128
    n_layer: int = 2
    d_model: int = 128
    mlp_hidden: int = 512
    n_experts: int = 0
    lr: float = 1e-3
    warmup_steps: int = 10
    seed: int = 0
    device: str = "cpu"
    backend: str | None = "aot_eager"  # None: run eagerly, without torch.compile (the tests' fast path)
    log_every: int = 25

    def __post_init__(self) -> None:
        tokens = self.batch_size * self.seq_len
        if tokens % 128:
            raise ValueError(
                f"DemoConfig: batch_size * seq_len = {tokens} tokens per step; allowed: a multiple of 128 "
                "(the 1x128 blocks of fp8_blockwise run along the token dim in wgrad)"
            )
        if self.steps < 2:
            raise ValueError(f"DemoConfig: steps={self.steps}; allowed: >= 2 (the first step compiles, later ones are timed)")

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            seq_len=self.seq_len, n_layer=self.n_layer, d_model=self.d_model, mlp_hidden=self.mlp_hidden, n_experts=self.n_experts
        )


@dataclasses.dataclass
class RunResult:
    """What one training run (bf16 or one recipe) produced."""

    name: str
    losses: list[float] = dataclasses.field(default_factory=list)
    step_times_s: list[float] = dataclasses.field(default_factory=list)  # wall time
    step_cpu_times_s: list[float] = dataclasses.field(default_factory=list)  # the process's CPU time
    graph_breaks: int = 0
    graphs: int = 0
    recompiles: int = 0
    error: str | None = None  # why the run could not happen (e.g. a recipe the model cannot use)

    def final_loss(self) -> float:
        """Mean of the last `final_window(len(losses))` losses: smoother than the last step."""
        tail = self.losses[-final_window(len(self.losses)) :]
        return sum(tail) / len(tail)

    def step_ms(self) -> float:
        """Median step time after the first step (which compiles): robust to a busy machine."""
        return 1000 * statistics.median(self.step_times_s[1:])

    def step_cpu_ms(self) -> float | None:
        """Median CPU time of the process per step after the first, or None if not recorded.

        On a CPU run with one thread this is the work a step does: unlike wall time, it does not
        grow while the process waits for a core on a machine busy with other work."""
        return 1000 * statistics.median(self.step_cpu_times_s[1:]) if len(self.step_cpu_times_s) > 1 else None

    def first_step_s(self) -> float:
        return self.step_times_s[0]


def final_window(n_steps: int) -> int:
    """How many of the last losses "final loss" averages: a tenth of the run, at least 5 steps, and
    never more steps than ran."""
    return min(n_steps, max(5, n_steps // 10))


def load_corpus() -> torch.Tensor:
    """The packaged training text (`tqcompile/data/corpus.txt`) as a 1-D uint8 tensor of bytes."""
    raw = importlib.resources.files("tqcompile").joinpath("data/corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def batch_offsets(n_bytes: int, cfg: DemoConfig) -> torch.Tensor:
    """(steps, batch_size) start offsets of each training window, from `cfg.seed` only, so every
    run sees the same data in the same order."""
    g = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(0, n_bytes - cfg.seq_len - 1, (cfg.steps, cfg.batch_size), generator=g)


def _batch(data: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + torch.arange(seq_len + 1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_model(cfg: DemoConfig, init_state: dict, recipe: tq.Recipe | None) -> tuple[GPT, str | None]:
    """The demo GPT with `init_state`, converted with `recipe` (None: left in bf16), and the reason
    the recipe cannot take it (None when it can): every run, sharded or not, starts from this."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config())
    model.load_state_dict(init_state)
    if recipe is not None:
        try:
            quantize_model(model, recipe)
        except ValueError as e:
            return model, str(e)
    return model, None


def train(
    recipe: tq.Recipe | None,
    cfg: DemoConfig,
    init_state: dict[str, torch.Tensor],
    data: torch.Tensor,
    offsets: torch.Tensor,
    progress: Callable[[str], None] | None = None,
) -> RunResult:
    """Train a fresh GPT from `init_state` with `recipe` (None: the bf16 baseline), compiled."""
    name = BASELINE if recipe is None else recipe.name
    result = RunResult(name)
    device = torch.device(cfg.device)
    model, result.error = fresh_model(cfg, init_state, recipe)
    if result.error is not None:
        return result
    model.to(device)
    lr = torch.tensor(cfg.lr) if cfg.backend is not None else cfg.lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    # Linear warmup, then cosine decay to a tenth: without warmup, AdamW's first steps at full lr
    # can spike the loss of a freshly initialised model.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.warmup_steps, cfg.steps))

    counter = CompileCounter("eager")  # counts nothing when nothing is compiled
    compiled, opt_step = model, opt.step
    if cfg.backend is not None:
        # Dynamo's caches and counters are process-global: reset so that each run compiles afresh
        # and its counts are its own. One counter sees both graphs (model, optimizer step).
        torch.compiler.reset()
        counter = CompileCounter(cfg.backend)
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        opt_step = tq.optim.compile_optimizer_step(opt, backend=counter, fullgraph=True)
    for step, offs in enumerate(offsets):
        x, y = (t.to(device) for t in _batch(data, offs, cfg.seq_len))
        _sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = compiled(x, y)
            loss.backward()
            opt_step()
        except torch._dynamo.exc.Unsupported as e:  # fullgraph=True turns a graph break into this error
            result.error = f"graph break: {str(e).splitlines()[0]}"
            result.graph_breaks = max(1, counter.graph_breaks)
            return result
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # also waits for the device, so the time covers the whole step
        result.step_times_s.append(time.perf_counter() - start)
        result.step_cpu_times_s.append(time.process_time() - cpu_start)
        result.losses.append(loss_value)
        if progress is not None and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            progress(f"[{name:>20}] step {step:4d}/{cfg.steps}  loss {loss_value:.4f}  {1000 * result.step_times_s[-1]:8.1f} ms")
        if not math.isfinite(loss_value):
            result.error = f"loss became {loss_value} at step {step}"
            break
    result.graph_breaks, result.graphs, result.recompiles = counter.graph_breaks, counter.frame_count, counter.recompiles
    return result


def run_demo(recipes: Sequence[str], cfg: DemoConfig, progress: Callable[[str], None] | None = None) -> list[RunResult]:
    """The bf16 baseline, then one run per recipe name in `recipes`; results in that order."""
    recipe_objs = [tq.recipes.get(name) for name in recipes]  # fail on a bad name before training anything
    data = load_corpus()
    offsets = batch_offsets(data.numel(), cfg)
    torch.manual_seed(cfg.seed)
    init_state = {k: v.clone() for k, v in GPT(cfg.model_config()).state_dict().items()}
    return [train(r, cfg, init_state, data, offsets, progress) for r in (None, *recipe_objs)]


def _fmt_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def _ms_or_dash(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def format_table(results: Sequence[RunResult], cfg: DemoConfig) -> str:
    """The comparison table, with the setting it was measured in (model, device, torch version)."""
    mc = cfg.model_config()
    mlp = f"expert-choice MoE, {mc.n_experts} experts, capacity factor {mc.capacity_factor}" if mc.n_experts else "dense MLP"
    n_threads = torch.get_num_threads()
    threads = f", {n_threads} thread{'s' if n_threads != 1 else ''}" if cfg.device == "cpu" else ""
    device_name = torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else "cpu"
    head = [
        f"model: GPT {mc.n_layer} layers, d_model {mc.d_model}, {mlp}, byte vocab {mc.vocab_size}; "
        f"{cfg.batch_size}x{cfg.seq_len} tokens/step, {cfg.steps} steps, AdamW lr {cfg.lr} (warmup {cfg.warmup_steps}, cosine), seed {cfg.seed}",
        f"device: {device_name}{threads}; torch {torch.__version__}; torch.compile(fullgraph=True, backend={cfg.backend!r})",
        "bf16 = fp32 weights + bf16 autocast; recipes quantize the blocks' linears (lm_head and router stay bf16 autocast)",
        "",
    ]
    base = next((r for r in results if r.name == BASELINE and r.error is None and r.losses), None)
    cpu_col = cfg.device == "cpu"  # on CUDA the host's CPU time says little about the step
    header = (
        "recipe",
        "final loss",
        "vs bf16",
        "step ms",
        *(("cpu ms",) if cpu_col else ()),
        "1st step s",
        "graph breaks",
        "recompiles",
    )
    rows, notes = [], []
    for r in results:
        if r.error is not None and not r.losses and not r.graph_breaks:
            # Refused before training (the recipe cannot serve this model): a row would be all dashes.
            notes.append(f"{r.name}: not run: {r.error}")
            continue
        if r.error is not None:
            rows.append((r.name, "-", "-", "-", *(("-",) if cpu_col else ()), "-", str(r.graph_breaks), "-"))
            notes.append(f"{r.name}: not run to the end: {r.error}")
            continue
        gap = "-" if base is None or r is base else f"{r.final_loss() - base.final_loss():+.4f}"
        rows.append(
            (
                r.name,
                f"{r.final_loss():.4f}",
                gap,
                f"{r.step_ms():.1f}",
                *((_ms_or_dash(r.step_cpu_ms()),) if cpu_col else ()),
                f"{r.first_step_s():.1f}",
                str(r.graph_breaks),
                str(r.recompiles),
            )
        )
    foot = [
        "",
        f"final loss: mean of the last {final_window(cfg.steps)} step{'s' if final_window(cfg.steps) != 1 else ''}; "
        "step ms: median wall time after the first step; "
        + (
            "cpu ms: median CPU time of the process per step (unlike wall time, it does not grow on a busy machine); "
            if cpu_col
            else ""
        )
        + "1st step: includes compiling forward, backward and the optimizer step",
    ]
    return "\n".join(head + [_fmt_table(header, rows)] + foot + notes)


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


def plot_losses(results: Sequence[RunResult], path: str, cfg: DemoConfig | None = None) -> str:
    """Write the demo's picture to `path` (PNG) and return a one-line note of what happened.

    Three panels: the training loss per run (smoothed), each recipe's loss gap to bf16 step by
    step (smoothed: the per-step gap is noise around a small mean), and the median step time per
    run. `cfg` (optional) adds the device and model size to the title.

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
            ax_gap.plot(gap, color=colors[r.name], alpha=0.15, linewidth=0.8)  # the raw per-step gap, faint
            ax_gap.plot(
                smoothed, color=colors[r.name], linewidth=1.8, label=f"{r.name}: final {r.final_loss() - base.final_loss():+.4f}"
            )
        # Scale to the smoothed curves: the raw per-step gap is noise several times larger, and
        # would flatten them into the zero line.
        low, high = min(smoothed_all), max(smoothed_all)
        pad = 0.25 * (high - low) or 1e-3
        ax_gap.set_ylim(low - pad, high + pad)
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel(f"loss - {BASELINE} loss at the same step (EMA, span {span})")
    ax_gap.set_title(f"gap to {BASELINE}: above 0 = behind {BASELINE}")
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
    # whatever else the machine runs), otherwise wall time.
    for k, (group, values, tops) in enumerate(labelled):
        base_value = next((v for r, v in zip(timed, values) if r is base), None) if k == len(labelled) - 1 else None
        for bar, r, value, top in zip(group, timed, values, tops):
            label = f"{value:.0f}" + (f"\n{value / base_value:.1f}x" if base_value and r is not base else "")
            x = bar.get_x() + bar.get_width() / 2
            ax_time.annotate(label, (x, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax_time.set_xticks(range(len(timed)), [r.name for r in timed])
    ax_time.set_ylabel("ms per step (after step 1)")
    device = cfg.device if cfg is not None else None
    ax_time.set_title("step time" + (" (CPU: FP8/FP4 emulated)" if device == "cpu" else ""))
    ax_time.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax_time.margins(y=0.2)

    for ax in (ax_loss, ax_gap, ax_time):
        ax.grid(alpha=0.3)
    if cfg is not None:
        mc = cfg.model_config()
        mlp = f"MoE {mc.n_experts} experts" if mc.n_experts else "dense MLP"
        fig.suptitle(
            f"tqcompile demo: GPT {mc.n_layer} layers, d_model {mc.d_model}, {mlp}; {cfg.steps} steps on {cfg.device}, "
            f"torch {torch.__version__}, backend {cfg.backend}",
            fontsize=10,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}: loss, loss gap to {BASELINE} and step time per recipe"
