"""Trainers that save and reload checkpoints, and runs across layouts that resume from them."""

from __future__ import annotations

import functools
import json
import time

import numpy as np

from tests.helpers.parity import job_of, run_trainer, tiny_spec

SMALL = {"num_layers": 2}


def trainer(model=None, parallel=None):
    from workers.train.trainer import Trainer

    return Trainer(job_of(tiny_spec(model={**SMALL, **(model or {})}, parallel=parallel,
                                    training={"train_iters": 10})), 0, 1)


def trained(iters: int, **kwargs):
    t = trainer(**kwargs)
    for _ in range(iters):
        t.train_step()
    return t


def checkpointer(root, **kwargs):
    from workers.checkpoint.checkpointer import Checkpointer

    return Checkpointer(str(root), **kwargs)


RTOL = 1e-5


ITERS = 4


def spec(world: int, parallel: dict, model: dict) -> dict:
    return tiny_spec(world=world, parallel=parallel, model=model, training={"train_iters": ITERS})


@functools.lru_cache(maxsize=4)
def reference_run(model_json: str) -> dict:
    """The uninterrupted single-process run: losses and final params."""
    return run_trainer(0, 1, job_of(spec(1, {}, json.loads(model_json))), iters=ITERS)


def reference(model_json: str) -> list[float]:
    return reference_run(model_json)["losses"]


def train_ranks(rank, world_size, job, *, load=None, save_root=None, save_at=(), async_at=(), until=ITERS):
    """Build a trainer (optionally from ``load``), train to iteration ``until``, saving after
    the iterations in ``save_at`` (sync) and ``async_at`` (async)."""
    from workers.checkpoint.checkpointer import Checkpointer
    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source
    from workers.train.trainer import Trainer

    trainer = Trainer(job, rank, world_size)
    t0 = time.perf_counter()
    start = load_checkpoint(trainer, open_source(load))["iteration"] if load else 0  # as a rank loads checkpoint.load
    load_s = time.perf_counter() - t0
    sync = Checkpointer(save_root) if save_root else None
    background = Checkpointer(save_root, async_save=True) if save_root else None
    losses, stats = [], {}
    while trainer.iteration < until:
        losses.append(trainer.train_step()["loss"])
        for at, ck in ((save_at, sync), (async_at, background)):
            if trainer.iteration in at:
                ck.save(trainer)
                stats[trainer.iteration] = ck
    for ck in (sync, background):
        if ck:
            ck.close()
    return {"start": start, "losses": losses, "load_s": load_s,
            "stats": {it: {**ck.last_stats} for it, ck in stats.items()}}


def load_checkpoint(trainer, source):
    from workers.checkpoint.reader import load_checkpoint as load

    return load(trainer, source)


def run(world, parallel, model, **kwargs):
    from tests.helpers.ranks import run_ranks

    job = job_of(spec(world, parallel, model))
    out = run_ranks(train_ranks, world, args=(job,), kwargs=kwargs, timeout_s=600)
    assert all(r["losses"] == out[0]["losses"] for r in out), "every rank reports the same loss"
    return out


def assert_written_once(ckpt) -> None:
    """Every element of every logical tensor is stored exactly once (boxes and flat ranges)."""
    index = json.loads((ckpt / "index.json").read_text())
    count: dict[str, np.ndarray] = {}
    for e in index:
        c = count.setdefault(e["key"], np.zeros(e["shape"], dtype=np.int64))
        box = c[tuple(slice(o, o + n) for o, n in zip(e["offsets"], e["lengths"]))]
        if e["flat"]:
            hit = np.zeros(box.size, dtype=np.int64)
            hit[e["flat"][0] : e["flat"][1]] = 1
            box += hit.reshape(box.shape)
        else:
            box += 1
    bad = [key for key, c in count.items() if not (c == 1).all()]
    assert not bad, f"stored twice or missing: {bad[:5]}"
