"""The distributed optimizer's moments in the layout-independent form of a full state dict:
this rank's flat shards all-gathered into param-shaped tensors, and cut back out of them
(:meth:`workers.parallel.optimizer.DistributedOptimizer.full_state_dict` and
``load_full_state_dict``; the replicated optimizer's moments are param-shaped already)."""

from __future__ import annotations

import torch

from workers.parallel import comm
from workers.parallel.grad_buffer import GradBuffer

KEYS = ("exp_avg", "exp_avg_sq")


def gather_moments(buf: GradBuffer, shard: dict) -> list[dict]:
    """``[{"exp_avg", "exp_avg_sq"} per param of buf]`` in the params' shapes, from every rank's
    shard (a collective over ``buf.group``, bucket by bucket)."""
    full = {}
    for key in KEYS:
        flat = torch.empty(buf.numel, dtype=torch.float32, device=buf.grad.device)
        for bucket in buf.buckets:
            lo, hi, base = buf.shard_range(bucket)
            comm.all_gather_into(flat[bucket.start : bucket.end], shard[key][base : base + hi - lo], buf.group)
        full[key] = flat
    return [{k: full[k][buf.offsets[id(p)] : buf.offsets[id(p)] + p.numel()].view(p.shape).clone() for k in full}
            for p in buf.params]


@torch.no_grad()
def scatter_moments(buf: GradBuffer, shard: dict, entries: list[dict]) -> None:
    """Write this rank's pieces of :func:`gather_moments`-shaped ``entries`` into ``shard``."""
    index = {id(p): i for i, p in enumerate(buf.params)}
    for p, a, b, s in buf.pieces():
        for key in KEYS:
            shard[key][s : s + b - a].copy_(entries[index[id(p)]][key].reshape(-1)[a:b])
