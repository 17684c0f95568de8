"""``raytron serve``: the REST API under uvicorn, with the queue and the job runners.

``add_parser(sub)`` registers the sub-command on the CLI's sub-parsers; ``python -m api.cli.serve_cmd``
runs it alone. SIGTERM and SIGINT stop the server cleanly (uvicorn's handlers): the scheduler
stops, running jobs keep running, and a server started again with the same data dir re-attaches.

One uvicorn process, not several workers: the scheduler (the queue, admission, the runners it
watches) must be one per data dir, and the job views are cached in that process
(:mod:`api.rest.job_cache`); a second worker would run a second scheduler. uvicorn picks uvloop and
httptools when they are installed (``uvicorn[standard]``); a cached ``GET /jobs/{id}`` costs the
server about 0.3 ms of CPU (bench/api_bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Iterator

from api.cli.arg_types import FAULT_METAVAR, fault, simulate
from api.cli.data_dir import DEFAULT_DATA_DIR, data_dir_default
from service.ranks.launcher import LAUNCHERS


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {port}")
    return port


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    p.add_argument("--simulate", type=simulate, default=None, metavar="NODESxGPUS",
                   help="admit jobs against NODES nodes of GPUS slots each; with --launcher ray, start a simulated "
                        "Ray cluster of that shape on this machine")
    p.add_argument("--data-dir", default=None, help=f"logs, token, database (default $RAYTRON_DATA_DIR or "
                   f"{DEFAULT_DATA_DIR})")
    p.add_argument("--database-url", default=None, help="SQLAlchemy URL (default: SQLite in the data dir)")
    p.add_argument("--launcher", choices=LAUNCHERS, default=None,
                   help="where jobs' ranks run, as with raytron run: local processes (each job's runner a child "
                        "process of the server), or Ray actors (each job's runner a Ray Job) on the Ray cluster "
                        "(RAY_ADDRESS, a simulated one with --simulate, else an embedded one); default ray when "
                        "RAY_ADDRESS or --simulate is given, else processes")
    p.add_argument("--fault", type=fault, action="append", default=None, metavar=FAULT_METAVAR,
                   help="a failure drill applied to every job this server runs (for fault-tolerance drills; "
                        "repeatable; each fires once per job, in the first attempt that reaches that iteration), "
                        "as raytron run --fault; a job whose ranks do not include RANK runs without it")
    p.add_argument("--max-stream-s", type=float, default=None, metavar="SECONDS",
                   help="end a followed event or log stream after this long (clients resume with Last-Event-ID "
                        "or the log offset); default: it lasts until the job ends")
    # teams (README "Teams"): limits on users' submissions (admins are exempt from the first two)
    p.add_argument("--max-submits-per-minute", dest="submits_per_minute", type=_positive(float), default=60.0, metavar="N",
                   help="a user's submissions per minute past --submit-burst; beyond: 429 with Retry-After (default 60)")
    p.add_argument("--submit-burst", type=_positive(int), default=20, metavar="N", help="submissions a user may make at once "
                   "(default 20)")
    p.add_argument("--max-queued-per-user", type=_positive(int), default=100, metavar="N",
                   help="a user's QUEUED jobs at most; beyond: 429 (default 100)")
    p.add_argument("--max-user-priority", type=int, default=0, metavar="N",
                   help="the highest priority a user may give a job unless the admin set its own cap "
                        "(users add --max-priority); admins: no cap (default 0)")
    # experiment trackers for every job whose spec has no tracking section (a spec's own wins; {} opts out)
    p.add_argument("--tracking-mlflow-uri", default=None, metavar="URI",
                   help="log every job without a tracking section to this MLflow tracking server")
    p.add_argument("--tracking-mlflow-experiment", default=None, metavar="NAME",
                   help="the MLflow experiment of those jobs (default raytron)")
    p.add_argument("--tracking-wandb-project", default=None, metavar="PROJECT",
                   help="log every job without a tracking section to this Weights & Biases project")
    p.add_argument("--tracking-wandb-mode", default=None, choices=("online", "offline", "disabled"),
                   help="the W&B mode of those jobs (default online)")
    p.add_argument("--tracking-wandb-dir", default=None, metavar="DIR",
                   help="where those jobs' W&B run files go (default $WANDB_DIR, else the runner's directory)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run the REST API, the job queue and the job runners",
                       description="Serve the REST API (/api/v1, described at /docs) with a persistent job store "
                                   "and a gang queue. "
                                   "Every request but /healthz needs the token of RAYTRON_API_TOKEN or "
                                   "DATA_DIR/api_token (created on first start).")
    add_arguments(p)
    p.set_defaults(func=cmd_serve)
    return p


def default_cluster(simulate: tuple[int, int] | None):
    from service.ranks.ray_cluster import local_gpu_count
    from service.server.scheduler import StaticCluster

    if simulate is not None:
        return StaticCluster(*simulate)
    return StaticCluster(1, local_gpu_count() or os.cpu_count() or 1)


def launcher_kind(args) -> str:
    """Ray (runners as Ray Jobs, ranks as actors) when there is a cluster to use (RAY_ADDRESS, or the
    simulated cluster of ``--simulate``: the embedded default), else local processes."""
    return args.launcher or ("ray" if os.environ.get("RAY_ADDRESS") or args.simulate else "processes")


def default_tracking(args) -> dict | None:
    """The ``tracking`` section the ``--tracking-*`` flags make (None without them), checked as a spec's
    is; ValueError names the flag to fix."""
    from pydantic import ValidationError

    from service.spec.tracking import TrackingSpec

    mlflow = {k: v for k, v in (("tracking_uri", getattr(args, "tracking_mlflow_uri", None)),
                                ("experiment", getattr(args, "tracking_mlflow_experiment", None))) if v}
    wandb = {k: v for k, v in (("project", getattr(args, "tracking_wandb_project", None)),
                               ("mode", getattr(args, "tracking_wandb_mode", None)),
                               ("dir", getattr(args, "tracking_wandb_dir", None))) if v}
    section = {**({"mlflow": mlflow} if mlflow else {}), **({"wandb": wandb} if wandb else {})}
    if mlflow and "tracking_uri" not in mlflow:
        raise ValueError("--tracking-mlflow-experiment needs --tracking-mlflow-uri")
    if wandb and "project" not in wandb:
        raise ValueError("--tracking-wandb-mode/--tracking-wandb-dir need --tracking-wandb-project")
    try:
        TrackingSpec.model_validate(section)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"--tracking-{err['loc'][0] if err['loc'] else ''}: {err['msg']}") from None
    return section or None


def build_app(args, ray_session=None):
    """The app for parsed ``serve`` arguments (and the store, to close).

    Args:
        ray_session: the :class:`service.ranks.ray_cluster.RaySession` jobs run on, for ``--launcher ray``.
    """
    from api.rest.app import Settings, create_app
    from api.rest.auth import load_or_create_token
    from service.server.runners import LocalProcessRunners
    from service.server.store import JobStore, sqlite_url

    data_dir = Path(args.data_dir or data_dir_default()).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    database_url = args.database_url or sqlite_url(data_dir)
    tracking = default_tracking(args)
    store = JobStore(database_url)
    settings = Settings(data_dir=data_dir, api_token=load_or_create_token(data_dir),
                        max_stream_s=getattr(args, "max_stream_s", None), default_tracking=tracking,
                        **{k: getattr(args, k) for k in ("submits_per_minute", "submit_burst", "max_queued_per_user",
                                                         "max_user_priority") if hasattr(args, k)})
    faults = list(args.fault or [])  # drills for every job (--fault)
    if ray_session is None:
        runners = LocalProcessRunners(data_dir, database_url, faults=faults)
        cluster = default_cluster(args.simulate)
    else:
        from service.server.ray_jobs import RayClusterView, RayJobsRunners

        if not ray_session.dashboard_url:
            raise ValueError(f"the Ray cluster at {ray_session.address} has no dashboard, which Ray Jobs need; "
                             f"start it with the dashboard (ray[default]) or use --launcher processes")
        runners = RayJobsRunners(data_dir, database_url, store, ray_session.dashboard_url, faults=faults)
        cluster = RayClusterView(ray_session.address, ray_session.dashboard_url)
    return create_app(settings, store=store, runners=runners, cluster=cluster), store


@contextlib.contextmanager
def _signal_after_cleanup() -> Iterator[None]:
    """Let SIGTERM/SIGINT that stopped uvicorn end the process only after the ``with`` block's
    cleanup. uvicorn re-raises the signal once it has shut down, which would end the process at
    once, before the cluster the server started is stopped; here it is re-raised on the way out."""
    received: list[int] = []
    saved = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
             for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    for sig in received[-1:]:
        signal.raise_signal(sig)


def cmd_serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with _signal_after_cleanup():
        return _serve_on_cluster(args)


def _serve_on_cluster(args) -> int:
    if launcher_kind(args) == "processes":
        return _serve(args, None)
    from service.ranks.ray_cluster import ray_session

    # The cluster lives as long as the server when raytron starts it (--simulate, or embedded). A
    # simulated one is recorded in the data dir: a server killed and started again re-attaches to it.
    record = Path(args.data_dir or data_dir_default()).expanduser().resolve() / "ray_cluster.json"
    try:
        with ray_session(args.simulate, record=record) as session:
            for note in session.notes:
                print(f"raytron serve: {note}", file=sys.stderr, flush=True)
            print(f"raytron serve: Ray dashboard {session.dashboard_url or '(none)'}", file=sys.stderr, flush=True)
            return _serve(args, session)
    except ValueError as e:  # another server holds the data dir's simulated cluster
        print(f"raytron serve: error: {e}", file=sys.stderr)
        return 2


def _serve(args, session) -> int:
    import uvicorn

    try:
        app, store = build_app(args, session)
    except ValueError as e:  # a bad database URL, a newer schema, ...
        print(f"raytron serve: error: {e}", file=sys.stderr)
        return 2
    if args.fault:
        print(f"raytron serve: failure drills for every job: {' '.join(map(str, args.fault))}", file=sys.stderr)
    print(f"raytron serve: http://{args.host}:{args.port}/docs (token: RAYTRON_API_TOKEN or "
          f"{Path(args.data_dir or data_dir_default()).expanduser()}/api_token)", file=sys.stderr, flush=True)
    try:
        # keep-alive longer than uvicorn's 5 s: a client that reuses a connection just as the server
        # closes it gets a reset (seen under 200 concurrent clients)
        # (and a bounded graceful shutdown: an open event or log stream of a long job must not hold
        # SIGTERM up; the job itself keeps running)
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                      timeout_keep_alive=30, timeout_graceful_shutdown=5)).run()
    finally:
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raytron serve")
    add_arguments(parser)
    return cmd_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
