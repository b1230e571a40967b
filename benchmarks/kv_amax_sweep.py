"""How much a per-tensor FP8 KV amax alone moves perplexity: the anchor's KV amaxes (the max) scaled by
a common factor, and by independent random factors, each scored like `bench_kv_cache.py`'s rows.

    PYTHONPATH=. python benchmarks/kv_amax_sweep.py [--workdir ... --layers 2 --steps 1600 --seed 0] [--draws 12]

The model and data are `bench_ptq_algorithms.py`'s anchor (trained once into --workdir). tq calibrates
``tq.configs.fp8_kv_cache()`` with ``kv_scale_search="max"``; then every key and value amax is set to
``r * max`` for each common factor r, and for each draw to ``u * max`` with u uniform in [0.85, 1]
drawn per amax (seeded). A spread of perplexity and KL as wide as the gap between two scale rules
says that the gap is which code the largest keys round to, not a better rule (docs/ptq.md, KV cache).

Whether any rule could choose well: every setting's KL is also taken on the even and the odd
held-out windows apart and on the calibration rows, and the correlations over the settings are
printed. A setting that is better on one half of the text for a reason would be better on the other
half too (and on the calibration rows, which a rule can see); correlations near 0 say the ranking of
amaxes is the sample's noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_ptq_algorithms import add_anchor_args, anchor  # noqa: E402
from ptq_eval import scores  # noqa: E402

import tqcompile as tq  # noqa: E402

FACTORS = (0.90, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995, 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_anchor_args(p)
    p.add_argument("--draws", type=int, default=12, help="random draws of the per-amax factors")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    a = anchor(args, "data_sweep.pt")  # its own file: a bench_kv_cache.py run may be reading data_kv.pt
    calib, rows, reference = torch.load(a["data_path"])["calib"], a["eval_rows"], a["reference"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a["model_dir"], dtype=torch.float32).eval()
    cfg = tq.calibration.QuantConfig().with_rules(tq.configs.fp8_kv_cache())
    with torch.no_grad():
        tq.calibrate(model, cfg, lambda m: [m(input_ids=calib[i : i + 8]) for i in range(0, calib.shape[0], 8)],
                     kv_scale_search="max", progress=False)
    quantizers = [t for m in model.modules() if hasattr(m, "key_quantizer") for t in (m.key_quantizer, m.value_quantizer)]
    maxes = [t.amax.clone() for t in quantizers]

    halves = []  # per setting: KL on the even windows, the odd windows, the calibration rows (10⁻³)

    def scored(factors: list[float]) -> dict:
        for t, top, f in zip(quantizers, maxes, factors, strict=True):
            t.set_amax(top * f)
        with torch.no_grad():
            halves.append([scores(model, part, reference)["kl"] * 1e3 for part in (rows[0::2], rows[1::2], calib)])
            return scores(model, rows, reference)

    print(f"\n{len(quantizers)} per-tensor KV amaxes (the max): {[round(float(m), 3) for m in maxes]}")
    print("\n| all amaxes × | perplexity | KL (10⁻³) |\n|---|---|---|")
    for r in FACTORS:
        s = scored([r] * len(quantizers))
        print(f"| {r} | {s['ppl']:.4f} | {s['kl'] * 1e3:.3f} |", flush=True)
    gen = torch.Generator().manual_seed(123)
    draws = [scored((0.85 + 0.15 * torch.rand(len(quantizers), generator=gen)).tolist()) for _ in range(args.draws)]
    ppl, kl = [d["ppl"] for d in draws], [d["kl"] * 1e3 for d in draws]
    print(f"\n{args.draws} draws, each amax × U[0.85, 1]: perplexity {min(ppl):.4f} .. {max(ppl):.4f} (mean {statistics.mean(ppl):.4f}), "
          f"KL {min(kl):.2f} .. {max(kl):.2f} (mean {statistics.mean(kl):.2f}) × 10⁻³")
    even, odd, cal = torch.tensor(halves, dtype=torch.float64).T
    print(f"\nOver all {len(halves)} settings, correlation of the KL on the even held-out windows with the odd ones': "
          f"{_correlation(even, odd):+.2f}; of the calibration rows' with the even / odd windows': {_correlation(cal, even):+.2f} / "
          f"{_correlation(cal, odd):+.2f}. KL ranges: even {float(even.min()):.2f} .. {float(even.max()):.2f}, odd "
          f"{float(odd.min()):.2f} .. {float(odd.max()):.2f}, calibration {float(cal.min()):.2f} .. {float(cal.max()):.2f} × 10⁻³")


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


if __name__ == "__main__":
    main()
