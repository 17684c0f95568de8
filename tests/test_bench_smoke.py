"""The benchmarks in bench/ import, run their smallest case and keep their derivations right.

No timings are asserted (the benchmarks are run by hand); this only stops the benchmark code
from rotting: the analytic minimum of ``bench/comm_bench.py`` must match hand-computed tiny
cases, and one real two-rank measurement must produce a finite ratio.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT_DIR as ROOT

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import comm_bench  # noqa: E402
from bench.comm_bench import Layout, all_reduce_bytes, analytic_bytes, layout_job, ratio  # noqa: E402
from tests.helpers.hf import MLA  # noqa: E402

# h 8, 2 heads of d 4, 2 kv groups, ffn 16, vocab 16, seq 4 (8 with cp 2), one layer, one sample.
TINY = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "num_query_groups": 2,
        "ffn_hidden_size": 16, "vocab_size": 16, "seq_length": 4}
ONE_SAMPLE = {"global_batch_size": 1, "micro_batch_size": 1}


def test_bench_modules_import():
    for name in ("bench.comm_bench", "bench.dp_vs_ddp", "bench.cp_memory", "bench.step_bench"):
        assert callable(importlib.import_module(name).main)


def test_ratio_and_ring_formula():
    assert all_reduce_bytes(1, 100) == 0 and all_reduce_bytes(2, 100) == 100 and all_reduce_bytes(4, 100) == 150
    assert ratio(105, 100) == pytest.approx(1.05)
    assert ratio(0, 0) == 1.0 and ratio(1, 0) == math.inf


def test_analytic_minimum_hand_computed():
    # tp2: one activation is s*b*h*4 = 4*1*8*4 = 128 B, a 2-rank all-reduce sends 128 B.
    # Layer: 4 all-reduces = 512; embedding 128; output-layer input grad 128; cross-entropy
    # 2 floats per token all-reduced: 2*4*4 = 32. One microbatch: 800 B; plus the grad norm
    # (one float64 over the world, 8 B), nothing else.
    job = layout_job(Layout("tp2", {"tensor_model_parallel_size": 2}), 2, model=TINY, training=ONE_SAMPLE)
    got = analytic_bytes(job, 0)
    assert got["tp"] == 800 and got["grad-norm"] == 8
    assert sum(got.values()) == 808

    # dp2 (two samples): dense params qkv 2*(1+2)*4*8 = 192, proj 8*8 = 64, mlp 3*16*8 = 384,
    # embedding + output 2*16*8 = 256, norms 8+8+8 = 24 -> 920 floats = 3680 B, one all-reduce
    # over 2 ranks sends 3680 B; the loss (float64) 8 B.
    job = layout_job(Layout("dp2", {}), 2, model=TINY, training={"global_batch_size": 2, "micro_batch_size": 1})
    got = analytic_bytes(job, 1)
    assert got["grads:dense"] == 3680 and got["loss:dp-cp"] == 8 and got["grad-norm"] == 8
    assert sum(got.values()) == 3696

    # cp2 ring, seq 8: K/V block = s_local 4 * b 1 * kv heads 2 * 2d 8 * 4 B = 256 B;
    # 3 (cp-1) blocks per layer per microbatch (forward K/V, backward K/V, dK/dV).
    job = layout_job(Layout("cp2", {"context_parallel_size": 2}), 2, model={**TINY, "seq_length": 8},
                     training=ONE_SAMPLE)
    assert analytic_bytes(job, 0)["cp"] == 3 * 256
    job = layout_job(Layout("cp2ag", {"context_parallel_size": 2, "cp_comm_type": "all_gather"}), 2,
                     model={**TINY, "seq_length": 8}, training=ONE_SAMPLE)
    assert analytic_bytes(job, 0)["cp"] == 2 * 256
    # cp2 all-to-all: per token q 2 heads + k, v 2 heads each + out 2 heads = 8 x d 4 floats; half of
    # the rank's 4 tokens leave it, each way: 2 x 2 x 8 x 4 x 4 B = 512 B.
    job = layout_job(Layout("cp2a2a", {"context_parallel_size": 2, "cp_comm_type": "a2a"}), 2,
                     model={**TINY, "seq_length": 8}, training=ONE_SAMPLE)
    assert analytic_bytes(job, 0)["cp"] == 512

    # pp2 + vpp2, 4 layers, 2 microbatches: 3 virtual-stage boundaries x 2 directions x 2 mb
    # = 12 sends of 128 B, 6 per rank; plus the loss shared along the pipeline (8 B).
    job = layout_job(Layout("pp2vpp2", {"pipeline_model_parallel_size": 2,
                                        "virtual_pipeline_model_parallel_size": 2}), 2,
                     model={**TINY, "num_layers": 4}, training={"global_batch_size": 2, "micro_batch_size": 1})
    assert analytic_bytes(job, 0)["pp"] == 6 * 128 and analytic_bytes(job, 1)["pp"] == 6 * 128


def test_mla_tensor_parallel_minimum_hand_computed():
    # tp2, one layer, seq 4, h 8 (A = 128 B), q_lora_rank 16, kv_lora_rank 12, rotary key 4 wide:
    # o_proj 128 + the up projections' input grads 4*16*4 = 256 and 4*12*4 = 192 + the rotary key's
    # grad 4*4*4 = 64, the MLP 2 x 128; embedding 128, output layer 128 + cross-entropy 32: 1184 B.
    # With SP each column-parallel layer re-gathers half its input: q_b 128, kv_b 96, gate_up 64,
    # the output layer 64: 1536 B.
    for sp, want in ((False, 1184), (True, 1536)):
        job = layout_job(Layout("tp2", {"tensor_model_parallel_size": 2, "sequence_parallel": sp}), 2,
                         model={**TINY, **MLA}, training=ONE_SAMPLE)
        assert analytic_bytes(job, 0)["tp"] == want, sp  # mutation: qkv's 128 (+64) counted for MLA

class _TpOfTwo:
    """A tensor-parallel group that answers only its size (2) and this rank's place in it (0)."""


