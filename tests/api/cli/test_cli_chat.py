"""Chat fine-tuning data on the paths users take: each bad input is refused before anything starts
(``raytron run`` exit 2 with one line, ``POST /api/v1/jobs`` 422) naming the file, the line and the
fix; a chat job killed mid-epoch (a rank exits at iteration 4, checkpoints every 2) goes on at the
next unseen packed row and ends on the undisturbed curve, map-style and streaming."""

import json
import subprocess

import pytest
import yaml

from tests.helpers.chat import CONVERSATIONS, chat_tokenizer, write_jsonl
from tests.helpers.cli import RAYTRON
from tests.helpers.drills import run_locally
from tests.helpers.parity import tiny_spec
from tests.helpers.server import api, server  # noqa: F401

pytestmark = pytest.mark.procs

BAD = [
    ({"text": "hi"}, "line 2: no messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "line 2: unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
     "line 2: an empty assistant turn"),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {"llama3": chat_tokenizer(root / "llama3", "llama3"), "none": chat_tokenizer(root / "none", None)}


def _spec(tmp_path, data, tokenizer, world=1, **training):
    spec = tiny_spec(world=world, model={"vocab_size": 320, "seq_length": 32},
                     training={"chat_data": data, "chat_tokenizer": tokenizer, "eval_interval": None, **training})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, spec


@pytest.mark.parametrize("record, needle", BAD)
def test_bad_chat_data_exits_2_and_is_a_422_naming_file_and_line(tmp_path, tokenizer, api, record, needle):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}, record])
    path, spec = _spec(tmp_path, data, tokenizer["llama3"])
    p = subprocess.run([RAYTRON, "run", str(path)], capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert f"chat.jsonl {needle}" in lines[0]
    r = api.post("/jobs", json=spec)
    assert r.status_code == 422 and any(f"chat.jsonl {needle}" in e["message"] for e in r.json()["errors"]), r.text


def test_a_tokenizer_without_a_template_and_an_overlong_sample_exit_2(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    for tok, extra, needle in [(tokenizer["none"], {}, "the tokenizer has no chat template"),
                               (tokenizer["llama3"], {"chat_overflow": "error"},
                                "chat.jsonl line 1: 66 tokens, more than seq_length 32 + 1; raise model.seq_length or set "
                                "training.chat_overflow")]:
        path, _ = _spec(tmp_path, data, tok, **extra)
        p = subprocess.run([RAYTRON, "run", str(path)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("streaming", [False, True])
def test_a_chat_job_killed_mid_epoch_resumes_on_the_undisturbed_curve(tmp_path, tokenizer, streaming):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS] * 10)
    path, _ = _spec(tmp_path, data, tokenizer["llama3"], world=2, train_iters=6, chat_streaming=streaming)

    def run(*extra):
        p = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes", "--json", *extra],
                           capture_output=True, text=True, timeout=300)
        return p, json.loads(p.stdout.strip().splitlines()[-1])

    ref = run_locally(yaml.safe_load(path.read_text()))  # the undisturbed run, in this process
    spec = yaml.safe_load(path.read_text())
    spec["checkpoint"] = {"save_interval": 2, "dir": str(tmp_path / "ckpt")}
    spec["fault_tolerance"] = {"max_restarts": 1, "collective_timeout_s": 20}
    path.write_text(yaml.safe_dump(spec))
    p, out = run("--fault", "1@4:exit")
    assert p.returncode == 0 and out["restarts"] == 1, p.stderr
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(out["losses"], ref["losses"])) and len(out["losses"]) == 6
    # what a user sees of the packing: the step's loss tokens and the rows' fill, per iteration
    assert out["loss_tokens"] == ref["loss_tokens"] and all(t > 0 for t in out["loss_tokens"])
    assert all(0.5 < e <= 1.0 for e in out["packing_efficiency"])


def test_preprocess_format_chat_writes_what_a_job_trains_on(tmp_path, tokenizer):
    """`raytron preprocess --format chat` renders once; a spec naming its prefix plans and trains (no
    tokenizer needed at train time), with the loss of the same records rendered at start; a bad
    record exits 2 with one line naming the file and line, writing nothing."""
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS] * 10)
    p = subprocess.run([RAYTRON, "preprocess", data, "--format", "chat", "--tokenizer", tokenizer["llama3"],
                        "--output-prefix", str(tmp_path / "sft"), "--seq-length", "32", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["samples"] > 0 and out["samples"] + out["dropped"] == 20
    ran = {}
    ran["rendered"] = run_locally(_spec(tmp_path, data, tokenizer["llama3"], train_iters=2)[1])["losses"]
    path, _ = _spec(tmp_path, str(tmp_path / "sft"), None, train_iters=2)
    q = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert q.returncode == 0, q.stderr
    ran["preprocessed"] = json.loads(q.stdout.strip().splitlines()[-1])["losses"]
    assert ran["preprocessed"] == ran["rendered"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATIONS[0]}, {"text": "hi"}])
    p = subprocess.run([RAYTRON, "preprocess", bad, "--format", "chat", "--tokenizer", tokenizer["llama3"],
                        "--output-prefix", str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "bad.jsonl line 2: no messages" in p.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.glob("bad_chat*.bin")) and not list(tmp_path.glob("bad_chat*.idx"))
