#!/usr/bin/env bash
# `make run`: the embedded default. Starts `raytron serve --simulate 2x4` (a local simulated Ray
# cluster of 2 nodes x 4 GPU slots, SQLite and a token file in a fresh data dir), submits
# examples/tiny-5d.yaml, follows it to the end with a progress bar, and stops what it started.
# The job runs as a Ray Job: the dashboard URL below shows it with its rank actors.
set -euo pipefail
cd "$(dirname "$0")/.."
RAYTRON=${RAYTRON:-.venv/bin/raytron}
SPEC=${1:-examples/tiny-5d.yaml}
DATA_DIR=$(mktemp -d "${TMPDIR:-/tmp}/raytron-run.XXXXXX")
PORT=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
SERVER="http://127.0.0.1:$PORT"

"$RAYTRON" serve --simulate 2x4 --port "$PORT" --data-dir "$DATA_DIR" --log-level warning &
SERVE_PID=$!
stop() {
    kill -TERM "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null || true
    rm -rf "$DATA_DIR"
}
trap stop EXIT INT TERM

for _ in $(seq 1 240); do  # the simulated cluster takes ~10-30 s to come up on 2 cores
    if .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)" \
        "$SERVER/healthz" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$SERVE_PID" 2>/dev/null; then echo "raytron serve exited early" >&2; exit 1; fi
    sleep 0.5
done
echo "raytron server $SERVER (API docs $SERVER/docs, token in $DATA_DIR/api_token)" >&2
"$RAYTRON" submit "$SPEC" -f --server "$SERVER" --data-dir "$DATA_DIR"