@pytest.mark.parametrize("sp", [True, False])
@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_mla_gradient_rows_are_the_real_shard_s_parameters(monkeypatch, sp, q_lora_rank):
    """tp 2 x dp 2 with multi-latent attention: grads:dense and grads:sp are the parameters of
    TP rank 0's real model shard (workers.model built on a group of two), split by their
    sequence-parallel mark (the down projections and latent norms, whole on each TP rank, are
    marked with SP); without SP every parameter is a dense one."""
    import torch

    from workers.model.decoder import ModelChunk, ShardContext
    from workers.parallel import comm

    real_size, real_rank = comm.world_size, comm.rank
    monkeypatch.setattr(comm, "world_size", lambda g: 2 if isinstance(g, _TpOfTwo) else real_size(g))
    monkeypatch.setattr(comm, "rank", lambda g: 0 if isinstance(g, _TpOfTwo) else real_rank(g))
    model = {**TINY, **MLA, "num_layers": 2, "q_lora_rank": q_lora_rank}
    job = layout_job(Layout("tp2dp2", {"tensor_model_parallel_size": 2, "sequence_parallel": sp}), 4,
                     model=model, training={"global_batch_size": 2, "micro_batch_size": 1})
    chunk = ModelChunk(job.model, ShardContext(tp_group=_TpOfTwo(), sequence_parallel=sp, seed=1), [0, 1],
                       pre_process=True, post_process=True, positions=torch.arange(job.model.seq_length))
    marked = sum(p.numel() for p in chunk.parameters() if getattr(p, "sequence_parallel", False))
    others = sum(p.numel() for p in chunk.parameters()) - marked
    assert (marked > 0) == sp
    got = analytic_bytes(job, 0)
    assert got["grads:dense"] == all_reduce_bytes(2, others * 4)  # dp 2
    assert got["grads:sp"] == all_reduce_bytes(4, marked * 4)  # tp 2 x dp 2


@pytest.mark.slow
def test_tp2_measurement_runs():
    job, rows, results = comm_bench.run_layout(Layout("tp2", {"tensor_model_parallel_size": 2}), 2,
                                               model=TINY, training=ONE_SAMPLE)
    tp = next(r for r in rows if r.traffic == "tp")
    assert tp.minimum == 800
    assert math.isfinite(tp.ratio) and tp.ratio >= 1.0
    assert all(math.isfinite(r.ratio) for r in rows)


@pytest.mark.slow
def test_mla_tp2_sp_moves_the_minimum_and_the_cross_entropy_max():
    """Two real ranks, MLA at tp 2 with SP: the tp bytes are the minimum plus the cross-entropy's
    max all-reduce (one float per token, see bench/comm_minimum.py), to the byte."""
    model = {**TINY, **MLA, "seq_length": 8, "vocab_size": 256}  # the builtin data's byte tokens
    job, rows, _ = comm_bench.run_layout(Layout("mla-tp2", {"tensor_model_parallel_size": 2,
                                                            "sequence_parallel": True}), 2, model=model,
                                         training=ONE_SAMPLE)
    tp = next(r for r in rows if r.traffic == "tp")
    assert tp.measured == tp.minimum + all_reduce_bytes(2, 8 * 4), rows

