"""Checkpoints in object storage, against a real S3-protocol server on 127.0.0.1 (moto's standalone
server; endpoint and credentials from the usual AWS variables, which pyarrow and boto3 read):
``raytron run`` with ``checkpoint.dir: s3://raytron/run`` and a rank killed mid-job goes on from the
object store to the undisturbed curve, and ``keep_last`` prunes the objects of older checkpoints."""

import json
import re
import subprocess

import pytest
import yaml

from tests.helpers.cli import RAYTRON
from tests.helpers.drills import run_locally
from tests.helpers.parity import tiny_spec

pytestmark = pytest.mark.procs


def _run(path, env, *extra):
    p = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes", "--json", *extra],
                       capture_output=True, text=True, timeout=300, env=env)
    return p, json.loads(p.stdout.strip().splitlines()[-1])


def test_a_job_checkpointing_to_s3_resumes_from_the_object_store_and_prunes(tmp_path):
    from tests.helpers.s3_server import keys, s3_server, with_env

    spec = tiny_spec(world=2, parallel={"tensor_model_parallel_size": 2}, training={"train_iters": 8})
    spec["fault_tolerance"] = {"max_restarts": 1, "collective_timeout_s": 20}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    ref = run_locally(spec)  # the undisturbed run, in this process
    spec["checkpoint"] = {"save_interval": 2, "keep_last": 2, "dir": "s3://raytron/run"}
    path.write_text(yaml.safe_dump(spec))
    with s3_server(tmp_path / "moto.log") as env:
        p, out = _run(path, with_env(env), "--fault", "1@6:exit")
        assert p.returncode == 0 and out["restarts"] == 1, p.stderr
        # an object store cannot rename a directory: the manifest alone commits it, under its save's name
        assert "a new attempt from s3://raytron/run/.iter_0000004.tmp-" in p.stderr, p.stderr
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(out["losses"], ref["losses"]))
        assert len(out["losses"]) == 8
        stored = keys(env, "raytron", "run/")
        kept = sorted({m.group(1) for k in stored if (m := re.search(r"iter_(\d+)", k.split("/")[1]))})
        assert kept == ["0000006", "0000008"], kept  # 2 and 4 pruned: their objects are gone
        assert any(k.endswith("/manifest.json") for k in stored)
