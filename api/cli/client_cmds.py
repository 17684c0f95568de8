"""``raytron submit | status | logs | cancel | plan``: the CLI client of ``raytron serve``.

``add_parsers(sub)`` registers them on the CLI's sub-parsers. Bad input (an unreadable or invalid
spec, an unknown job) exits 2 with one line on stderr; a followed job that does not succeed exits
1; ``--json`` prints JSON instead of tables everywhere.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from api.cli.tables import print_job_plan, print_reported_placement
from service.control.events import JobState

TERMINAL = frozenset(s.value for s in JobState if s.is_terminal)


class BadInput(Exception):
    """Exit 2 with one line."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=None, help="the raytron server (default $RAYTRON_SERVER or "
                   "http://127.0.0.1:8000)")
    p.add_argument("--data-dir", default=None, help="where `raytron serve` keeps its token (default "
                   "$RAYTRON_DATA_DIR or ~/.raytron); RAYTRON_API_TOKEN wins")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def add_parsers(sub) -> None:
    p = sub.add_parser("submit", help="submit a job spec to the server", description="Submit a job (YAML/JSON "
                       "spec) to `raytron serve`; -f follows it to the end with a progress bar.")
    p.add_argument("spec", help="job spec file (YAML or JSON)")
    p.add_argument("-f", "--follow", action="store_true", help="follow the job until it ends")
    p.add_argument("--priority", type=int, default=None, help="queue priority (higher first; overrides the spec)")
    _common(p)
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser("status", help="list jobs, or show one", description="Without JOB: the jobs, newest first. "
                       "With JOB: its state, loss, attempts and placement; -f follows what happens from now on.")
    p.add_argument("job", nargs="?", help="job id")
    p.add_argument("-f", "--follow", action="store_true", help="follow the job until it ends")
    _common(p)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("logs", help="print a job's log", description="Print the log of a job (its runner and "
                       "ranks); -f streams it until the job ends.")
    p.add_argument("job", help="job id")
    p.add_argument("-f", "--follow", action="store_true", help="stream until the job ends")
    _common(p)
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("cancel", help="cancel a job", description="Cancel a queued or running job.")
    p.add_argument("job", help="job id")
    _common(p)
    p.set_defaults(func=cmd_cancel)
    p = sub.add_parser("plan", help="grid, placement, memory and traffic of a spec; runs nothing",
                       description="Plan a job spec: computed here, or by the server when --server is given.")
    p.add_argument("spec", help="job spec file (YAML or JSON)")
    p.add_argument("--auto", action="store_true", help="rank the layouts the cost model allows (parallel: auto); "
                   "computed here")
    from api.cli.plan_auto import add_trial_args

    add_trial_args(p, launcher=True)
    _common(p)
    p.set_defaults(func=cmd_plan)


