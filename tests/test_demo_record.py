"""docs/demo.md's figures are those of one recorded run (`docs/img/demo_run.json`, written by
``tqcompile demo --plot docs/img/demo.png --results docs/img/demo_run.json``), the picture is drawn
from that run, and today's code still computes that run: a change to the numerics that leaves a
documented figure stale fails here, and says how to regenerate the page."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from tqcompile.demo import BASELINE, DemoConfig, batch_offsets, ema, format_table, load_corpus, load_results, run_demo

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "img" / "demo_run.json"
PAGE = ROOT / "docs" / "demo.md"
REGENERATE = (
    "regenerate the page's run: `python -m tqcompile.cli demo --plot docs/img/demo.png --results docs/img/demo_run.json` "
    "from the repository root, then copy its table and the sentences this test prints into docs/demo.md"
)


def _default_run_block() -> str:
    """The ```text block under "## The default run"."""
    text = PAGE.read_text()
    section = text[text.index("## The default run") :]
    return section[section.index("```text") + len("```text") : section.index("```", section.index("```text") + 7)]


def _rows(table: str) -> list[str]:
    """The rows and footer of a demo table: the lines after its dashes."""
    lines = table.strip("\n").splitlines()
    dashes = next(i for i, ln in enumerate(lines) if ln.startswith("---"))
    return [ln.rstrip() for ln in lines[dashes + 1 :] if ln.strip()]


def gap_sentence(runs) -> str:
    """What the page says of each recipe's smoothed loss gap to bf16, from the record (the same
    smoothing as the picture's middle panel)."""
    base = next(r for r in runs if r.name == BASELINE)
    span = max(5, len(base.losses) // 8)
    said = []
    for r in runs:
        if r.name == BASELINE:
            continue
        gap = ema([a - b for a, b in zip(r.losses, base.losses)], span)
        worst = max(range(len(gap)), key=lambda i: abs(gap[i]))
        said.append(f"{r.name} at most {gap[worst]:+.4f} (step {worst}), ending {gap[-1]:+.4f}")
    return "Smoothed gap to bf16: " + "; ".join(said) + "."


def test_the_page_shows_the_recorded_run():
    cfg, runs, record = load_results(str(RECORD))
    block = _default_run_block()
    assert _rows(format_table(runs, cfg)) == _rows(block), f"docs/demo.md's table is not the recorded run's: {REGENERATE}"
    env = record["environment"]
    page = PAGE.read_text()
    assert f"torch {env['torch']}" in block and f"on {env['date']}" in page, f"the page does not name the record's torch and date: {REGENERATE}"
    sentence = gap_sentence(runs)
    assert sentence in " ".join(page.split()), f"docs/demo.md should say: {sentence!r} ({REGENERATE})"


def test_the_picture_is_drawn_from_the_recorded_run():
    _, _, record = load_results(str(RECORD))
    picture = ROOT / "docs" / "img" / record["plot"]["file"]
    assert hashlib.sha256(picture.read_bytes()).hexdigest() == record["plot"]["sha256"], (
        f"docs/img/{picture.name} was not drawn by the recorded run: {REGENERATE}"
    )


def test_the_code_still_computes_the_recorded_losses():
    """The first steps of every recorded run, compiled as the demo compiles them. They are the
    recorded run's own first steps: the warmup's learning rate does not depend on the run's length,
    nor does the data order (checked). Tolerance: the same model and data through other kernels
    (eager against compiled, measured) move the third step's loss by 7e-6; the recipes differ from
    each other by more than 5e-4 at the first step; 2e-5 tells the two apart on any CPU."""
    cfg, runs, _ = load_results(str(RECORD))
    steps = 3
    short = DemoConfig(**{**cfg.__dict__, "steps": steps})
    n = load_corpus().numel()
    assert (batch_offsets(n, cfg)[:steps] == batch_offsets(n, short)).all()
    again = run_demo([r.name for r in runs if r.name != BASELINE], short)
    for recorded, now in zip(runs, again, strict=True):
        assert recorded.name == now.name
        diffs = [abs(a - b) for a, b in zip(recorded.losses[:steps], now.losses)]
        assert max(diffs) <= 2e-5, (
            f"{now.name}: the first {steps} losses are now {now.losses}, the record's {recorded.losses[:steps]}: the numerics "
            f"changed, so docs/demo.md's figures are stale: {REGENERATE}"
        )


def test_the_regeneration_command_is_the_one_the_page_gives():
    assert re.search(r"--plot docs/img/demo\.png --results docs/img/demo_run\.json", PAGE.read_text()), REGENERATE
