"""The REST API against an outside fuzzer: `python bench/api_fuzz.py [--seconds 180] [--seed 1]`.

Starts `raytron serve --launcher processes --simulate 1x1 --max-stream-s 2` in a temporary data dir
and submits one long "blocker" job whose runner is stopped (SIGSTOP) once it holds the only GPU
slot, so that nothing the fuzzer submits ever runs: a generated spec may ask for a model no
machine here can hold, and every such job stays QUEUED. Followed streams end after 2 s (clients
resume them), so the fuzzer's requests all come back. Then runs

    schemathesis run URL/openapi.json --checks all --max-time SECONDS --seed SEED -H 'Authorization: Bearer ...'

(every phase: examples, coverage, fuzzing, stateful) with bench/schemathesis.toml (its one
exception says why), prints its report and returns its exit status: 0 when it found nothing. ``tests/test_api_fuzz.py`` runs it for 60 s.
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
sys.path.insert(0, str(ROOT))

from tests.test_api import Server, a_held_slot  # noqa: E402


def schemathesis_cmd() -> list[str]:
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if exe is None:
        raise SystemExit("schemathesis is not installed: pip install -e '.[test]'")
    return [exe]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=180, help="schemathesis' --max-time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="raytron-fuzz-") as tmp:
        srv = Server(Path(tmp) / "data", simulate="1x1", extra_args=("--max-stream-s", "2")).start()
        try:
            with a_held_slot(srv):
                cmd = [*schemathesis_cmd(), "--config-file", str(ROOT / "bench" / "schemathesis.toml"), "run", f"{srv.url}/openapi.json", "--checks", "all",
                       "--max-time", str(args.seconds), "--seed", str(args.seed), "--workers", str(args.workers),
                       "--request-timeout", "30", "-H", f"Authorization: Bearer {srv.token}", "--no-color"]
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
