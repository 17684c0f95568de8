"""deploy/: the launcher YAML passes the cluster-config schema that ships inside ray; the Dockerfile,
the launcher and the KubeRay manifests agree on one image, one serve command and the pins."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from service.spec.spec import parse_spec, to_job_config

from tests.helpers.paths import ROOT
DEPLOY = ROOT / "deploy"


def ray_schema() -> dict:
    """ray/autoscaler/ray-schema.json from the installed ray package (found without importing ray)."""
    ray_dir = Path(importlib.util.find_spec("ray").submodule_search_locations[0])
    return json.loads((ray_dir / "autoscaler" / "ray-schema.json").read_text())


def launcher() -> dict:
    return yaml.safe_load((DEPLOY / "cluster-launcher.yaml").read_text())


def manifests(name: str) -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def dockerfile() -> tuple[str, list[str], list[str], str]:
    """(image from the build line, RUN lines, CMD argv, FROM image)."""
    text = (DEPLOY / "Dockerfile").read_text()
    image = re.search(r"docker build -f deploy/Dockerfile -t (\S+) \.", text).group(1)
    runs = re.findall(r"^RUN (.+)$", text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.+\])$", text, re.M).group(1))
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    return image, runs, cmd, base


def pins() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    return {"torch": re.search(r'"torch==([^"]+)"', text).group(1),
            "ray": re.search(r'"ray\[[^\]]*\]==([^"]+)"', text).group(1),
            "version": re.search(r'^version = "([^"]+)"', text, re.M).group(1)}


def test_launcher_yaml_passes_rays_cluster_schema():
    schema, config = ray_schema(), launcher()
    validator = jsonschema.Draft7Validator(schema)
    assert [e.message for e in validator.iter_errors(config)] == []
    # the schema does reject what ray would reject (a misspelt key, a fractional GPU count)
    assert list(validator.iter_errors({**config, "head_start_commands": []}))
    bad = json.loads(json.dumps(config))
    bad["available_node_types"]["gpu_worker"]["resources"]["GPU"] = 0.5
    assert list(validator.iter_errors(bad))
    # ray's own checks on top of the schema (head node type, min <= max workers)
    from ray.autoscaler._private.util import validate_config
    validate_config(config)


def test_dockerfile_installs_the_pinned_torch_and_the_package():
    image, runs, cmd, base = dockerfile()
    assert base.startswith("python:3.11")
    torch = next(r for r in runs if "torch" in r)
    assert torch.split() == ["pip", "install", f"torch=={pins()['torch']}"]
    assert f"torch=={pins()['torch']}" in (ROOT / "Makefile").read_text()
    assert any(r.startswith("pip install .") for r in runs)
    assert runs.index(torch) < next(i for i, r in enumerate(runs) if r.startswith("pip install ."))
    assert image.endswith(f":{pins()['version']}")
    assert cmd[:2] == ["raytron", "serve"] and "--data-dir" in cmd and cmd[cmd.index("--host") + 1] == "0.0.0.0"


def test_launcher_head_runs_raytron_serve_on_the_image():
    image, _, cmd, _ = dockerfile()
    config = launcher()
    assert config["docker"]["image"] == image
    starts = config["head_start_ray_commands"]
    ray_start = next(i for i, c in enumerate(starts) if "ray start --head" in c)
    serve = next(i for i, c in enumerate(starts) if shlex.join(cmd) in c)
    assert ray_start < serve and "--num-gpus=0" in starts[ray_start]
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"]["GPU"] == 0
    data_dir = cmd[cmd.index("--data-dir") + 1]
    assert any(o.endswith(f":{data_dir}") for o in config["docker"]["head_run_options"])  # kept on the host


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["template"]["spec"]["containers"]


def test_kuberay_raycluster_runs_serve_on_the_head():
    image, _, cmd, _ = dockerfile()
    docs = manifests("kuberay-raycluster.yaml")
    cluster = docs["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["spec"]["rayVersion"] == pins()["ray"]
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = _containers(cluster["spec"]["headGroupSpec"])[0]
    assert head["image"] == image and head["command"] == ["/bin/bash", "-lc", "--"]
    script = head["args"][0]
    assert script.index("KUBERAY_GEN_RAY_START_CMD") < script.index(f"exec {shlex.join(cmd)}")
    assert 8000 in [p["containerPort"] for p in head["ports"]] and head["readinessProbe"]["httpGet"]["port"] == 8000
    data_dir = cmd[cmd.index("--data-dir") + 1]
    mount = next(m for m in head["volumeMounts"] if m["mountPath"] == data_dir)
    volume = next(v for v in cluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        worker = _containers(group)[0]
        assert worker["image"] == image and "$KUBERAY_GEN_RAY_START_CMD" in worker["args"][0]
        assert "raytron serve" not in worker["args"][0]


def test_kuberay_rayjob_runs_a_valid_spec_that_fits_its_cluster():
    image, _, _, _ = dockerfile()
    docs = manifests("kuberay-rayjob.yaml")
    job = docs["RayJob"]
    assert job["apiVersion"] == "ray.io/v1" and job["spec"]["rayClusterSpec"]["rayVersion"] == pins()["ray"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["raytron", "run"] and argv[argv.index("--launcher") + 1] == "ray"
    spec_path = Path(argv[2])
    cluster = job["spec"]["rayClusterSpec"]
    head = _containers(cluster["headGroupSpec"])[0]
    mount = next(m for m in head["volumeMounts"] if m["mountPath"] == str(spec_path.parent))
    volume = next(v for v in cluster["headGroupSpec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = docs["ConfigMap"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    spec = to_job_config(parse_spec(yaml.safe_load(config_map["data"][spec_path.name])))
    (group,) = cluster["workerGroupSpecs"]
    worker = _containers(group)[0]
    assert {head["image"], worker["image"]} == {image}
    assert spec.gpus_per_node == worker["resources"]["limits"]["nvidia.com/gpu"]
    assert spec.num_nodes <= group["minReplicas"] <= group["replicas"]


@pytest.mark.parametrize("name", ["kuberay-raycluster.yaml", "kuberay-rayjob.yaml"])
def test_manifests_are_kubernetes_objects(name):
    for doc in manifests(name).values():
        assert set(doc) >= {"apiVersion", "kind", "metadata", "spec" if doc["kind"] != "ConfigMap" else "data"}
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
