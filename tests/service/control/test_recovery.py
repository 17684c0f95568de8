"""The restore event of a restarted attempt with in-memory checkpoints (service/control/recovery.py)."""

from service.control.events import JobState
from service.control.recovery import restore_event


def test_memory_restore_names_the_ranks_that_took_replicas():
    placement = [{"rank": 0, "resumed_from": "memory (own)"}, {"rank": 1, "resumed_from": "memory (replica from rank 3)"}]
    e = restore_event(JobState.STARTING, 6, "/ck/iter_0000005", placement)
    assert e.kind == "restore" and e.data == {"iteration": 6, "source": "memory", "from_replicas": [1],
                                              "spare_ranks": []}
    assert e.message == ("restored iteration 6 from memory: ranks [1] from their replicas on other nodes, "
                         "the others from their own copies")


def test_a_restore_on_a_hot_spare_says_so():
    placement = [{"rank": 0, "resumed_from": "memory (replica from rank 2)", "spare": True},
                 {"rank": 1, "resumed_from": "memory (replica from rank 3)", "spare": True},
                 {"rank": 2, "resumed_from": "memory (own)", "spare": False}]
    e = restore_event(JobState.STARTING, 6, None, placement)
    assert e.data["spare_ranks"] == [0, 1] == e.data["from_replicas"]
    assert e.message.endswith("; ranks [0, 1] on a hot spare node (resources.spare_nodes)")


def test_a_fall_back_to_disk_says_why():
    why = "both copies of rank(s) [1]'s in-memory state are lost"
    placement = [{"rank": 0, "resumed_from": "/ck/iter_0000005", "restore_note": why}, {"rank": 1, "resumed_from": "/ck/iter_0000005"}]
    e = restore_event(JobState.STARTING, 5, "/ck/iter_0000005", placement)
    assert e.data["source"] == "disk" and e.data["iteration"] == 5 and e.data["why"] == why
    assert e.message == f"restored iteration 5 from the disk checkpoint /ck/iter_0000005: {why}"
    assert restore_event(JobState.STARTING, 0, None, [{"rank": 0}]).data["source"] == "start"
