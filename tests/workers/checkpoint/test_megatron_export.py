"""``raytron export --format megatron``: a checkpoint trained at tp2 x pp2 x dp2, exported, is read by
megatron-core's own ``dist_checkpointing.load`` into its own GPTModel, strict, at tp1 and tp2, with
raytron's logits and loss on a fixed batch; with its DistributedOptimizer, Adam's state too: megatron-core's
next step is raytron's."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.megatron import MODEL, stand_ins
from tests.helpers.parity import job_of, tiny_spec

stand_ins()
pytest.importorskip("megatron.core")
pytestmark = pytest.mark.procs


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A raytron checkpoint trained 2 iterations at tp2 x pp2 x dp2, exported through the CLI; raytron's
    logits and loss on :func:`batch` from one process (logits: at init std 0.02 a gate/up swap moves the
    loss by ~3e-5 only); the job and its losses of 4 iterations (the last stage's rank reports them)."""
    from tests.helpers.checkpoints import train_ranks
    from tests.helpers.hf import raytron_logits
    from tests.helpers.ranks import run_ranks
    from workers.checkpoint.reader import load_checkpoint
    from workers.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("export")
    model = MODEL
    parallel = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    job = job_of(tiny_spec(world=8, parallel=parallel, model=model, training={"train_iters": 4}))
    out = run_ranks(train_ranks, 8, args=(job,), kwargs={"save_root": str(tmp / "ckpt"), "save_at": (2,), "until": 4},
                    timeout_s=300)
    export(tmp / "ckpt", tmp / "mcore")
    t = Trainer(job_of(tiny_spec(model=model, training={"train_iters": 2})), 0, 1)
    load_checkpoint(t, str(tmp / "ckpt"))
    tokens, labels = batch()
    logits = raytron_logits(t, tokens)
    loss = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 128), labels.reshape(-1)))
    return tmp / "mcore" / "iter_0000002", logits, loss, job, out[-1]["losses"]


def export(checkpoint, out) -> None:
    import argparse

    from api.cli import export_cmd

    parser = argparse.ArgumentParser()
    export_cmd.add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["export", str(checkpoint), "--format", "megatron", str(out)])
    assert ns.func(ns) == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_core_loads_the_export_strict_with_raytrons_loss(exported, tp):
    from tests.helpers.megatron import load_rank
    from tests.helpers.ranks import run_ranks

    path, logits, loss, _, _ = exported
    out = run_ranks(load_rank, tp, args=(str(path), None, tp, batch()), timeout_s=300)
    for r in out:
        assert abs(r["loss"] - loss) <= 1e-5 * loss, (r["loss"], loss)
    if tp == 1:
        err = float((out[0]["logits"] - logits).abs().max() / logits.abs().max())
        assert err <= 1e-5, f"logits differ: relative error {err:.2e}"
        args = out[0]["args"]
        assert (args["num_layers"], args["num_query_groups"], args["padded_vocab_size"], args["iteration"]) == (2, 2, 128, 2)


def test_megatron_cores_next_step_from_the_export_is_raytrons(exported):
    """megatron-core's GPTModel and DistributedOptimizer (tp2) load the export's model and optimizer
    strictly; its step on iteration 2's batch leaves its loss on iteration 3's batch where raytron's was."""
    from tests.helpers.megatron_optim import global_batches, load_step_rank
    from tests.helpers.ranks import run_ranks

    path, _, _, job, losses = exported
    out = run_ranks(load_step_rank, 2, args=(str(path), job.training, global_batches(job, 2, 3), 2), timeout_s=300)
    assert all(abs(g - w) <= 1e-5 * w for g, w in zip(out[0], losses[2:])), (out[0], losses[2:])
