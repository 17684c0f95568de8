"""Trials of auto layouts (``raytron plan --auto --trial K``, ``raytron run --trial K``): the re-ranking
by measured step time, the measurements of real trials on local processes, the job started with the
winner and its ``layout`` event, and the same loss whichever layout runs. No timing is asserted:
only that the winner is the candidate with the smallest measured time."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from api.cli.main import main as cli_main
from service.control.errors import JobError
from service.control.jobs import start_job
from service.control.trials import layout_record, rerank, run_trials, winner_job
from service.ranks.process_launcher import ProcessLauncher
from service.spec.spec import search_layouts

pytestmark = pytest.mark.procs

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "vocab_size": 256,
         "seq_length": 32}


def auto_spec(iters=4):
    return {"name": "trial", "model": dict(MODEL), "parallel": "auto",
            "training": {"train_iters": iters, "global_batch_size": 4, "micro_batch_size": 1},
            "resources": {"num_nodes": 1, "gpus_per_node": 2}}


def fake_found(n):
    return {"candidates": [{"sizes": {"tp": i + 1}, "predicted_step_s": 0.1 * (i + 1), "data": {}} for i in range(n)],
            "chosen": 0, "open": []}


def test_rerank_puts_the_smallest_measured_time_first_failed_trials_last_untried_after():
    found = fake_found(5)
    measured = [{"measured_step_s": 0.3}, {"trial_error": "rank 1 died"}, {"measured_step_s": 0.1},
                {"measured_step_s": 0.2}]
    out = rerank(found, measured)
    assert [c["predicted_rank"] for c in out["candidates"]] == [2, 3, 0, 1, 4]
    assert out["chosen"] == 0 and out["trials"] == 4
    assert out["candidates"][3]["trial_error"] == "rank 1 died" and "measured_step_s" not in out["candidates"][4]
    with pytest.raises(JobError, match="every trial failed: a; b"):
        rerank(fake_found(2), [{"trial_error": "a"}, {"trial_error": "b"}])


def test_plan_auto_trial_json_measures_each_candidate_and_ranks_by_measured_time(tmp_path, capsys):
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(auto_spec()))
    assert cli_main(["plan", "--auto", str(path), "--trial", "3", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["trials"] == 3 and found["chosen"] == 0
    tried = found["candidates"][:3]
    assert sorted(c["predicted_rank"] for c in tried) == [0, 1, 2]
    for c in tried:
        assert c["measured_step_s"] > 0 and len(c["measured_steps_s"]) == 3 and len(c["losses"]) == 3
        assert c["measured_step_s"] == pytest.approx(statistics.median(c["measured_steps_s"][1:]))  # warm-up out
        assert 50e6 < c["measured_peak_bytes"] < 4e9  # a CPU rank's VmHWM: the torch import and up
        assert "data" not in c
    times = [c["measured_step_s"] for c in tried]
    assert times == sorted(times)
    assert [c["predicted_rank"] for c in found["candidates"][3:]] == list(range(3, len(found["candidates"])))
    # the loss curve does not depend on the layout: every trial trains the same first iterations
    for c in tried[1:]:
        assert c["losses"] == pytest.approx(tried[0]["losses"], rel=1e-5, abs=1e-6)


def test_plan_auto_trial_prints_predicted_beside_measured(tmp_path, capsys):
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(auto_spec()))
    assert cli_main(["plan", "--auto", str(path), "--trial", "2", "--trial-iters", "2"]) == 0
    out = capsys.readouterr().out
    assert "trials: 2 layouts, ranked by measured step time" in out
    assert "pred s   meas s  pred GB  meas GB" in out


def test_a_job_starts_with_the_winner_and_records_the_choice_in_its_events():
    found = search_layouts(auto_spec())
    events = []
    with_launcher = ProcessLauncher()
    found = run_trials(found, 2, with_launcher, iterations=2)
    job, grid = winner_job(found)
    controller = start_job(job, launcher=with_launcher, on_event=events.append, background=False,
                           layout=layout_record(found))
    result = controller.run()
    assert result["state"] == "SUCCEEDED", result
    layout = [e for e in events if e.kind == "layout"]
    assert len(layout) == 1 and events[0].kind == "state" and events[1] is layout[0]
    chosen = layout[0].data["chosen"]
    assert all(result["sizes"][k] == grid.sizes()[k] == v for k, v in chosen["sizes"].items() if k != "vpp")
    assert chosen["measured_step_s"] == min(c["measured_step_s"] for c in layout[0].data["candidates"][:2])
    assert layout[0].data["trials"] == 2 and "fastest of 2 trials" in layout[0].message
    # the job's first iterations are the trials' (the same data, the same loss whichever layout won)
    assert result["losses"][:2] == pytest.approx(found["candidates"][0]["losses"], rel=1e-5, abs=1e-6)
    json.dumps(layout[0].data)  # stored as JSON by the server's recorder


def test_run_trial_starts_the_winner_and_a_concrete_spec_is_refused(tmp_path, capsys):
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(auto_spec(iters=2)))
    assert cli_main(["run", str(path), "--launcher", "processes", "--trial", "2", "--trial-iters", "2"]) == 0
    err = capsys.readouterr().err
    assert "auto layout:" in err and "fastest of 2 trials" in err and "trial 2/2" in err
    fixed = auto_spec()
    fixed["parallel"] = {"tensor_model_parallel_size": 2}
    path.write_text(yaml.safe_dump(fixed))
    assert cli_main(["run", str(path), "--launcher", "processes", "--trial", "2"]) == 2
    err = capsys.readouterr().err
    assert "--trial 2" in err and "fixes its layout" in err and "parallel: auto" in err


def test_the_bench_ranks_with_spearmans_rho():
    from bench.auto_layout_bench import main, spearman

    assert callable(main)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0 and spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert spearman([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(0.8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers.server import module_server

    yield from module_server(tmp_path_factory, "auto-trials")


def test_a_submitted_auto_spec_records_the_chosen_layout_in_its_events(server):
    from tests.helpers.server import tiny, wait_for

    spec = {**tiny(name="auto-rest"), "parallel": "auto"}
    with server.client() as api:
        job = api.post("/jobs", json=spec)
        assert job.status_code == 201, job.text
        job = wait_for(api, job.json()["id"], ("SUCCEEDED", "FAILED"))
        assert job["state"] == "SUCCEEDED", job
        layout = api.get(f"/jobs/{job['id']}/events", params={"kind": "layout"}).json()["events"]
    expected = search_layouts(spec)["candidates"][0]
    assert len(layout) == 1 and layout[0]["state"] == "QUEUED"
    assert layout[0]["data"]["chosen"]["sizes"] == expected["sizes"]
    assert {k: v for k, v in job["sizes"].items() if k in expected["sizes"]} == \
        {k: v for k, v in expected["sizes"].items() if k != "vpp"}
    assert "the cost model's best of" in layout[0]["message"]
    with server.client() as api:  # a concrete spec records none
        plain = api.post("/jobs", json=tiny(name="plain-rest")).json()
        wait_for(api, plain["id"], ("SUCCEEDED", "FAILED"))
        assert api.get(f"/jobs/{plain['id']}/events", params={"kind": "layout"}).json()["events"] == []


@pytest.mark.parametrize("argv, words", [
    (["plan", "--trial", "2"], "--trial 2 ranks the layouts of --auto"),
    (["plan", "--auto", "--trial-iters", "2"], "--trial-iters 2 is the length of each trial"),
    (["plan", "--auto", "--launcher", "ray"], "--launcher is where trials run"),
    (["plan", "--simulate", "2x4"], "--simulate is where trials run"),
    (["run", "--launcher", "processes", "--trial-iters", "2"], "--trial-iters 2 is the length of each trial"),
])
def test_trial_flags_that_would_be_ignored_are_refused(tmp_path, capsys, argv, words):
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(auto_spec()))
    assert cli_main([*argv, str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
