"""docs/choosing.md ("which recipe should I choose") cannot drift from the code.

Its "what is quantized how" tables are generated here from `tq.recipes.RECIPES` and the PTQ
presets of `tq.configs`, and must appear on the page verbatim; a failing test prints the table to
paste. Its "which one to pick" tables must have one row per recipe and per preset, in order.
"""

from __future__ import annotations

import re
from pathlib import Path

import tqcompile as tq
from tqcompile.quantizers import Float8Quantizer, Granularity, MXQuantizer, NVFP4Quantizer, Quantizer

PAGE = Path(__file__).resolve().parents[1] / "docs" / "choosing.md"
PTQ_PRESETS = ("int8", "int8_dynamic", "int8_weight_only", "int4_weight_only", "fp8", "mxfp8", "mxfp6", "mxfp4_weight_only", "nvfp4")  # every QuantConfig constructor in tq.configs
# Not rows of their own: the general form of int4/int8_weight_only, and a rule (not a config) to add to any preset.
NOT_PRESETS = ("int_weight_only", "fp8_kv_cache", "default_disabled")


def describe(q: Quantizer | None | bool) -> str:
    """One quantizer in a few words: element format, which elements share a scale, options."""
    if not isinstance(q, Quantizer):  # None (a recipe's high-precision wgrad) or False (a preset's input off)
        return "high precision"
    granularity, _, block = q.layout()
    grain = {
        Granularity.TENSORWISE: "per tensor",
        Granularity.ROWWISE: "per row",
        Granularity.BLOCKWISE_1D: f"1×{block} blocks",
        Granularity.BLOCKWISE_2D: f"{block}×{block} blocks",
    }[granularity]
    fmt = q.element_format().name
    grid = getattr(q, "grid", tq.IntGrid.SYMMETRIC)
    name = {MXQuantizer: f"MX {fmt}", NVFP4Quantizer: "NVFP4"}.get(type(q), fmt)
    options = []
    if isinstance(q, Float8Quantizer) and q.power_of_two_scale:
        options.append("2^k scales")
    if isinstance(q, MXQuantizer):
        options.append(f"E8M0 scales, {q.scale_rounding.name}")
    if isinstance(q, NVFP4Quantizer):
        options += ["stochastic rounding"] * q.stochastic_rounding + ["Hadamard"] * q.hadamard
    if grid is not tq.IntGrid.SYMMETRIC:
        options.append(f"{grid.name} grid")
    return ", ".join([f"{name} {grain}", *options])


def _gemm(a_name: str, a: Quantizer | None, b_name: str, b: Quantizer | None) -> str:
    da, db = describe(a), describe(b)
    return f"{a_name}, {b_name}: {da}" if da == db else f"{a_name}: {da}; {b_name}: {db}"


def recipe_table() -> str:
    """The training recipes: each GEMM's two operands, and how the scales are found."""
    rows = [
        "| recipe | fprop `y = x·Wᵀ` | dgrad `dx = dy·W` | wgrad `dW = dyᵀ·x` | scales from |",
        "|---|---|---|---|---|",
    ]
    for name in tq.recipes.RECIPES:
        r = tq.recipes.get(name)
        scales = f"the last {r.amax_history_len} amaxes (delayed)" if r.amax_history_len else "the tensor itself (current)"
        rows.append(
            f"| `{name}` | {_gemm('x', r.fprop_input, 'W', r.fprop_weight)} | {_gemm('dy', r.dgrad_grad, 'W', r.dgrad_weight)} "
            f"| {_gemm('dy', r.wgrad_grad, 'x', r.wgrad_input)} | {scales} |"
        )
    return "\n".join(rows)


def preset_table() -> str:
    """The PTQ/QAT presets: the quantizers of the rule that enables the GEMM layers."""
    rows = ["| preset | activations (layer input) | weights |", "|---|---|---|"]
    for name in PTQ_PRESETS:
        rule = getattr(tq.configs, name)().rules[0]
        rows.append(f"| `tq.configs.{name}()` | {describe(rule.input)} | {describe(rule.weight)} |")
    return "\n".join(rows)


def _first_column(heading: str) -> list[str]:
    """The backticked names in the first column of the first table under `heading`."""
    section = PAGE.read_text().split(heading, 1)[1]
    table = re.search(r"((?:^\|.*\n)+)", section, flags=re.M).group(1).splitlines()[2:]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in table]


def test_the_recipe_table_is_the_code():
    assert recipe_table() in PAGE.read_text(), f"docs/choosing.md must hold this table (paste it):\n\n{recipe_table()}\n"


def test_the_preset_table_is_the_code():
    assert preset_table() in PAGE.read_text(), f"docs/choosing.md must hold this table (paste it):\n\n{preset_table()}\n"


def test_every_recipe_and_preset_has_advice():
    assert _first_column("## Which recipe to pick") == list(tq.recipes.RECIPES)
    assert _first_column("## Which preset to pick") == [f"tq.configs.{n}()" for n in PTQ_PRESETS]


def test_the_preset_list_is_every_preset():
    # A new preset in tq.configs must get a row: every public constructor returning a QuantConfig.
    public = [n for n in tq.configs.__all__ if callable(getattr(tq.configs, n)) and n not in NOT_PRESETS]
    assert sorted(public) == sorted(PTQ_PRESETS), public


def test_describe():
    assert describe(tq.recipes.fp8_blockwise().fprop_weight) == "E4M3 128×128 blocks, 2^k scales"
    assert describe(tq.recipes.nvfp4().wgrad_grad) == "NVFP4 1×16 blocks, stochastic rounding, Hadamard"
    assert describe(tq.configs.int8().rules[0].weight) == "INT8 per row, FULL grid"
    assert describe(None) == describe(False) == "high precision"
