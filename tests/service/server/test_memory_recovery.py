"""Recovery from in-memory checkpoints on the path `make run` takes (`raytron serve --simulate`, jobs as Ray
Jobs): a rank killed with SIGKILL comes back from memory (the survivors from their own copies, its
replacement from the replica its peer on another node holds) without recomputing a finished
iteration (those the failed call finished are handed back from memory, recorded before the restore); with a hot spare node (``resources.spare_nodes: 1``) the lost rank's node and then a lost node
move onto the spare node of the moment, no actor created; a node lost together with the node holding its replicas
falls back to the disk checkpoint and says why; a node lost alone comes back from memory, its ranks
on another node. Each ends SUCCEEDED on the undisturbed curve (1e-6). One served cluster of 6
worker nodes for the module; the nodes are killed last (the cluster ends four nodes short)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.drills import DONE, _raylet_of, close, events, failures, ray_server_client, spec, story, submit, undisturbed, wait_iteration
from tests.helpers.server import job_losses, wait_for
from workers.rank.replicas import replica_holders

pytestmark = pytest.mark.ray

ITERS = 12


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    yield from ray_server_client(tmp_path_factory, "memrec", simulate="6x2")


def memory_spec(name: str) -> dict:
    """2 nodes x 2 slots, tp 2 x dp 2, a snapshot every iteration, a disk checkpoint every 5."""
    s = spec(name, nodes=2, gpus=2, tp=2, iters=ITERS, save_interval=5, timeout=60)
    s["fault_tolerance"]["memory_interval"] = 1
    return s


def placement(api, job_id: str) -> list[dict]:
    return api.get(f"/jobs/{job_id}/placement").json()["ranks"]


def kill_node(node_id: str, ranks: list[dict]) -> None:
    """A simulated worker node lost: its raylet and the rank processes on it killed (SIGKILL)."""
    raylet, head = _raylet_of(node_id)
    assert not head  # the head holds no ranks
    os.kill(raylet, signal.SIGKILL)
    for r in ranks:
        if r["node_id"] == node_id:
            try:
                os.kill(r["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def succeeded_on_the_curve(api, job_id: str, s: dict) -> list[dict]:
    expected = undisturbed(s)
    job = wait_for(api, job_id, DONE, timeout_s=300)
    assert job["state"] == "SUCCEEDED", (job, failures(api, job_id))
    losses = job_losses(api, job_id)
    assert close(losses, expected, rel=1e-6), story(api, job_id, losses, expected)
    return events(api, job_id)


def recorded_before_restores(log: list[dict]) -> list[int]:
    """Per restore event, the newest iteration recorded before it: those of the failed call that the
    ranks finished included (recorded after the failure, from memory)."""
    out, newest = [], 0
    for e in log:
        if e["kind"] == "iteration":
            newest = e["data"]["iteration"]
        elif e["kind"] == "restore":
            out.append(newest)
    return out


def test_a_rank_killed_comes_back_from_memory_without_recomputing_an_iteration(api):
    s = memory_spec("memkill")
    job_id = submit(api, s)
    wait_iteration(api, job_id, 6)
    ranks = placement(api, job_id)
    os.kill(next(r for r in ranks if r["rank"] == 1)["pid"], signal.SIGKILL)
    log = succeeded_on_the_curve(api, job_id, s)
    restores = [e for e in log if e["kind"] == "restore"]
    assert len(restores) == 1, story(api, job_id, [], [])
    restore = restores[0]["data"]
    # the newest finished iteration, none recomputed: every iteration recorded exactly once
    assert restore["source"] == "memory" and restore["iteration"] == recorded_before_restores(log)[0] >= 6, restores
    assert [e["data"]["iteration"] for e in log if e["kind"] == "iteration"] == list(range(1, ITERS + 1))
    assert restore["from_replicas"] == [1]  # the replacement took its peer's replica; the others their own
    holder = replica_holders([r["node"] for r in sorted(ranks, key=lambda r: r["rank"])], 1)[1][0]
    assert f"replica from rank {holder}" in next(p["resumed_from"] for p in placement(api, job_id) if p["rank"] == 1)


def test_a_hot_spare_takes_a_killed_rank_s_node_then_a_lost_node_s_ranks(api):
    """spare_nodes 1: rank 1 SIGKILLed, then the node of ranks 2 and 3 lost, in one job. The first
    time ranks 0 and 1 restart as the spare node's actors (tp groups stay in a node) and the
    node they left, its survivor reset and one actor started beside it, is the spare; the
    second time ranks 2 and 3 move onto that one. Each restore is the newest recorded iteration
    from memory (none recomputed); the curve is the undisturbed one."""
    s = memory_spec("memspare")
    s["resources"]["spare_nodes"] = 1
    job_id = submit(api, s)
    wait_iteration(api, job_id, 4)
    view = api.get(f"/jobs/{job_id}/placement").json()
    ranks = view["ranks"]
    spare_node = view["spares"][0]["node_id"]
    assert len(view["spares"]) == 1 and spare_node not in {r["node_id"] for r in ranks}, view["spares"]
    assert any(sp["job_id"] == job_id for sp in api.get("/cluster").json()["spares"])
    os.kill(next(r for r in ranks if r["rank"] == 1)["pid"], signal.SIGKILL)
    while not any(e["kind"] == "restore" for e in events(api, job_id)):
        time.sleep(0.2)
    wait_iteration(api, job_id, 8)
    moved = {r["rank"]: r for r in placement(api, job_id)}
    assert all(moved[r]["node_id"] == spare_node and moved[r]["spare"] for r in (0, 1)), moved
    lost = moved[2]["node_id"]
    kill_node(lost, list(moved.values()))
    log = succeeded_on_the_curve(api, job_id, s)
    kills = [i for i, e in enumerate(log) if e["kind"] == "failure"]
    restores = [e["data"] for e in log if e["kind"] == "restore"]
    assert len(kills) == 2 and len(restores) == 2, story(api, job_id, [], [])
    for newest, restore, ranks_moved in zip(recorded_before_restores(log), restores, ([0, 1], [2, 3])):
        assert restore["source"] == "memory" and restore["iteration"] == newest, restores
        assert restore["spare_ranks"] == ranks_moved == restore["from_replicas"], restores
    assert [e["data"]["iteration"] for e in log if e["kind"] == "iteration"] == list(range(1, ITERS + 1))
    before = {r["rank"]: r["node_id"] for r in ranks}
    after = {r["rank"]: r for r in placement(api, job_id)}
    assert after[0]["node_id"] == after[1]["node_id"] == spare_node  # the spare node taken first
    assert after[2]["node_id"] == after[3]["node_id"] == before[0] != lost  # the node ranks 0, 1 left
    assert all(after[r]["spare"] for r in (2, 3)) and not any(after[r]["spare"] for r in (0, 1))


def test_a_lost_node_s_ranks_come_back_from_memory_on_another_node(api):
    s = memory_spec("memnode")
    job_id = submit(api, s)
    wait_iteration(api, job_id, 6)
    ranks = placement(api, job_id)
    lost = next(r for r in ranks if r["rank"] == 0)["node_id"]
    kill_node(lost, ranks)
    log = succeeded_on_the_curve(api, job_id, s)
    restores = [e["data"] for e in log if e["kind"] == "restore"]
    assert len(restores) == 1 and restores[0]["source"] == "memory", restores
    assert restores[0]["iteration"] == recorded_before_restores(log)[0] >= 6, restores
    assert [e["data"]["iteration"] for e in log if e["kind"] == "iteration"] == list(range(1, ITERS + 1))
    on_lost = sorted(r["rank"] for r in ranks if r["node_id"] == lost)
    assert restores[0]["from_replicas"] == on_lost  # from the replicas on the other node
    after = {r["rank"]: r for r in placement(api, job_id)}
    assert all(after[r]["node_id"] != lost for r in on_lost)  # its ranks on another node
    assert all(after[r["rank"]]["reused"] for r in ranks if r["node_id"] != lost)  # the others stayed


def test_a_node_lost_with_the_node_holding_its_replicas_falls_back_to_disk_and_says_why(api):
    s = memory_spec("memnodes")
    job_id = submit(api, s)
    wait_iteration(api, job_id, 7)
    ranks = placement(api, job_id)
    nodes = {r["node_id"] for r in ranks}
    assert len(nodes) == 2  # each node holds the other's replicas: both copies of every rank go
    for node_id in nodes:
        kill_node(node_id, ranks)
    log = succeeded_on_the_curve(api, job_id, s)
    restores = [e for e in log if e["kind"] == "restore"]
    assert len(restores) == 1, restores
    restore = restores[0]
    assert restore["data"]["source"] == "disk" and restore["data"]["iteration"] == 5, restore
    assert "in-memory state" in restore["message"] and "iter_0000005" in restore["message"], restore
