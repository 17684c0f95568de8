"""What a built rank holds, counted tensor by tensor: every live tensor storage of a trainer's
process after it is built (model params, gradient buffer, optimizer state, and whatever else
lies around: a kept decay mask, a second copy of the params, a separate gradient shard) against
the plan's state bytes, replicated and ZeRO-1 at dp 4 over gloo. Byte counts, not process
figures: deterministic. The process-level peak (VmHWM) is ``bench/auto_layout_bench.py --memory``'s.
"""

import gc

import pytest
import torch

from service.spec.plan import plan_job
from service.spec.spec import parse_spec, to_job_config
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.slow

MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 128, "vocab_size": 512, "seq_length": 32}


def _spec(distributed: bool):
    return parse_spec({"name": "mem", "model": dict(MODEL), "parallel": {"use_distributed_optimizer": distributed},
                       "training": {"train_iters": 1, "global_batch_size": 8, "micro_batch_size": 2},
                       "resources": {"num_nodes": 1, "gpus_per_node": 4}})


def _live_bytes(rank, world, job):
    from workers.train.trainer import Trainer

    trainer = Trainer(job, rank, world)
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    buffers = {b.untyped_storage().data_ptr() for chunk in trainer.chunks for b in chunk.buffers()}
    padding = sum(buf.numel for buf in trainer.optimizer.grads.buffers) - sum(
        p.numel() for buf in trainer.optimizer.grads.buffers for p in buf.params)
    trainer.train_step()  # and it trains
    return {"bytes": sum(n for ptr, n in storages.items() if ptr not in buffers), "padding": padding,
            "params": sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters())}


def test_a_built_rank_holds_what_the_plan_counts_and_zero1_holds_less():
    out = {}
    for distributed in (False, True):
        spec = _spec(distributed)
        state = plan_job(spec)["cost"]["state_bytes"]
        ranks = run_ranks(_live_bytes, 4, args=(to_job_config(spec),), timeout_s=300)
        n = ranks[0]["params"]
        # The plan's state bytes (the scratch is allocated per step, not held), plus the bucket
        # padding of the gradient buffer (and, sharded, of the param buffer and of the moments'
        # quarter of it).
        pad = ranks[0]["padding"] * (4 + (4 + 8 / 4 if distributed else 0))
        for r in ranks:
            assert r["bytes"] == pytest.approx(state["total"] - state["scratch"] + pad, abs=64), (distributed, r, state)
        out[distributed] = ranks[0]["bytes"]
    # fp32 replicated: params (the main copy itself) 4 + grads 4 + moments 8; ZeRO-1 over 4:
    # params (their slices the main params) 4 + grads 4 + moments 8 / 4, no master shard
    assert out[False] - out[True] == pytest.approx((16 - 10) * n, rel=1e-3)