@pytest.mark.slow
@pytest.mark.parametrize("world,parallel,minimum", [
    (2, {"context_parallel_size": 2, "cp_comm_type": "a2a"}, 512),
    # cp4 as 2x2, seq 8: the all-to-all in pairs, 2 x 1/2 x 2 tokens x (2+2+2+2 heads) x d 4 x 4 B = 256 B;
    # the ring across the pairs: 3 blocks of 2 x 2 tokens x 2 kv heads / 2 x 2 d x 4 B = 128 B each.
    (4, {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 2]},
     256 + 3 * 128),
    # Multi-latent attention, 4 heads, seq 1024 (s_local 256): K and V per head, q, k, v and the output
    # at one head dim max(8 + 4, 6) = 12; a2a at cp4: 2 x 3/4 x 256 x (4+4+4+4) x 12 x 4 B = 294,912 B.
    (4, {"context_parallel_size": 4, "cp_comm_type": "a2a"}, 294_912),
    # cp4 as 2x2: the pairs' all-to-all 2 x 1/2 x 256 x 16 x 12 x 4 = 196,608 B; the ring across the
    # pairs: 3 blocks of 256 tokens x 4 heads x 2 x 12 x 4 B = 98,304 B each.
    (4, {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 2]},
     196_608 + 3 * 98_304),
], ids=["a2a", "a2a+p2p", "mla-seq1024-a2a", "mla-seq1024-a2a+p2p"])
def test_a2a_context_parallelism_moves_exactly_the_minimum(request, world, parallel, minimum):
    model = {**TINY, "seq_length": 8, "vocab_size": 256}  # the builtin data's byte tokens
    if "mla" in request.node.callspec.id:
        model = {**model, **MLA, "num_attention_heads": 4, "seq_length": 1024}
    job, rows, results = comm_bench.run_layout(Layout("cp-a2a", parallel), world, model=model,
                                               training=ONE_SAMPLE)
    cp = next(r for r in rows if r.traffic == "cp")
    assert cp.minimum == minimum and cp.ratio == 1.0


@pytest.mark.slow
def test_sp_saves_half_the_layer_activations_at_tp2():
    from bench import sp_memory

    model = {**sp_memory.MODEL, "seq_length": 64, "hidden_size": 64, "ffn_hidden_size": 128}
    tp1, tp2 = sp_memory.measure(1, False, model), sp_memory.measure(2, True, model)
    # Every layer activation is sequence- or TP-sharded: Megatron's ideal 1/tp.
    assert tp2["layers"] / tp1["layers"] <= 0.52


@pytest.mark.slow
def test_every_bucket_launches_during_backward_with_interleaving():
    from bench import dp_overlap

    for r in dp_overlap.measure(2):
        # Megatron enables each chunk's grad sync on that chunk's last microbatch.
        assert r["launched"] == r["buckets"] > 1, r


@pytest.mark.slow
def test_cpu_calibration_measures_every_figure_the_cpu_cluster_stores():
    """bench/cpu_calibrate.py on 2 real ranks: the figures of service.spec.cost.CPU_FIGURES, each
    positive (no value is asserted: they are the machine's)."""
    from bench.cpu_calibrate import calibrate
    from service.spec.cluster_figures import CPU_FIGURES

    got = calibrate(ranks=2, repeats=1)
    assert set(CPU_FIGURES) - {"memory_gb"} <= set(got)
    assert got["peak_tflops"] > 0 and got["intra_gbps"] > 0 and got["memory_gbps"] > 0 and got["cores"] >= 1
    assert set(got["hop_latency_s"]) == {2} and got["hop_latency_s"][2] >= 0


def test_sft_packing_bench_runs_and_packs_fuller_than_padding(capsys):
    from bench import sft_packing_bench

    sft_packing_bench.main(["--seq", "64", "--samples", "24"])
    out = capsys.readouterr().out
    padded, packed = (float(next(line for line in out.splitlines() if line.startswith(k)).split()[2])
                      for k in ("padded", "packed"))
    assert packed > 0.8 and packed > 3 * padded


def test_every_runnable_benchmark_explains_itself_with_help():
    """A benchmark run by hand takes minutes; ``--help`` must answer instead of starting it, and a
    wrong flag must be refused (argparse: exit 2). Checked on the source: every module with a
    ``__main__`` entry builds an ArgumentParser; one of them, run in-process, answers ``--help``."""
    bench = Path(ROOT) / "bench"
    runnable = sorted(p.name for p in bench.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
    silent = [name for name in runnable if "ArgumentParser(" not in (bench / name).read_text()]
    assert len(runnable) > 20 and not silent, f"benchmarks without --help: {silent}"
    from bench import recovery_bench

    argv = sys.argv
    try:
        for flags, code in ((["--help"], 0), (["--kills", "0"], 2)):
            sys.argv = ["recovery_bench", *flags]
            with pytest.raises(SystemExit) as done:
                recovery_bench.main()
            assert done.value.code == code
    finally:
        sys.argv = argv
