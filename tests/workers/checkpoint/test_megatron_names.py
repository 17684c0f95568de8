"""Megatron-Core torch_dist keys both ways without megatron-core: the key table, a raytron checkpoint
exported and read back (``megatron:DIR``) with the same logits, and bad input refused in one line
before anything starts (the spec's ``checkpoint.load``, ``raytron export``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.checkpoints import trainer
from tests.helpers.parity import job_of, tiny_spec

MODEL = {"num_layers": 2}


def test_every_dense_tensor_has_one_key_and_comes_back():
    from workers.checkpoint.megatron_names import megatron_key, raytron_names

    from workers.checkpoint.layout import param_views

    names = [v.name for v in param_views(trainer(MODEL))]
    keys = {name: megatron_key(name) for name in names}
    assert keys["layers.1.mlp.gate_up.weight"] == ("decoder.layers.mlp.linear_fc1.weight", 1)
    assert keys["layers.0.input_norm.weight"] == ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", 0)
    layers_of = {}
    for key, layer in keys.values():
        layers_of.setdefault(key, set()).add(layer)
    assert raytron_names(layers_of, 2) == keys
    with pytest.raises(ValueError, match="no Megatron-Core torch_dist key"):
        megatron_key("layers.0.mlp.experts.w_gate")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from workers.checkpoint.checkpointer import Checkpointer
    from workers.checkpoint.megatron_export import export_megatron

    tmp = tmp_path_factory.mktemp("mcore")
    t = trainer(MODEL)
    t.train_step()
    Checkpointer(str(tmp / "ckpt")).save(t)
    result = export_megatron(str(tmp / "ckpt"), str(tmp / "out"))
    return t, tmp / "out", result


def test_export_reads_back_with_the_same_logits(exported):
    from tests.helpers.hf import assert_close, raytron_logits
    from workers.checkpoint.megatron_import import MegatronReader
    from workers.checkpoint.reader import load_checkpoint

    t, out, result = exported
    assert result["iteration"] == 1 and (out / "latest_checkpointed_iteration.txt").read_text() == "1"
    files = {p.name for p in (out / "iter_0000001").iterdir()}
    assert {".metadata", "__0_0.distcp", "common.pt", "metadata.json"} <= files
    assert json.loads((out / "iter_0000001" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    reader = MegatronReader(str(out))  # the root: its latest checkpoint
    assert reader.iteration == 1 and reader.model["num_query_groups"] == 2
    fresh = trainer(MODEL)
    fresh.train_step()  # other weights than the exported ones, until the load
    load_checkpoint(fresh, reader)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert_close(raytron_logits(fresh, ids), raytron_logits(t, ids))
    # Adam's moments and step came along: the next update is the one the exported trainer makes
    assert result["optimizer"] and reader.optimizer_steps == 1 and fresh.optimizer.num_steps == 1
    fresh.train_step()
    t.train_step()
    assert_close(raytron_logits(fresh, ids), raytron_logits(t, ids))


def spec_loading(load: str, **model) -> dict:
    return {**tiny_spec(model={**MODEL, **model}), "checkpoint": {"load": load}}


def refusal(spec: dict) -> str:
    from service.spec.spec import parse_spec, to_job_config

    with pytest.raises(ValueError) as e:
        to_job_config(parse_spec(spec))
    return str(e.value)


def test_a_missing_or_foreign_directory_is_refused_in_one_line(tmp_path):
    line = refusal(spec_loading(f"megatron:{tmp_path / 'nope'}"))
    assert "no such directory" in line and "\n" not in line
    (tmp_path / "ckpt").mkdir()
    line = refusal(spec_loading(f"megatron:{tmp_path / 'ckpt'}"))
    assert "is not a Megatron-Core torch_dist checkpoint" in line and "\n" not in line


def test_another_model_is_refused_naming_the_fields(exported):
    _, out, _ = exported
    line = refusal(spec_loading(f"megatron:{out}", num_query_groups=4, hidden_size=64))
    assert "model.num_query_groups: 2 there, 4 in the spec" in line
    assert "model.hidden_size: 32 there, 64 in the spec" in line and "\n" not in line
    job_of(spec_loading(f"megatron:{out}"))  # the checkpoint's own model passes


def test_export_refuses_a_moe_checkpoint_in_one_line(tmp_path, capsys):
    import argparse

    from api.cli import export_cmd
    from workers.checkpoint.checkpointer import Checkpointer

    Checkpointer(str(tmp_path / "ckpt")).save(trainer({**MODEL, "num_moe_experts": 2, "moe_router_topk": 1}))
    parser = argparse.ArgumentParser()
    export_cmd.add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["export", str(tmp_path / "ckpt"), "--format", "megatron", str(tmp_path / "out")])
    assert ns.func(ns) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_moe_experts=2" in err[0] and "--format hf" in err[0]


def test_the_starting_event_says_what_the_optimizer_starts_from(exported):
    from service.control.controller import JobController
    from service.control.events import JobState
    from tests.helpers.controller import FakeGroup
    from workers.grid import ParallelGrid

    job = job_of({**spec_loading(f"megatron:{exported[1]}"), "training": {"train_iters": 1, "global_batch_size": 2,
                                                                          "micro_batch_size": 1}})
    events = []
    JobController(job, ParallelGrid.from_config(job.parallel, 1), job_id="m1", on_event=events.append,
                  make_group=lambda *_: FakeGroup(1)).run()
    (start,) = [e for e in events if e.kind == "state" and e.state is JobState.STARTING]
    assert not start.data["fresh_optimizer"] and start.data["from_checkpoint"] == f"megatron:{exported[1]}"
    assert "weights and optimizer state (fully_reshardable: Adam's moments and fp32 main params, step 1)" \
        in start.message


def test_optimizer_state_in_a_format_raytron_does_not_read_starts_fresh_and_says_why():
    from workers.checkpoint.megatron_optim import optimizer_source

    model = {"embedding.word_embeddings.weight": (8, 4), "decoder.layers.mlp.linear_fc2.weight": (2, 4, 6)}
    full = {**model, **{f"optimizer.state.{k}.{key}": shape for key, shape in model.items()
                        for k in ("exp_avg", "exp_avg_sq", "param")}}
    common = {"iteration": 9, "optimizer": {"optimizer": {"param_groups": [{"step": 7}, {"step": 7}]},
                                            "param_state_sharding_type": "fully_reshardable"}}
    got = optimizer_source(full, set(model), common, set())
    assert got.step == 7 and set(got.keys) == {"exp_avg", "exp_avg_sq", "master"}
    bucketed = {**model, "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32)."
                         "bucket_idx_0.exp_avg": (136,)}
    common["optimizer"]["param_state_sharding_type"] = "dp_reshardable"
    got = optimizer_source(bucketed, set(model), common, set())
    assert not got.keys and got.step is None
    assert got.note.startswith("weights only: a fresh optimizer from iteration 0; its distributed-optimizer state "
                               "is dp_reshardable") and "--dist-ckpt-optim-fully-reshardable" in got.note
    assert optimizer_source(model, set(model), {}, set()).note.endswith("it holds no optimizer state")


def test_save_format_megatron_copies_every_committed_checkpoint(tmp_path):
    from workers.checkpoint.checkpointer import Checkpointer
    from workers.checkpoint.megatron_import import MegatronReader
    from workers.rank.hf_copies import HFCopies

    t, ck = trainer(MODEL), Checkpointer(str(tmp_path))
    copies = HFCopies(str(tmp_path), 2, 2, hf=False, megatron=True)  # the HF interval is not the copies'
    for it in (1, 2):
        t.train_step()
        ck.save(t)
        copies.committed(it)
        copies.wait()
        (done,) = copies.take_done()
        assert done["format"] == "megatron" and done["iteration"] == it
    root = tmp_path / "megatron"
    assert {p.name for p in root.iterdir()} == {"iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"}
    assert MegatronReader(str(root)).iteration == 2 and not (tmp_path / "hf").exists()


def test_save_format_megatron_is_refused_where_it_cannot_write(tmp_path):
    base = tiny_spec(model=MODEL)
    line = refusal({**base, "checkpoint": {"save_format": "megatron"}})
    assert "checkpoint.save_format megatron needs checkpoint.save_interval" in line
    moe = tiny_spec(model={**MODEL, "num_moe_experts": 2, "moe_router_topk": 1})
    line = refusal({**moe, "checkpoint": {"save_format": "megatron", "save_interval": 1}})
    assert "writes dense GPT/Llama models" in line and "model.num_moe_experts" in line
