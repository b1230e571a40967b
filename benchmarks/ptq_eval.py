"""Perplexity on held-out token windows: the one definition both halves of
`bench_ptq_algorithms.py` use (the tq environment and the llmcompressor one), so a difference in
their figures can only come from the models. Imports only torch.
"""

from __future__ import annotations

import math

import torch


def windows(ids: torch.Tensor, seq: int) -> torch.Tensor:
    """`ids` (1-D) cut into non-overlapping rows of `seq` tokens; the tail that fills no row is dropped."""
    n = ids.numel() // seq
    if n == 0:
        raise ValueError(f"windows: {ids.numel()} tokens do not fill one window of seq={seq}")
    return ids[: n * seq].view(n, seq)


@torch.no_grad()
def perplexity(model: torch.nn.Module, rows: torch.Tensor, batch: int = 8) -> float:
    """exp(mean next-token negative log-likelihood) over every predicted position of `rows`
    (each row scored on its own: its first token is context only)."""
    model.eval()
    nll, count = 0.0, 0
    for i in range(0, rows.shape[0], batch):
        x = rows[i : i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


def peak_rss_mib() -> float:
    """This process's resident-memory high-water mark so far, MiB: Linux's VmHWM. (Not ru_maxrss: a
    process started by fork and exec reports its parent's mark there when the parent's was higher.)"""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 1024
