"""The REST API against an outside fuzzer: `python -m bench.api_fuzz [--seconds 180] [--seed 1]`.

Starts `raytron serve --launcher processes --simulate 1x1 --max-stream-s 2` in a temporary data dir
and submits one long "blocker" job whose runner is stopped (SIGSTOP) once it holds the only GPU
slot, so that nothing the fuzzer submits ever runs: a generated spec may ask for a model no
machine here can hold, and every such job stays QUEUED. Followed streams end after 2 s (clients
resume them), so the fuzzer's requests all come back. Then runs

    schemathesis run URL/openapi.json --checks all --max-time SECONDS --seed SEED -H 'Authorization: Bearer ...'

(every phase: examples, coverage, fuzzing, stateful) with bench/schemathesis.toml (its one
exception says why), prints its report and returns its exit status: 0 when it found nothing. ``tests/api/rest/test_api_fuzz.py`` runs it for 60 s.

``--users``: two users, alice and bob (no quota, no priority cap, limits out of the fuzzer's way), are
added and schemathesis runs as them (a Web Fuzzing Commons auth file, ``[auth.wfc]`` with both as
``peers``) with ``--checks ignored_auth,object_level_authorization,not_a_server_error``: a request
without or with a wrong token must not pass, and one user's job must never be shown to the other.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from tests.helpers.server import Server, a_held_slot  # noqa: E402


def schemathesis_cmd() -> list[str]:
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if exe is None:
        raise SystemExit("schemathesis is not installed: pip install -e '.[test]'")
    return [exe]


def two_users(srv: Server, tmp: Path) -> str:
    """Add alice and bob on ``srv``; write the WFC auth file with their tokens and a schemathesis
    configuration naming them as peers (bench/schemathesis.toml's exception included); its path."""
    import json

    auth = []
    with srv.client() as admin:
        for name in ("alice", "bob"):
            r = admin.post("/users", json={"name": name, "max_priority": 10 ** 6})
            r.raise_for_status()
            auth.append({"name": name, "fixedHeaders": [{"name": "Authorization", "value": f"Bearer {r.json()['token']}"}]})
    (tmp / "users.json").write_text(json.dumps({"auth": auth}))
    config = tmp / "schemathesis-users.toml"
    config.write_text((ROOT / "bench" / "schemathesis.toml").read_text().replace(
        "[[operations]]", f'[auth.wfc]\npath = "{tmp / "users.json"}"\npeers = ["alice", "bob"]\n\n[[operations]]', 1))
    return str(config)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=180, help="schemathesis' --max-time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--users", action="store_true", help="fuzz as two users (object-level authorization)")
    args = parser.parse_args(argv)
    limits = ("--submit-burst", "1000000", "--max-queued-per-user", "1000000") if args.users else ()
    with tempfile.TemporaryDirectory(prefix="raytron-fuzz-") as tmp:
        srv = Server(Path(tmp) / "data", simulate="1x1", extra_args=("--max-stream-s", "2", *limits)).start()
        try:
            with a_held_slot(srv):
                config, auth = str(ROOT / "bench" / "schemathesis.toml"), ["-H", f"Authorization: Bearer {srv.token}"]
                checks = "all"
                if args.users:
                    config, auth = two_users(srv, Path(tmp)), []
                    checks = "ignored_auth,object_level_authorization,not_a_server_error"
                cmd = [*schemathesis_cmd(), "--config-file", config, "run", f"{srv.url}/openapi.json", "--checks", checks,
                       "--max-time", str(args.seconds), "--seed", str(args.seed), "--workers", str(args.workers),
                       "--request-timeout", "30", *auth, "--no-color"]
                env = {**os.environ, "NO_COLOR": "1"}
                p = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env,
                                   timeout=args.seconds * 3 + 120)
                output = p.stdout + p.stderr
                server_errors = [line for line in srv.log.read_text().splitlines() if "Traceback" in line]
        finally:
            srv.stop()
            srv.kill_runners()
    print(output)
    if server_errors:
        print(f"server log: {len(server_errors)} traceback(s)")
    return {"returncode": p.returncode, "output": output, "server_tracebacks": len(server_errors)}


if __name__ == "__main__":
    sys.exit(main()["returncode"])
