"""In-memory checkpoints replicated off-node (workers/rank/replicas.py, workers/checkpoint/memory.py): the
holders as a function of the placement, the restore plan, and, on real gloo ranks, a replaced rank
restored bit for bit from the replica its peer holds, going on on the undisturbed curve."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from tests.helpers.parity import job_of, tiny_spec
from tests.helpers.ranks import run_ranks
from workers.rank.replicas import plan_restore, replica_holders


@pytest.mark.parametrize("nodes,replicas", [([0, 0, 1, 1], 1), ([0, 0, 1, 1, 2, 2], 2), ([0, 1, 2], 1),
                                            (["b", "b", "a", "a", "c", "c", "c"], 2)])
def test_no_node_holds_two_copies_of_a_rank(nodes, replicas):
    holders = replica_holders(nodes, replicas)
    for r, hs in enumerate(holders):
        assert len(hs) == replicas
        assert nodes[r] not in {nodes[h] for h in hs}  # never on its own node
        assert len({nodes[h] for h in hs}) == replicas  # each replica on a node of its own
    assert holders == replica_holders(list(nodes), replicas)  # a pure function of the placement


def test_equal_nodes_share_the_replicas_evenly():
    holders = replica_holders([0, 0, 1, 1, 2, 2], 1)
    assert holders == [[2], [3], [4], [5], [0], [1]]
    assert sorted(h for hs in holders for h in hs) == list(range(6))


def test_one_node_cannot_hold_an_off_node_replica():
    with pytest.raises(ValueError, match="memory_replicas 1 needs more than 1 node"):
        replica_holders([0, 0], 1)


def test_the_newest_iteration_held_somewhere_for_every_rank_is_restored():
    # rank 1 replaced (nothing of its own); rank 3 holds its replica of iteration 4, not yet of 5
    inv = [{"own": [4, 5], "held": {2: [4, 5]}}, {"own": [], "held": {}},
           {"own": [4, 5], "held": {0: [4, 5]}}, {"own": [4, 5], "held": {1: [4]}}]
    assert plan_restore(inv, None) == (4, {0: None, 1: (3, None), 2: None, 3: None}, "")
    # the controller recorded only iteration 3: nothing newer is taken
    assert plan_restore(inv, 3)[0] is None


def test_a_prefix_replica_is_completed_by_a_data_parallel_twin():
    # ranks 0 and 2 are twins, so are 1 and 3; rank 1 replaced: its replica at rank 3 is a prefix
    twins = [[2], [3], [0], [1]]
    inv = [{"own": [4, 5], "held": {2: [4, 5]}, "prefixes": {2: [4, 5]}}, {"own": [], "held": {}},
           {"own": [4, 5], "held": {0: [4, 5]}, "prefixes": {0: [4, 5]}},
           {"own": [4, 5], "held": {1: [4, 5]}, "prefixes": {1: [4, 5]}}]
    assert plan_restore(inv, None, twins) == (5, {0: None, 1: (3, 3), 2: None, 3: None}, "")
    # the twin lost as well (rank 3 replaced too, rank 1's replica at rank 0... a prefix without a twin)
    inv = [{"own": [5], "held": {3: [5]}, "prefixes": {3: [5]}}, {"own": [], "held": {}},
           {"own": [5], "held": {1: [5]}, "prefixes": {1: [5]}}, {"own": [], "held": {}}]
    iteration, _, why = plan_restore(inv, None, twins)
    assert iteration is None and "rank(s) [1, 3]" in why and "data-parallel twins" in why
    # a whole replica held elsewhere (another attempt's) still restores rank 1: its twin is lost
    inv[1]["held"] = {}
    both = [dict(i) for i in inv]
    both[2] = {"own": [5], "held": {1: [5], 3: [5]}, "prefixes": {}}  # whole, at a higher holder than the prefix one
    both[0] = {"own": [5], "held": {3: [5], 1: [5]}, "prefixes": {3: [5], 1: [5]}}
    assert plan_restore(both, None, twins) == (5, {0: None, 1: (2, None), 2: None, 3: (2, None)}, "")
    # a full replica needs no twin
    inv[2]["prefixes"] = {}
    inv[0]["prefixes"] = {}
    assert plan_restore(inv, None, twins) == (5, {0: None, 1: (2, None), 2: None, 3: (0, None)}, "")


def test_both_copies_lost_says_which_rank():
    inv = [{"own": [4, 5], "held": {}}, {"own": [], "held": {}}, {"own": [4, 5], "held": {0: [4, 5]}},
           {"own": [], "held": {}}]
    iteration, _, why = plan_restore(inv, None)
    assert iteration is None and "rank(s) [1, 3]" in why and "both copies" in why


def _digest(buf) -> str:
    return hashlib.sha256(buf.numpy().tobytes()).hexdigest()


def _replicate_and_replace(rank, world_size, job, reference, replaced):
    """Train 3 iterations replicating every iteration, in two calls of which the driver recorded only
    the first (the second failed, as far as it knows); then a new attempt in which ``replaced`` has
    lost its memory (a new process) restores iteration 3, hands the unrecorded iteration's metrics
    back (rank 0), and trains 2 more."""
    from workers.checkpoint.memory import pack
    from workers.rank.main import RankRunner
    from workers.rank.replicas import MemoryStore

    ref = RankRunner(reference, rank, world_size)
    expected = [m["loss"] for m in ref.run(5)]
    ref.close()
    store = MemoryStore()
    first = RankRunner(job, rank, world_size, node=rank // 2, memory=store)
    first.run(2)
    sent = first.run(1)[-1]  # the call the driver never got back
    store.settle(wait=True)
    first.close()
    own = _digest(store.own[3])
    prefix = first.replicator.replica_sizes[rank]  # the bytes its replicas hold
    own_sent, is_prefix = _digest(store.own[3][:prefix]), prefix < store.own[3].numel()
    held = {s: _digest(its[3]) for s, its in store.held.items()}
    if rank == replaced:
        store = MemoryStore()
    again = RankRunner(replace(job, memory_upto=2), rank, world_size, node=rank // 2, memory=store)
    restored = _digest(pack(again.trainer))
    losses = [m["loss"] for m in again.run(2)]
    again.close()
    return {"expected": expected[3:], "losses": losses, "own": own, "held": held, "restored": restored,
            "resumed": dict(again.resumed), "sent": sent["memory_bytes_sent"], "unrecorded": sent,
            "own_sent": own_sent, "prefix": is_prefix}


@pytest.mark.procs
@pytest.mark.parametrize("parallel,twins", [
    ({"tensor_model_parallel_size": 2, "use_distributed_optimizer": True}, True),  # dp 2 across the nodes
    ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, False)])  # no data-parallel twin
def test_a_replaced_rank_restores_bit_for_bit_from_its_peers_replica(parallel, twins):
    """With a data-parallel twin on the other node a replica is the snapshot's prefix (the meta and the
    ZeRO shards) and the twin's own copy gives the params; without one the replica is whole."""
    spec = tiny_spec(world=4, parallel=parallel, training={"train_iters": 5, "eval_interval": None})
    spec["resources"] = {"num_nodes": 2, "gpus_per_node": 2}
    reference = job_of(spec)
    job = job_of({**spec, "fault_tolerance": {"memory_interval": 1}})
    out = run_ranks(_replicate_and_replace, 4, (job, reference, 1), backend="gloo")
    holders = replica_holders([0, 0, 1, 1], 1)
    for r, o in enumerate(out):
        assert o["prefix"] == twins
        assert out[holders[r][0]]["held"][r] == o["own_sent"]  # the peer's replica is the rank's state, bit for bit
        assert o["restored"] == o["own"]  # the restored trainer packs to the very same bytes
        assert o["losses"] == o["expected"]  # and goes on on the undisturbed curve
        assert o["resumed"]["iteration"] == 3 and o["sent"] > 0
    # iteration 3 is not computed again: rank 0 hands its metrics (rank 0's own) back to the driver
    assert out[0]["resumed"]["caught_up"] == [out[0]["unrecorded"]] and out[0]["unrecorded"]["iteration"] == 3
    assert all(o["resumed"]["caught_up"] is None for o in out[1:])
    twin = f", params from its data-parallel twin rank 3" if twins else ""
    assert out[1]["resumed"]["path"] == f"memory (replica from rank {holders[1][0]}{twin})"
    assert out[0]["resumed"]["path"] == "memory (own)"
