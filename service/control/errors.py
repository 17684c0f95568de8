"""Typed job failures, each with a stable ``code`` (API error codes map to it).

A rank failure names the rank, where it ran (node index, node id, pid) and its grid
coordinates, so that a user can find the process and the parallel group at once.
"""

from __future__ import annotations


class JobError(RuntimeError):
    """A job could not run to the end."""

    code = "job_error"

    def to_dict(self) -> dict:
        return {"code": self.code, "message": str(self)}


class InsufficientResources(JobError):
    """The job does not fit the cluster (at all, or not within the timeout); the message has needed vs available."""

    code = "insufficient_resources"


class ClusterUnreachable(JobError):
    """The Ray cluster (``RAY_ADDRESS``) did not answer in time."""

    code = "cluster_unreachable"


class JobCancelled(JobError):
    code = "cancelled"


class NonFiniteMetric(JobError):
    """The loss or the gradient norm of an iteration is NaN or infinite (Megatron's NaN check).

    Deterministic: a new attempt would reach the same number, so no policy restarts it.
    """

    code = "non_finite"

    def __init__(self, iteration: int, name: str, value: float):
        self.iteration, self.name, self.value = iteration, name, value
        super().__init__(f"iteration {iteration}: {name} is {value} (not finite); lower training.lr or check "
                         f"training.data")

    def to_dict(self) -> dict:
        return {**super().to_dict(), "iteration": self.iteration, "metric": self.name}


class RankError(JobError):
    """A rank failed. ``where``: node index, node id, pid and grid coordinates (what is known)."""

    code, verb = "rank_failed", "failed"

    def __init__(self, rank: int, where: dict, cause: str, remote_traceback: str = ""):
        self.rank, self.where, self.cause, self.remote_traceback = rank, dict(where), cause, remote_traceback
        at = ", ".join(f"{k} {v}" for k, v in self.where.items())
        super().__init__(f"rank {rank} ({at}) {self.verb}: {cause}" if at else f"rank {rank} {self.verb}: {cause}")

    def to_dict(self) -> dict:
        return {**super().to_dict(), "rank": self.rank, **self.where, "cause": self.cause}


class RankDied(RankError):
    """The rank's process died (crash, OOM kill, node loss)."""

    code, verb = "rank_died", "died"


class RankRaised(RankError):
    """The rank raised an exception; ``remote_traceback`` has the rank's traceback."""

    code, verb = "rank_raised", "raised"


class RankHung(RankError):
    """The rank stopped answering while its peers gave up on it (collective timeout or progress watch)."""

    code, verb = "rank_hung", "stopped answering"


_PEER_SYMPTOMS = ("closed by peer", "reset by peer", "broken pipe", "timed out", "timeout", "socket closed",
                  "connection refused", "connection closed")


def is_root_cause(error: RankError) -> bool:
    """A death or hang, or an exception that is not merely a peer's collective breaking under it."""
    if isinstance(error, (RankDied, RankHung)):
        return True
    return not any(s in error.cause.lower() for s in _PEER_SYMPTOMS)
