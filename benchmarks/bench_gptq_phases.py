"""Seconds per phase of GPTQ on one down_proj-shaped weight (issue 28 item 4), one thread.

    PYTHONPATH=. python benchmarks/bench_gptq_phases.py [--out 1024] [--in 8192] [--tokens 1024]

The weight (out, in) and the inputs (tokens, in) are random (the inputs correlated: low rank plus
noise, channels of unequal size, as activations are), the Hessian ``2 X^T X / n`` in float64 as
`LayerStats` hands it over; INT4 groups of 128, `tq.GPTQ()` defaults (act_order). Phases are timed
by wrapping gptq.py's own functions (the factorisation: Cholesky, then the rest of it; round to
nearest; the output errors of the comparison with it); "columns" is the rest: the column loop
and its lazy block updates. Seconds are the process's CPU seconds (one thread: its work, which a machine
shared with other jobs stretches less than wall time). It prints a table and the output error
``tr(D H D^T)`` of the result.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from tqcompile.calibration import gptq
from tqcompile.formats import Format
from tqcompile.quantizers import Granularity, IntQuantizer


@contextlib.contextmanager
def _timed(owner, name: str, seconds: dict, label: str):
    """Wrap ``owner.name`` (if it exists) so that its outermost calls add their wall time to
    ``seconds[label]`` (a recursive function counts once)."""
    original = getattr(owner, name, None)
    if original is None:
        yield
        return
    depth = [0]

    def wrapper(*args, **kwargs):
        t = time.process_time()
        depth[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                seconds[label] = seconds.get(label, 0.0) + time.process_time() - t

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=int, default=1024)
    p.add_argument("--in", dest="in_f", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--group", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, 64, generator=g) @ torch.randn(64, args.in_f, generator=g) * 0.1
    x += torch.randn(args.tokens, args.in_f, generator=g)
    x *= torch.linspace(0.2, 3.0, args.in_f)
    h = gptq.hessian(x)
    w = torch.randn(args.out, args.in_f, generator=g) * 0.02
    q = IntQuantizer(Format.INT4, Granularity.BLOCKWISE_1D, block_size=args.group)
    seconds: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_timed(torch.linalg, "cholesky_ex", seconds, "cholesky"))
        stack.enter_context(_timed(gptq, "_inverse_cholesky", seconds, "factor"))
        stack.enter_context(_timed(gptq, "_rtn", seconds, "rtn"))
        stack.enter_context(_timed(gptq, "_output_error", seconds, "output error"))  # before issue 28 item 4
        stack.enter_context(_timed(gptq, "_damped_error", seconds, "output error"))  # after
        stack.enter_context(_timed(gptq, "_gptq", seconds, "total"))
        r = gptq._gptq(w, h, q, gptq.GPTQ(), "down_proj")  # h handed over, as LayerStats does
    del h
    # tr(D H D^T) = 2 |X D^T|^2 / n from the inputs: a GEMM with the tokens instead of the Hessian's n^2.
    err = float(2 * (x.double() @ (w - r.q.float()).double().T).square().sum() / x.shape[0])
    rest = seconds["total"] - seconds["factor"] - seconds.get("rtn", 0) - seconds.get("output error", 0)
    seconds["triangular inverse (+ reordering)"] = seconds["factor"] - seconds["cholesky"]
    print(f"GPTQ INT4 g{args.group}, weight {args.out} x {args.in_f}, {args.tokens} tokens, 1 thread, how={r.how}")
    print("| phase | CPU s |\n|---|---:|")
    for k in ("cholesky", "triangular inverse (+ reordering)", "rtn", "output error"):
        if k in seconds:
            print(f"| {k} | {seconds[k]:.2f} |")
    print(f"| columns (loop + lazy updates + rest) | {rest:.2f} |")
    print(f"| **total** | {seconds['total']:.2f} |")
    print(f"output error tr(D H D^T) = {err:.6e}")


if __name__ == "__main__":
    main()
