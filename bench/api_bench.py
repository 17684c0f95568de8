"""REST API throughput (run by hand): `python -m bench.api_bench [--clients 200] [--requests 10]`.

Starts `raytron serve` (a child process, SQLite in a temporary data dir, a 1x1 static cluster),
submits one long "blocker" job so that every later submission stays QUEUED (nothing else runs),
then measures

* ``GET /api/v1/jobs/{id}`` latency (p50, p99) and rate under ``--clients`` concurrent clients, each
  sending ``--requests`` requests one after the other (one asyncio process of clients, so the
  figures include the client's own cost on the same cores);
* the server's own CPU time per GET (user + system of its process over the GET phase), and the
  clients' (this process): the figures that hold when other work shares the cores, as the rate
  and latencies do not;
* submissions per second: ``--submissions`` ``POST /api/v1/jobs`` from 8 concurrent clients.

The server runs as ``raytron serve`` runs by default: one process (its scheduler and job cache
are one per data dir), uvicorn with uvloop and httptools when installed (``uvicorn[standard]``),
``--log-level warning`` (no access log line per request); ``--server-log-level info`` logs each.
At the end every job is cancelled and the server stopped. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx


from tests.helpers.server import Server, a_held_slot, tiny, wait_for  # noqa: E402


async def _get_latencies(url: str, token: str, job_id: str, clients: int, requests: int) -> tuple[list[float], float]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, limits=limits,
                                 timeout=120) as http:
        latencies: list[float] = []

        async def one_client():
            for _ in range(requests):
                t0 = time.perf_counter()
                r = await http.get(f"/jobs/{job_id}")
                latencies.append(time.perf_counter() - t0)
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return latencies, time.perf_counter() - t0


async def _raw_get_latencies(url: str, token: str, job_id: str, clients: int,
                            requests: int) -> tuple[list[float], float]:
    """As :func:`_get_latencies`, each client one keep-alive HTTP/1.1 connection written and read by
    hand (a wrk-like load generator: httpx spends ~5 ms of CPU per request, six times the server's,
    so on a 2-core machine it measures itself). Every answer must be a 200 with its whole body."""
    parsed = httpx.URL(url)
    request = (f"GET {parsed.raw_path.decode()}/jobs/{job_id} HTTP/1.1\r\nHost: {parsed.host}:{parsed.port}\r\n"
               f"Authorization: Bearer {token}\r\n\r\n").encode()
    latencies: list[float] = []

    async def one_client():
        reader, writer = await asyncio.open_connection(parsed.host, parsed.port)
        try:
            for _ in range(requests):
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = head.split(b" ", 2)[1]
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                if status != b"200":
                    raise RuntimeError(f"GET /jobs/{job_id} answered {status.decode()}")
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    return latencies, time.perf_counter() - t0


async def _submit(url: str, token: str, count: int, clients: int = 8) -> tuple[list[str], float]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as http:
        ids: list[str] = []
        todo = iter(range(count))

        async def one_client():
            for i in todo:
                r = await http.post("/jobs", json=tiny(f"bench-{i}", world=1, iters=1))
                r.raise_for_status()
                ids.append(r.json()["id"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return ids, time.perf_counter() - t0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--requests", type=int, default=10, help="GET requests per client")
    parser.add_argument("--submissions", type=int, default=200)
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw",
                        help="the GET clients: keep-alive connections written by hand (default), or httpx")
    parser.add_argument("--server-log-level", default="warning", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="raytron-bench-") as tmp:
        srv = Server(Path(tmp) / "data", simulate="1x1", extra_args=("--log-level", args.server_log_level)).start()
        url = f"{srv.url}/api/v1"
        try:
            # A job holds the slot (without its CPU): the submissions below stay queued.
            with a_held_slot(srv) as (blocker, runner), srv.client() as api:
                ids, submit_s = asyncio.run(_submit(url, srv.token, args.submissions))
                cpu0, client0 = cpu_s(srv.proc.pid), time.process_time()
                measure = _raw_get_latencies if args.client == "raw" else _get_latencies
                lat, get_s = asyncio.run(measure(url, srv.token, ids[0], args.clients, args.requests))
                server_cpu, client_cpu = cpu_s(srv.proc.pid) - cpu0, time.process_time() - client0
                os.killpg(runner, signal.SIGCONT)
                for job_id in ids + [blocker]:
                    api.post(f"/jobs/{job_id}/cancel")
                wait_for(api, blocker, ("CANCELLED",), timeout_s=60)
        finally:
            srv.stop()
            errors = [line for line in srv.log.read_text().splitlines() if "Error" in line or "Traceback" in line]
            if os.environ.get("RAYTRON_BENCH_LOG"):
                Path(os.environ["RAYTRON_BENCH_LOG"]).write_text(srv.log.read_text())
    if errors:
        print("server log errors:\n" + "\n".join(errors[:10]))
    result = {"get_p50_ms": 1000 * statistics.median(lat), "get_p99_ms": 1000 * pct(lat, 0.99),
              "get_per_s": len(lat) / get_s, "server_cpu_ms_per_get": 1000 * server_cpu / len(lat),
              "client_cpu_ms_per_get": 1000 * client_cpu / len(lat),
              "submissions_per_s": len(ids) / submit_s, "client": args.client, "load_average": os.getloadavg()[0]}
    print(f"{'measure':<44}{'value':>12}")
    print(f"{f'GET /jobs/{{id}} p50, {args.clients} clients':<44}{result['get_p50_ms']:>9.1f} ms")
    print(f"{f'GET /jobs/{{id}} p99, {args.clients} clients':<44}{result['get_p99_ms']:>9.1f} ms")
    print(f"{'GET /jobs/{id} requests/s':<44}{result['get_per_s']:>12.0f}")
    print(f"{'server CPU per GET':<44}{result['server_cpu_ms_per_get']:>9.2f} ms")
    print(f"{f'client CPU per GET ({args.client}, this process)':<44}{result['client_cpu_ms_per_get']:>9.2f} ms")
    print(f"{f'POST /jobs submissions/s ({len(ids)}, 8 clients)':<44}{result['submissions_per_s']:>12.1f}")
    print(f"(machine: {os.cpu_count()} CPUs, load average {result['load_average']:.1f} at the end; client and "
          f"server on the same machine)")
    return result


if __name__ == "__main__":
    main()
