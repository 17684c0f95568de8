"""Counting the bytes a rank's collectives send, attributed to the traffic that issued them (the calling module, and for gradients the param group).

One communicator often serves several group kinds (with tp2 on two ranks, "tp", "tp-dp-cp",
"etp", ... are one rank set, hence one handle and one label), so :mod:`workers.parallel.comm`'s
per-label counters cannot say whose bytes they are: :func:`measure_trainer` wraps its counting to
name the traffic of each collective from the frames that issued it. :mod:`bench.comm_bench`
compares the result with the analytic minimum.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from bench.comm_minimum import TRAFFIC
from workers.config import JobConfig

# Which traffic a collective belongs to, by the module that issued it.
_SOURCES = {
    "workers.parallel.tensor": "tp",
    "workers.parallel.cross_entropy": "tp",
    "workers.model.mla": "tp",
    "workers.parallel.sequence": "tp",
    "workers.parallel.context": "cp",
    "workers.parallel.context_ring": "cp",
    "workers.parallel.context_a2a": "cp",
    "workers.parallel.pipeline_exec": "pp",
    "workers.parallel.moe_dispatch": "moe",
    "workers.parallel.data": "grads",
    "workers.parallel.grad_buffer": "grads",
    "workers.parallel.param_gather": "grads",
    "workers.parallel.optimizer": "grads",
    "workers.train.trainer": "loss",
    "workers.train.reduce": "loss",
    "workers.parallel.clip": "grad-norm",
}
# The ProcessGroups kind each traffic runs on (ProcessGroups.group(kind) is its handle).
GROUP_OF = {"tp": "tp", "cp": "cp", "pp": "pp", "ep": "ep", "etp": "etp", "grads:dense": "dp_cp",
            "grads:sp": "tp_dp_cp", "grads:expert": "expert_dp", "loss:dp-cp": "dp_cp", "loss:pp": "pp",
            "loss:world": None, "grad-norm": None}



def _traffic_of(frame, group, trainer) -> str:
    """Name the traffic of a collective from the frames that issued it."""
    while frame is not None and frame.f_globals.get("__name__") == "workers.parallel.comm":
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    source = _SOURCES.get(module, module)
    g = trainer.groups
    if source == "moe":
        return "ep" if group is g.ep_group else "etp"
    if source == "loss":
        return "loss:dp-cp" if group is g.dp_cp_group else "loss:pp" if group is g.pp_group else "loss:world"
    if source == "grads":
        from workers.parallel.data import GradBuffer

        buf = frame.f_locals.get("buf")
        if not isinstance(buf, GradBuffer):
            buf = frame.f_locals.get("self")
        params = buf.params if isinstance(buf, GradBuffer) else []
        if params and getattr(params[0], "is_expert", False):
            return "grads:expert"
        if params and getattr(params[0], "sequence_parallel", False):
            return "grads:sp"
        return "grads:dense"
    return source


def _attribute(trainer) -> dict:
    """Wrap this process's ``comm._count`` to also count bytes per (label, traffic)."""
    from workers.parallel import comm

    counts: dict[tuple[str, str], float] = defaultdict(float)
    original = comm._count

    def count(group, nbytes: float) -> None:
        original(group, nbytes)
        counts[(comm.group_label(group), _traffic_of(sys._getframe(1), group, trainer))] += nbytes

    comm._count = count
    return counts


def _count_routes(trainer):
    """Per-expert choice counts of this rank's routers (a forward hook on each)."""
    import torch

    num_e = trainer.job.model.num_moe_experts or 0
    routes = torch.zeros(max(num_e, 1), dtype=torch.int64)
    if num_e:
        def hook(module, inputs, outputs):
            routes.add_(torch.bincount(outputs[1].reshape(-1), minlength=num_e))

        for chunk in trainer.chunks:
            for layer in chunk.layers:
                layer.mlp.router.register_forward_hook(hook)
    return routes


def measure_trainer(trainer, iters: int = 2) -> dict:
    """Train ``iters`` iterations; the counters cover the last one only."""
    from workers.parallel import comm

    traffic = _attribute(trainer)
    routes = _count_routes(trainer)
    for _ in range(iters - 1):
        trainer.train_step()
    comm.reset_stats()
    traffic.clear()
    routes.zero_()
    metrics = trainer.train_step()
    handles = {k: trainer.groups.group(GROUP_OF[k]) for k in TRAFFIC if GROUP_OF[k]}
    labels = {k: comm.group_label(h) for k, h in handles.items() if h is not None}
    return {"stats": comm.stats(), "traffic": dict(traffic), "labels": labels, "routes": routes.tolist(),
            "loss": metrics["loss"], "step_time_s": metrics["step_time_s"]}


def measure_rank(rank: int, world_size: int, job: JobConfig, iters: int = 2) -> dict:
    """One rank of :func:`run_layout`: build the trainer and measure its last iteration."""
    from workers.train.trainer import Trainer

    return measure_trainer(Trainer(job, rank, world_size), iters)