def _command(fn):
    """Map the client's errors to exit codes and one line on stderr."""
    from api.cli.client import ApiClientError, ServerUnreachable

    @functools.wraps(fn)
    def run(args) -> int:
        name = fn.__name__.removeprefix("cmd_").replace("_", " ")
        try:
            return fn(args) or 0
        except BadInput as e:
            print(f"raytron {name}: error: {e}", file=sys.stderr)
            return 2
        except ApiClientError as e:
            print(f"raytron {name}: error: {e.code}: {e.message}", file=sys.stderr)
            return 2 if 400 <= e.status < 500 and e.status != 401 else 1
        except ServerUnreachable as e:
            print(f"raytron {name}: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return run


def load_spec_file(path: str) -> dict:
    """A spec file as :func:`service.spec.errors.read_spec_file` reads it for ``raytron run`` (YAML 1.2
    numbers: ``lr: 1e-3`` is a number), refused unless it is a mapping."""
    from service.spec.errors import read_spec_file

    try:
        data = read_spec_file(path)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if not isinstance(data, dict):
        raise BadInput(f"spec {path!r} must be a mapping of fields, got {type(data).__name__}")
    return data


def _client(args):
    from api.cli.client import RaytronClient

    return RaytronClient(args.server, data_dir=args.data_dir)


def _print_json(obj) -> None:
    print(json.dumps(obj, separators=(",", ":")))


def one_call(name: str, call, text):
    """A client command that makes one call: ``call(client, args)`` against the server, its answer
    printed as one JSON line (``--json``) or as ``text(answer)``; ``name`` as in ``raytron NAME``."""
    def run(args) -> int:
        with _client(args) as client:
            out = call(client, args)
        _print_json(out) if args.json else print(text(out))
        return 0

    run.__name__ = "cmd_" + name.replace(" ", "_")
    return _command(run)


def _job_line(j: dict) -> str:
    return f"{j['id']:<28}{j['state']:<11}{j['iteration']:>6}/{j['train_iters']:<7}{j['world_size']:>6}{j['priority']:>6}"


@_command
def cmd_submit(args) -> int:
    spec = load_spec_file(args.spec)
    if args.priority is not None:
        spec["priority"] = args.priority
    with _client(args) as client:
        job = client.submit(spec)
        if not args.follow:
            _print_json(job) if args.json else print(f"{job['id']} {job['state']}")
            return 0
        if not args.json:
            print(f"{job['id']} submitted: {client.server}/api/v1/jobs/{job['id']}", file=sys.stderr)
        return follow(client, job["id"], args.json)


@_command
def cmd_status(args) -> int:
    with _client(args) as client:
        if args.job is None:
            jobs = client.jobs()
            if args.json:
                _print_json(jobs)
            else:
                print(f"{'JOB':<28}{'STATE':<11}{'ITER':>6}{'':<8}{'RANKS':>6}{'PRIO':>6}")
                for j in jobs:
                    print(_job_line(j))
            return 0
        if args.follow:
            return follow(client, args.job, args.json, from_now=True)
        job = client.job(args.job)
        placement = client.placement(args.job)
        if args.json:
            _print_json({**job, "placement": placement["ranks"]})
            return 0
        first = client.metrics(args.job, names=["loss"], limit=1)["loss"] if job["loss"] is not None else []
        curve = f", loss {first[0]:.4f} -> {job['loss']:.4f}" if first and first[0] is not None else ""
        print(f"{job['id']}: {job['state']}, iteration {job['iteration']}/{job['train_iters']}, restarts "
              f"{job['restarts']}" + curve)
        if job.get("error"):
            print(f"error: {job['error'].get('message')}")
        if placement["ranks"]:
            print_reported_placement(placement["ranks"], sys.stdout)
        return 0


def follow(client, job_id: str, as_json: bool, *, from_now: bool = False) -> int:
    """Follow a job to its end: a progress bar with loss and tokens/s (or the events as JSON lines);
    0 when it succeeded, 1 otherwise. ``from_now``: only what happens after this call (the bar
    starts at the job's iteration; its history is not fetched again), else every event."""
    from tqdm import tqdm

    from api.cli.render import progress_postfix

    job = client.job(job_id)
    bar = None if as_json else tqdm(total=job["train_iters"], desc=job["name"], unit="it", file=sys.stderr,
                                    dynamic_ncols=True, initial=job["iteration"] if from_now else 0)
    state = job["state"]
    try:
        for event in client.follow_events(job_id, after=job["last_seq"] if from_now else 0):
            if as_json:
                _print_json(event)
            elif event["kind"] == "iteration":
                d = event["data"]
                bar.set_postfix(progress_postfix(d), refresh=False)
                bar.update(d.get("iteration", bar.n + 1) - bar.n)
            elif event["kind"] in ("state", "failure", "resize", "waiting", "runner", "layout", "restore"):
                bar.write(f"{job_id}: {event['state']} {event['message']}".rstrip(), file=sys.stderr)
            if event["kind"] == "state":
                state = event["state"]
    finally:
        if bar is not None:
            bar.close()
    if state not in TERMINAL:
        state = client.job(job_id)["state"]
    if not as_json:
        print(f"{job_id} {state}")
    return 0 if state == "SUCCEEDED" else 1


@_command
def cmd_logs(args) -> int:
    with _client(args) as client:
        if args.follow:
            for chunk in client.follow_logs(args.job):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        else:
            text = client.logs(args.job)
            _print_json({"job_id": args.job, "log": text}) if args.json else sys.stdout.write(text)
    return 0




@_command
def cmd_plan(args) -> int:
    from api.cli.plan_auto import trial_args_problem

    if problem := trial_args_problem(args, auto=args.auto, trial_launcher=True):
        raise BadInput(problem)
    spec = load_spec_file(args.spec)
    if getattr(args, "auto", False):
        from api.cli.plan_auto import run_auto

        return run_auto(spec, args, BadInput, _print_json)
    if args.server:
        with _client(args) as client:
            plan = client.plan(spec)
    else:
        from service.spec.plan import plan_job
        from service.spec.check import check_spec

        check = check_spec(spec)
        if check.problems:
            raise BadInput("invalid job spec: " + "; ".join(f"{p['field']}: {p['message']}" for p in check.problems))
        try:
            plan = plan_job(check.spec)
        except ValueError as e:
            raise BadInput(str(e)) from None
    _print_json(plan) if args.json else print_job_plan(plan)
    return 0



cmd_cancel = one_call("cancel", lambda client, args: client.cancel(args.job),
                      lambda job: f"{job['id']} {job['state']} (cancel requested)")

def main(argv: list[str] | None = None) -> int:
    """``python -m api.cli.client_cmds COMMAND ...`` (the same commands without the ``raytron`` CLI)."""
    parser = argparse.ArgumentParser(prog="raytron")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
