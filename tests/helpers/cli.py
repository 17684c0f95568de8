"""Running the CLI as a user does, and checking how it refuses bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

RAYTRON = str(Path(sys.executable).with_name("raytron"))


GOOD = {"name": "bad", "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 256,
                                 "seq_length": 16},
        "training": {"train_iters": 2, "global_batch_size": 2, "micro_batch_size": 1},
        "resources": {"num_nodes": 1, "gpus_per_node": 1}}


def refused(*args) -> str:
    p = subprocess.run([RAYTRON, *args], capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and p.stdout == "", (p.returncode, p.stderr, p.stdout)
    return lines[0]


def spec_file(tmp_path, text=None, **sections) -> str:
    spec = {k: dict(v) for k, v in GOOD.items() if isinstance(v, dict)} | {"name": "bad"}
    for section, values in sections.items():
        spec.setdefault(section, {}).update(values)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec) if text is None else text)
    return str(path)


def run_refused(path) -> str:
    line = refused("run", path, "--launcher", "processes")
    assert path in line  # the file is named
    return line
