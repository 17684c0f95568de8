"""Data-parallel grad buckets launched during backward, with and without interleaving (run by hand).

    .venv/bin/python -m bench.dp_overlap

Four ranks, pp2 x dp2, with small buckets (so each stage has several): each rank trains one
iteration and reports how many of its buckets had their reduction launched before
``finish()`` (i.e. while backward was still running) out of its total. Overlap needs each
bucket launched as soon as its grads are final; with interleaving (vpp2) a stage's chunk 1
finishes its backwards long before chunk 0, so its buckets must go out on chunk 1's last
microbatch (Megatron enables each chunk's grad sync on that chunk's last microbatch), not
on the stage's last backward. Every bucket launched during backward is the target, with vpp
as without.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys


from service.spec.spec import parse_spec, to_job_config  # noqa: E402

MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 32}
BUCKET_SIZE = 8192


def job(vpp: int | None):
    return to_job_config(parse_spec({
        "name": "dp-overlap", "model": MODEL,
        "parallel": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": vpp},
        "training": {"train_iters": 1, "global_batch_size": 8, "micro_batch_size": 1},
        "resources": {"num_nodes": 1, "gpus_per_node": 4},
    }))


def _rank(rank: int, world_size: int, job_config, bucket_size: int) -> dict:
    import workers.train.trainer as train
    from workers.parallel.optimizer import build_optimizer

    train.build_optimizer = functools.partial(build_optimizer, bucket_size=bucket_size)
    trainer = train.Trainer(job_config, rank, world_size)
    grads = trainer.optimizer.grads
    finish, seen = grads.finish, {}

    def counting_finish():
        seen.setdefault("launched", grads.num_launched())
        finish()

    grads.finish = counting_finish
    trainer.train_step()
    return {"stage": trainer.stage, "launched": seen["launched"], "buckets": grads.num_buckets()}


def measure(vpp: int | None, bucket_size: int = BUCKET_SIZE) -> list[dict]:
    """Per rank: its pipeline stage, buckets launched before ``finish()``, and buckets."""
    from tests.helpers.ranks import run_ranks

    return run_ranks(_rank, 4, args=(job(vpp), bucket_size), timeout_s=300)


def main() -> None:
    argparse.ArgumentParser(prog="python -m bench.dp_overlap", description=__doc__.split("\n\n")[0]).parse_args()
    print(f"pp2 x dp2, {MODEL['num_layers']} layers of h {MODEL['hidden_size']}, buckets of {BUCKET_SIZE} elements")
    print(f"{'layout':<10} {'rank':>4} {'stage':>5} {'launched in backward':>21}")
    for name, vpp in (("pp2", None), ("pp2+vpp2", 2)):
        for rank, r in enumerate(measure(vpp)):
            print(f"{name:<10} {rank:>4} {r['stage']:>5} {r['launched']:>14} of {r['buckets']:<4}")


if __name__ == "__main__":
    main()
