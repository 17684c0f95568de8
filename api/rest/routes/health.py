"""``/healthz`` (no token) and ``/metrics`` (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from api.rest.deps import SchedulerDep, StoreDep, UserDep, require_token
from api.rest.routes.jobs import job_restarts
from api.rest.schemas import Health
from service.server.store import STATES, TERMINAL_STATES

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> dict:
    """Liveness: the server answers (no token needed)."""
    return {"status": "ok"}


@router.get("/metrics", dependencies=[Depends(require_token)], response_class=Response,
            responses={200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {
                "type": "string"}}}}})
def metrics(store: StoreDep, scheduler: SchedulerDep, user: UserDep = None) -> Response:
    """Jobs by state, queue length, and per active (or recent) job: iteration, loss, tokens/s, restarts
    (a user's own jobs; an admin's token: every job)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily

    rows = store.list_jobs(limit=1000, owner=None if user is None or user.admin else user.name)
    by_state = {s: 0 for s in STATES}
    for r in rows:
        by_state[r["state"]] += 1
    families = []
    jobs_g = GaugeMetricFamily("raytron_jobs", "Jobs by state (the 1000 newest)", labels=["state"])
    for s, n in by_state.items():
        jobs_g.add_metric([s], n)
    families.append(jobs_g)
    families.append(GaugeMetricFamily("raytron_queue_length", "Jobs waiting for GPU slots",
                                      value=scheduler.queue_length()))
    it = GaugeMetricFamily("raytron_job_iteration", "Latest iteration", labels=["job_id", "name"])
    loss = GaugeMetricFamily("raytron_job_loss", "LM loss of the latest iteration", labels=["job_id", "name"])
    tps = GaugeMetricFamily("raytron_job_tokens_per_second", "Tokens/s of the latest iteration",
                            labels=["job_id", "name"])
    restarts = GaugeMetricFamily("raytron_job_restarts", "Restarts so far", labels=["job_id", "name"])
    shown = [r for r in rows if r["state"] not in TERMINAL_STATES and r["state"] != "QUEUED"] + \
        [r for r in rows if r["state"] in TERMINAL_STATES][:20]
    for r in shown:
        labels = [r["id"], r["name"]]
        it.add_metric(labels, r["iteration"])
        if r["loss"] is not None:  # the latest iteration's, kept on the job's row
            loss.add_metric(labels, r["loss"])
        if r["tokens_per_s"] is not None:
            tps.add_metric(labels, r["tokens_per_s"])
        restarts.add_metric(labels, job_restarts(store, r["id"]))
    families += [it, loss, tps, restarts]

    class _Collector:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")
