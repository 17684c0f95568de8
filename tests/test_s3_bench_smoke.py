"""bench/s3_bench.py's smallest case: two ranks save and load a checkpoint of about 3 MB to local disk
and to moto's S3 server on 127.0.0.1, the ranks' writes overlap in time, and with ``async_save`` a
save blocks training no longer than its copy to host memory (no throughput is asserted; the figures
are in docs/fault-tolerance.md)."""

import pytest

pytestmark = pytest.mark.procs


def test_s3_bench_smallest_case(capsys):
    from bench import s3_bench

    rows = s3_bench.main(["--vocab", "1000", "--hidden", "64", "--layers", "1", "--timeout", "120"])
    assert [r["target"] for r in rows] == ["local disk", "S3 (moto, 127.0.0.1)"]
    for r in rows:
        assert r["mb"] > 1 and r["save_mb_s"] > 0 and r["load_mb_s"] > 0
        assert r["blocked_s"] <= r["snapshot_s"] + 0.5, r  # the save returned after the host copy
    assert rows[1]["blocked_s"] < rows[1]["async_write_s"], rows[1]  # the write was not training's
    assert len(rows[1]["parts"]) == 2  # one data object per rank
    assert "save MB/s" in capsys.readouterr().out
