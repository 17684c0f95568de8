"""Shared helpers of the whole-model parity tests: a tiny job, a single-process reference run
and a distributed run of the same job under another layout."""

from __future__ import annotations

import functools

from service.spec import parse_spec, to_job_config

ITERS = 3


def tiny_spec(*, moe: bool = False, world: int = 1, parallel: dict | None = None, training: dict | None = None,
              model: dict | None = None) -> dict:
    spec = {
        "name": "parity",
        "model": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                  "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 16,
                  **({"num_moe_experts": 4, "moe_router_topk": 2} if moe else {}), **(model or {})},
        "parallel": parallel or {},
        "training": {"train_iters": ITERS, "global_batch_size": 8, "micro_batch_size": 1, "lr": 3e-3,
                     "seed": 7, **(training or {})},
        "resources": {"num_nodes": 1, "gpus_per_node": world},
    }
    return spec


def job_of(spec: dict):
    return to_job_config(parse_spec(spec))


def train_losses(rank, world_size, job, iters=ITERS):
    from workers.train import Trainer

    trainer = Trainer(job, rank, world_size)
    return [trainer.train_step()["loss"] for _ in range(iters)]


@functools.lru_cache(maxsize=8)
def reference_losses(moe: bool, seq_length: int = 16) -> tuple[float, ...]:
    """The single-process loss curve (no torch.distributed at all)."""
    job = job_of(tiny_spec(moe=moe, model={"seq_length": seq_length}))
    return tuple(train_losses(0, 1, job))


def distributed_losses(spec: dict) -> list[float]:
    from workers.spawn import run_ranks

    job = job_of(spec)
    per_rank = run_ranks(train_losses, job.world_size, args=(job,), timeout_s=600)
    assert all(r == per_rank[0] for r in per_rank), "every rank reports the same loss"
    return per_rank[0]


def assert_same_curve(got, ref, rtol=1e-4):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= rtol * abs(b), f"iteration {i}: {a} vs single-process {b} (rel {abs(a - b) / abs(b):.2e})"
