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
def scores(model: torch.nn.Module, rows: torch.Tensor, reference: torch.nn.Module | None = None, batch: int = 8) -> dict:
    """Over every predicted position of `rows` (each row scored on its own: its first token is
    context only): ``ppl``, exp(mean next-token negative log-likelihood); and with a `reference`
    model (the float one), ``kl``, the mean KL(reference || model) of the next-token distributions
    in nats, which separates near-lossless quantizations that perplexity alone cannot; ``row_nll``,
    each row's mean negative log-likelihood (for paired standard errors between two models)."""
    model.eval()
    nll, kl, count, row_nll = 0.0, 0.0, 0, []
    for i in range(0, rows.shape[0], batch):
        x = rows[i : i + batch]
        logp = model(input_ids=x).logits[:, :-1].float().log_softmax(-1)
        token_nll = -logp.gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
        row_nll += token_nll.mean(1).tolist()
        nll += token_nll.sum().item()
        logp = logp.flatten(0, 1)
        if reference is not None:
            ref = reference(input_ids=x).logits[:, :-1].float().log_softmax(-1).flatten(0, 1)
            kl += (ref.exp() * (ref - logp)).sum().item()
        count += x[:, 1:].numel()
    out = {"ppl": math.exp(nll / count), "row_nll": row_nll}
    if reference is not None:
        out["kl"] = kl / count
    return out


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """log(ppl_a) - log(ppl_b) from two models' `row_nll` on the same rows, and its standard error
    over the rows (paired: the text's difficulty, shared by both, cancels)."""
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    return d.mean().item(), (d.std() / math.sqrt(d.numel())).item()


def peak_rss_mib() -> float:
    """This process's resident-memory high-water mark so far, MiB: Linux's VmHWM. (Not ru_maxrss: a
    process started by fork and exec reports its parent's mark there when the parent's was higher.)"""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 1024
