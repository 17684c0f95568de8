"""What a user may submit: a rate limit, a cap on queued jobs, the GPU quota and the priority cap.

Admins are exempt from the rate limit and the queued-jobs cap (the bootstrap admin is the embedded
single-token default, whose behaviour is unchanged); quotas and priority caps apply to whoever
has one. Each refusal names the numbers and the fix, and the submit route records it in the
audit trail. The body size limit is :class:`api.rest.app.BodyLimit` (``Settings.max_body_bytes``).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

from api.rest.errors import ApiError
from service.server.accounts import Accounts, User


class RateLimiter:
    """A token bucket per key: ``burst`` at once, refilled at ``per_minute`` per minute."""

    def __init__(self, per_minute: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = per_minute / 60.0, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str) -> float | None:
        """Take one for ``key``: None when allowed, else the seconds until one is free."""
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return None
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate if self.rate > 0 else math.inf


def check_rate(limiter: RateLimiter, user: User) -> None:
    """429 with ``Retry-After`` when the user submits faster than the server allows."""
    if user.admin:
        return
    wait = limiter.take(user.name)
    if wait is not None:
        seconds = max(1, math.ceil(wait)) if math.isfinite(wait) else 3600
        raise ApiError(429, "rate_limited", f"user {user.name!r} submits faster than the server allows "
                       f"({limiter.rate * 60:g} submissions per minute, {limiter.burst} at once); retry after "
                       f"{seconds} s", headers={"Retry-After": str(seconds)})


def check_submission(user: User, accounts: Accounts, settings, *, num_gpus: int, priority: int) -> None:
    """The priority cap, the GPU quota and the queued-jobs cap of ``user`` for one job."""
    cap = None if user.admin else (user.max_priority if user.max_priority is not None else settings.max_user_priority)
    if cap is not None and priority > cap:
        message = (f"priority {priority} is above user {user.name!r}'s cap of {cap}; submit with priority {cap} or "
                   f"lower, or ask an admin to raise the cap (raytron users add --max-priority)")
        raise ApiError(422, "priority_over_cap", message, errors=[{"field": "priority", "message": message}])
    if user.gpu_quota is not None and num_gpus > user.gpu_quota:
        message = (f"the job needs {num_gpus} GPU slots (resources.num_nodes x resources.gpus_per_node) but user "
                   f"{user.name!r}'s GPU quota is {user.gpu_quota}: it could never start; lower the world size to "
                   f"at most {user.gpu_quota} or ask an admin for a larger quota")
        raise ApiError(422, "over_quota", message, errors=[{"field": "resources", "message": message}],
                       needed=num_gpus, quota=user.gpu_quota)
    if not user.admin:
        queued = accounts.queued_jobs(user.name)
        if queued >= settings.max_queued_per_user:
            raise ApiError(429, "too_many_queued", f"user {user.name!r} has {queued} jobs queued, the most the "
                           f"server allows per user ({settings.max_queued_per_user}); wait for some to start, or "
                           f"cancel some", headers={"Retry-After": "60"})
