"""Check that every rank of a group set up a layer the same way, before any collective depends on it.

Ranks that convert, shard or parallelize a model differently exchange buffers of different sizes
or layouts: gloo aborts the process ("147712 vs 4"), a collective waits for a peer that never
joins it, or, worst, the numbers are silently wrong (one rank scales with a delayed amax history,
the other with the current amax). So the places that first depend on an agreement (a TP style
sharding a layer, a weight's first quantized FSDP2 gather) publish a description of what this
rank does, read every other rank's, and raise the same `ValueError` on every rank, naming the layer
and the two descriptions, when they differ.

The exchange goes through the process group's key-value store, not a collective: a rank that
never runs this check (it did not convert the model, or gathers the weight in high precision)
cannot meet it with a collective of another size. Such a rank is simply missing from the store,
and the ranks that wait for it raise after `TIMEOUT_S` seconds (or the store's own timeout, the
`timeout` given to `init_process_group`, when that is shorter) with an error that says so; the
missing rank, stuck in its own collective, then fails when its peers exit. Nothing waits for the
process group's 30-minute default.

Rounds: each call adds 1 to a counter in the store; with `n` ranks, the k-th call of every rank
draws a number in [k*n + 1, (k+1)*n], so the ranks agree on the round without talking. A rank
cannot start round k+1 before every rank has published round k (it waited for them), so the
counter never mixes rounds.
"""

from __future__ import annotations

import datetime
import json
import zlib

import torch.distributed as dist

from tqcompile.recipes import Recipe

__all__ = ["TIMEOUT_S", "check_ranks_agree", "recipe_fact"]

TIMEOUT_S = 60.0


def recipe_fact(recipe: Recipe | None) -> str:
    """How a module is converted, for `check_ranks_agree`: its recipe's name and a checksum of its
    repr (which catches two custom recipes of one name), or "not converted"."""
    if not isinstance(recipe, Recipe):
        return "not converted"
    return f"{recipe.name!r} (#{zlib.crc32(repr(recipe).encode()):08x})"


def _store() -> dist.Store:
    # Private: the default group's store is the only one every rank can reach without a collective;
    # nothing public returns it. Checked on torch 2.11 and 2.13.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


_ADVICE = "Every rank must convert the model with the same recipe, enable (or not) the quantized all-gather alike, and apply the same parallel plan"


def check_ranks_agree(group: dist.ProcessGroup, topic: str, what: str, facts: dict[str, str], advice: str = _ADVICE) -> None:
    """Raise a ValueError on every rank of `group` unless all of them pass the same `facts`.

    `topic` names the kind of check (a key prefix, e.g. ``"FSDP2 all-gather"``), `what` the layer,
    and `facts` what must be equal (e.g. ``{"recipe": ..., "all-gather": ...}``); the message names
    the facts that differ and both ranks' values, and ends with `advice`. Called once per layer, at set-up or at its first
    collective: it costs one store round trip per rank.
    """
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return
    store = _store()
    me = dist.get_rank()
    prefix = f"tqcompile/agree/{group.group_name}/{topic}"
    round_ = (store.add(f"{prefix}/count", 1) - 1) // len(ranks)
    store.set(f"{prefix}/{round_}/{me}", json.dumps(facts))
    timeout = min(store.timeout, datetime.timedelta(seconds=TIMEOUT_S))
    keys = {r: f"{prefix}/{round_}/{r}" for r in ranks if r != me}
    try:
        store.wait(list(keys.values()), timeout)
    except (RuntimeError, dist.DistError) as e:  # DistStoreError: a rank did not publish in time
        missing = [r for r, k in keys.items() if not store.check([k])]
        mine = "; ".join(f"{k}: {v}" for k, v in facts.items())
        raise ValueError(
            f"{what}: rank(s) {missing} did not reach the {topic} set-up within {timeout.total_seconds():.0f} s, "
            f"while rank {me} did ({mine}). {advice}"
        ) from e
    for r, key in keys.items():
        theirs = json.loads(store.get(key).decode())
        if theirs != facts:
            (a, fa), (b, fb) = sorted(((me, facts), (r, theirs)), key=lambda x: x[0])
            differ = [k for k in dict.fromkeys([*fa, *fb]) if fa.get(k) != fb.get(k)]
            said = ", ".join(f"{k}: rank {a} has {fa.get(k)}, rank {b} has {fb.get(k)}" for k in differ)
            raise ValueError(f"{what}: the ranks of the group disagree on the {topic} set-up ({said}). {advice}")
