"""Megatron interop through ``raytron run`` (the CLI, local rank processes): a job checkpointing to an
object store (a real S3-protocol server on 127.0.0.1) with ``save_format: megatron`` and ``save_hf``
succeeds and puts both copies into the store, megatron-core's GPTModel loads the Megatron copy strictly,
and a job with ``checkpoint.load: megatron:DIR`` of it succeeds, continuing with its Adam state."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml

from tests.helpers.cli import RAYTRON
from tests.helpers.megatron import MODEL, stand_ins
from tests.helpers.parity import tiny_spec

stand_ins()
pytest.importorskip("megatron.core")
pytestmark = pytest.mark.procs


def run(spec: dict, path, env=None):
    path.write_text(yaml.safe_dump(spec))
    p = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes", "--json"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["state"] == "SUCCEEDED", out
    return p, out


def test_megatron_and_hf_copies_in_s3_load_into_megatron_core_and_back_into_raytron(tmp_path):
    import pyarrow.fs as pafs

    from tests.helpers.megatron import load_rank
    from tests.helpers.ranks import run_ranks
    from tests.helpers.s3_server import keys, s3_server, with_env

    spec = tiny_spec(world=2, parallel={"tensor_model_parallel_size": 2}, model=MODEL, training={"train_iters": 2})
    spec["checkpoint"] = {"dir": "s3://raytron/run", "save_interval": 2, "save_format": "megatron", "save_hf": True}
    with s3_server(tmp_path / "moto.log") as env:
        run(spec, tmp_path / "save.yaml", with_env(env))
        stored = keys(env, "raytron", "run/")
        assert "run/hf/iter_0000002/model.safetensors" in stored and "run/hf/iter_0000002/config.json" in stored
        assert "run/megatron/latest_checkpointed_iteration.txt" in stored, stored
        s3 = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], access_key="raytron",
                               secret_key="raytron", region="us-east-1", scheme="http")
        pafs.copy_files("raytron/run/megatron", str(tmp_path / "megatron"), source_filesystem=s3,
                        destination_filesystem=pafs.LocalFileSystem())
    (out,) = run_ranks(load_rank, 1, args=(str(tmp_path / "megatron" / "iter_0000002"), MODEL, 1,
                                           (torch.tensor([[1, 2, 3, 4]]), torch.tensor([[2, 3, 4, 5]]))), timeout_s=120)
    assert out["args"]["iteration"] == 2
    spec = tiny_spec(model=MODEL, training={"train_iters": 2})
    spec["checkpoint"] = {"load": f"megatron:{tmp_path / 'megatron'}"}
    p, out = run(spec, tmp_path / "load.yaml")
    # its STARTING event (fresh_optimizer false: test_megatron_names) and 2 iterations from the copy
    assert f"a new attempt from megatron:{tmp_path / 'megatron'}" in p.stderr and len(out["losses"]) == 2
