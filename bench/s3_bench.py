"""Checkpoint throughput to object storage and to local disk, side by side: every rank of a small
multi-rank job (tp RANKS, local processes on gloo) saves its shard with the real
:class:`~workers.checkpoint.checkpointer.Checkpointer`, synchronously and then with ``async_save``,
and loads the checkpoint back, once to a local directory and once to ``s3://`` on moto's standalone
S3 server on 127.0.0.1 (tests/helpers/s3_server.py).

Printed per target: MB/s of the save (all ranks' bytes over the slowest rank's wall time) and of
the load; whether the ranks' writes overlapped in time (parallel per rank); on S3, the parts of
each rank's data object (its ETag's ``-N``: a multipart upload); and with ``async_save`` how long
``save()`` blocked training against the copy to host memory (``snapshot_s``).

    python -m bench.s3_bench                      # about 400 MB, 2 ranks
    python -m bench.s3_bench --vocab 8000 --ranks 2   # smaller

moto keeps objects in the memory of one Python process: its figures are a floor for the code path,
not what a real object store gives.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def job(ranks: int, vocab: int, hidden: int, layers: int):
    from tests.helpers.parity import job_of, tiny_spec

    model = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": 8, "num_query_groups": 8,
             "ffn_hidden_size": 4 * hidden, "vocab_size": vocab, "seq_length": 16}
    return job_of(tiny_spec(world=ranks, parallel={"tensor_model_parallel_size": ranks}, model=model,
                            training={"global_batch_size": 2, "train_iters": 4, "eval_interval": 100}))


def rank_main(rank: int, world_size: int, job, uri: str, env: dict) -> dict:
    """One rank: a step (Adam's moments exist), a sync save, a load, an async save; its timings."""
    import torch.distributed as dist

    from workers.checkpoint.checkpointer import Checkpointer
    from workers.checkpoint.reader import load_checkpoint
    from workers.train.trainer import Trainer

    os.environ.update(env)
    trainer = Trainer(job, rank, world_size)
    trainer.train_step()
    out = {}
    ck = Checkpointer(uri, keep_last=1)
    dist.barrier()
    t0 = time.time()
    ck.save(trainer)  # returns once committed (a barrier)
    out["save"] = {"start": t0, "write": (t0 + ck.last_stats["snapshot_s"], t0 + ck.last_stats["write_s"]),
                   "end": time.time(), "bytes": ck.last_stats["bytes"]}
    dist.barrier()
    t0 = time.time()
    load_checkpoint(trainer, uri)
    out["load"] = {"start": t0, "end": time.time()}
    dist.barrier()
    trainer.train_step()
    background = Checkpointer(uri, keep_last=1, async_save=True)
    dist.barrier()
    t0 = time.perf_counter()
    background.save(trainer)
    blocked = time.perf_counter() - t0
    t1 = time.perf_counter()
    background.wait()
    out["async"] = {"blocked_s": blocked, "snapshot_s": background.last_stats["snapshot_s"],
                    "write_s": background.last_stats["write_s"], "waited_s": time.perf_counter() - t1}
    dist.barrier()
    return out


def parts(env: dict, bucket: str, prefix: str) -> dict[str, int]:
    """``{key: parts}`` of the ranks' data objects under ``prefix`` (1: a single PUT)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"])
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            if o["Key"].endswith(".bin"):
                etag = o["ETag"].strip('"')
                out[o["Key"]] = int(etag.split("-")[1]) if "-" in etag else 1
    return out


def measure(target: str, uri: str, env: dict, args) -> dict:
    from tests.helpers.ranks import run_ranks

    res = run_ranks(rank_main, args.ranks, args=(job(args.ranks, args.vocab, args.hidden, args.layers), uri, env),
                    timeout_s=args.timeout, collective_timeout_s=args.timeout)
    total = sum(r["save"]["bytes"] for r in res)
    save_s = max(r["save"]["end"] for r in res) - min(r["save"]["start"] for r in res)
    load_s = max(r["load"]["end"] for r in res) - min(r["load"]["start"] for r in res)
    writes = [r["save"]["write"] for r in res]
    overlap = max(0.0, min(w[1] for w in writes) - max(w[0] for w in writes))
    return {"target": target, "mb": total / 1e6, "save_mb_s": total / 1e6 / save_s, "load_mb_s": total / 1e6 / load_s,
            "save_s": save_s, "load_s": load_s, "writes_overlap_s": overlap,
            "blocked_s": max(r["async"]["blocked_s"] for r in res),
            "snapshot_s": max(r["async"]["snapshot_s"] for r in res),
            "async_write_s": max(r["async"]["write_s"] for r in res)}


def main(argv=None) -> list[dict]:
    from tests.helpers.s3_server import s3_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="raytron-s3-bench-") as tmp:
        rows.append(measure("local disk", str(Path(tmp) / "ckpt"), {}, args))
        with s3_server(Path(tmp) / "moto.log") as env:
            rows.append(measure("S3 (moto, 127.0.0.1)", "s3://raytron/bench", env, args))
            rows[-1]["parts"] = parts(env, "raytron", "bench/")
    print(f"{'target':<22}{'MB':>8}{'save MB/s':>11}{'load MB/s':>11}{'ranks overlap s':>17}"
          f"{'async: blocked s':>18}{'host copy s':>13}{'write s':>9}")
    for r in rows:
        print(f"{r['target']:<22}{r['mb']:>8.0f}{r['save_mb_s']:>11.0f}{r['load_mb_s']:>11.0f}"
              f"{r['writes_overlap_s']:>17.2f}{r['blocked_s']:>18.3f}{r['snapshot_s']:>13.3f}{r['async_write_s']:>9.2f}")
    for key, n in sorted(rows[-1].get("parts", {}).items()):
        print(f"  {key}: {n} part{'s' if n > 1 else ''}{' (multipart upload)' if n > 1 else ' (single PUT)'}")
    return rows


if __name__ == "__main__":
    main()
