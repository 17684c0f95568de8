"""Every spec in examples/ plans (``raytron plan SPEC --json``, exit 0); the real-size ones (8 GPUs per
node) fit an 80 GB GPU by the cost model, keep TP inside a node, and have the published parameter
counts of the models they are shaped after (Llama-3-8B exactly; the others' nominal sizes within 1%)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from api.cli.main import main as cli_main
from service.spec.placement import check_tp_in_node, plan_placement
from service.spec.spec import grid_of, parse_spec

from tests.helpers.paths import EXAMPLES
PUBLISHED = {  # parameters: exact where the count is known to the parameter, else the model card's size
    "llama3-8b.yaml": (8_030_261_248, 0.0),
    "qwen3-8b.yaml": (8.2e9, 0.01),
    "qwen3-30b-a3b.yaml": (30.5e9, 0.01),
    "deepseek-v3-16b.yaml": (16e9, 0.01),  # Moonlight-16B-A3B's sizes
}


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    """Stand-ins for a chat example's data and tokenizer directory (the example names real paths)."""
    from tests.helpers.chat import CONVERSATIONS, chat_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("chat")
    return {"chat_data": write_jsonl(root / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS]),
            "chat_tokenizer": chat_tokenizer(root / "tok", "chatml")}


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_plans(example, capsys, tmp_path, chat_files):
    path = EXAMPLES / example
    spec = yaml.safe_load(path.read_text())
    if spec.get("training", {}).get("chat_data"):  # the stand-ins for the real paths
        spec["training"].update(chat_files)
        path = tmp_path / example
        path.write_text(yaml.safe_dump(spec))
    assert cli_main(["plan", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    if plan["gpus_per_node"] < 8:
        return
    assert plan["cost"]["cluster"]["memory_gb"] == 80.0
    assert plan["cost"]["fits"] and plan["cost"]["peak_bytes_per_rank"] <= 0.85 * 80e9, plan["cost"]
    if "auto" not in example:
        spec = parse_spec(yaml.safe_load(path.read_text()))
        grid = grid_of(spec)
        assert check_tp_in_node(grid, [p.node for p in plan_placement(grid, 8, spec.resources.num_nodes)]) == []
    if example in PUBLISHED:
        want, rel = PUBLISHED[example]
        assert abs(plan["model_parameters"] - want) <= rel * want, (plan["model_parameters"], want)


def test_the_new_real_size_examples_are_all_checked():
    assert set(PUBLISHED) <= {p.name for p in EXAMPLES.glob("*.yaml")}
