"""``checkpoint.load: megatron:DIR``: a checkpoint megatron-core's own ``dist_checkpointing.save`` wrote
from its own GPTModel (tp2, Megatron-LM's directory layout and ``args``) loads into raytron at
tp1, tp2+sp, pp2 and tp2 x pp2 x dp2, and the first iteration's loss is megatron-core's own on that
batch; with megatron-core's distributed-optimizer state (fully_reshardable), raytron's next update is
megatron-core's own next step."""

from __future__ import annotations

import pytest

from tests.helpers.megatron import ARGS, MODEL, stand_ins
from tests.helpers.parity import job_of, tiny_spec

stand_ins()
pytest.importorskip("megatron.core")
pytestmark = pytest.mark.procs


def spec(world: int = 1, parallel: dict | None = None, training: dict | None = None, **model) -> dict:
    return tiny_spec(world=world, parallel=parallel, model={**MODEL, **model}, training=training or {"train_iters": 1})


def first_batch(job):
    from workers.data.dataset import GlobalSampler

    t = job.training
    return GlobalSampler(t.data, job.model.seq_length, t.seed, t.global_batch_size, split=t.split).batch(
        0, 0, t.global_batch_size)


@pytest.fixture(scope="module")
def mcore_ckpt(tmp_path_factory):
    """A Megatron-LM-style root saved by megatron-core at tp2, and megatron-core's loss on the batch."""
    from tests.helpers.megatron import save_rank
    from tests.helpers.ranks import run_ranks

    root = tmp_path_factory.mktemp("mcore")
    losses = run_ranks(save_rank, 2, args=(str(root), None, 2, 1), kwargs={"args": ARGS, "batch": first_batch(
        job_of(spec()))}, timeout_s=300)
    assert losses[0] == losses[1]
    return root, losses[0]


@pytest.mark.parametrize("world,parallel", [
    (1, {}),
    (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    (2, {"pipeline_model_parallel_size": 2}),
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
], ids=["tp1", "tp2-sp", "pp2", "tp2-pp2-dp2"])
def test_first_loss_is_megatron_cores_at_every_layout(mcore_ckpt, world, parallel):
    from tests.helpers.checkpoints import train_ranks
    from tests.helpers.ranks import run_ranks

    root, want = mcore_ckpt
    job = job_of(spec(world, parallel))
    out = run_ranks(train_ranks, world, args=(job,), kwargs={"load": f"megatron:{root}", "until": 1}, timeout_s=300)
    got = out[0]["losses"][0]
    assert out[0]["start"] == 0  # weights only: a fresh optimizer from iteration 0
    assert abs(got - want) <= 1e-5 * want, (got, want)


def test_model_fields_come_from_the_checkpoints_args(mcore_ckpt):
    from workers.checkpoint.megatron_import import MegatronReader

    reader = MegatronReader(str(mcore_ckpt[0]))
    assert reader.iteration == 5 and reader.path.name == "iter_0000005"
    want = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_query_groups": 2,
            "vocab_size": 128, "rotary_base": 10000, "norm_epsilon": 1e-5}
    assert {k: reader.model[k] for k in want} == want


def test_another_model_is_refused_naming_the_fields(mcore_ckpt):
    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source
    from workers.train.trainer import Trainer

    t = Trainer(job_of(spec(num_query_groups=4, ffn_hidden_size=128)), 0, 1)
    with pytest.raises(ValueError) as e:
        load_checkpoint(t, open_source(f"megatron:{mcore_ckpt[0]}"))
    assert "model.num_query_groups: 2 there, 4 in this job" in str(e.value)
    assert "model.ffn_hidden_size: 96 there, 128 in this job" in str(e.value)
    assert "\n" not in str(e.value)



MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}


@pytest.fixture(scope="module")
def mcore_moe_ckpt(tmp_path_factory):
    """A checkpoint megatron-core saved from its own MoE GPTModel, and its loss on the first batch (the
    batch does not depend on the layout that loads it): saved once for every layout below."""
    from tests.helpers.megatron import save_rank
    from tests.helpers.ranks import run_ranks

    root = tmp_path_factory.mktemp("mcore-moe")
    (want,) = run_ranks(save_rank, 1, args=(str(root), MOE), kwargs={"batch": first_batch(job_of(spec(**MOE)))},
                        timeout_s=300)
    return root, want


@pytest.mark.parametrize("world,parallel", [(1, {}), (2, {"expert_model_parallel_size": 2})], ids=["ep1", "ep2"])
def test_an_moe_checkpoint_loads_with_megatron_cores_loss(mcore_moe_ckpt, world, parallel):
    """Mixtral-style experts (megatron-core's sequential MLP; the grouped GEMM's keys are the same)."""
    from tests.helpers.checkpoints import train_ranks
    from tests.helpers.ranks import run_ranks

    root, want = mcore_moe_ckpt
    job = job_of(spec(world, parallel, **MOE))
    out = run_ranks(train_ranks, world, args=(job,), kwargs={"load": f"megatron:{root}", "until": 1},
                    timeout_s=300)
    got = out[0]["losses"][0]
    assert abs(got - want) <= 1e-5 * want, (got, want)


@pytest.fixture(scope="module")
def mcore_optimizer_ckpt(tmp_path_factory):
    """megatron-core's model and distributed Adam at tp2, one step taken (on a batch of no raytron
    iteration), saved with the optimizer in fully_reshardable format; then its loss on raytron's batch
    of iteration 0, its step on it, and its loss on the batch of iteration 1."""
    from tests.helpers.megatron_optim import global_batches, train_save_rank
    from tests.helpers.ranks import run_ranks

    root = tmp_path_factory.mktemp("mcore-optim")
    job = job_of(spec(training={"train_iters": 2}))
    out = run_ranks(train_save_rank, 2, args=(str(root), job.training, global_batches(job, 9, 0, 1), 2),
                    kwargs={"args": ARGS}, timeout_s=300)
    assert out[0] == out[1]
    return root, out[0]


@pytest.mark.parametrize("world,parallel", [
    (1, {}),
    (4, {"tensor_model_parallel_size": 2, "use_distributed_optimizer": True}),
], ids=["tp1", "tp2-dp2-distopt"])
def test_the_next_update_is_megatron_cores_next_step(mcore_optimizer_ckpt, world, parallel):
    from tests.helpers.checkpoints import train_ranks
    from tests.helpers.ranks import run_ranks

    root, want = mcore_optimizer_ckpt
    job = job_of(spec(world, parallel, training={"train_iters": 2}))
    out = run_ranks(train_ranks, world, args=(job,), kwargs={"load": f"megatron:{root}", "until": 2}, timeout_s=300)
    got = out[0]["losses"]
    # loss 0: the loaded weights; loss 1: after one update, which needs Adam's moments and step
    assert all(abs(g - w) <= 1e-5 * w for g, w in zip(got, want)), (got, want)
