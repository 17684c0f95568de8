"""bench/gpu_suite.py: its FLOP formula is Megatron's, and every section runs (a tiny CPU version;
the figures come from a GPU machine, by hand)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers.paths import ROOT_DIR as ROOT
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench import gpu_suite  # noqa: E402
from service.spec.spec import parse_spec, to_job_config  # noqa: E402

pytestmark = pytest.mark.procs


def _model(**over):
    cfg = {**gpu_suite.BENCH, **over}
    return to_job_config(parse_spec(gpu_suite.model_spec(type("A", (), cfg)))).model


def test_megatron_flops_differ_from_palm_by_half_the_attention_scores():
    """Megatron counts the same GEMMs as 6 x matmul parameters (the logits included) and halves
    causal attention: 6 L h s per token below the PaLM convention's 12 L h s."""
    for over in ({}, {"seq": 4096}, {"query_groups": 16}, {"layers": 4, "vocab": 128256}):
        m = _model(**over)
        matmul_params, palm = gpu_suite.flops_per_token(m)
        megatron = gpu_suite.megatron_flops_per_token(m)
        assert megatron == pytest.approx(6 * matmul_params + 6 * m.num_layers * m.hidden_size * m.seq_length, rel=1e-12)
        assert palm - megatron == pytest.approx(6 * m.num_layers * m.hidden_size * m.seq_length, rel=1e-9)


def test_kernel_classes():
    assert gpu_suite.classify("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert gpu_suite.classify("flash_fwd_kernel") == "attention"
    assert gpu_suite.classify("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert gpu_suite.classify("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert gpu_suite.classify("aten::mm") == "gemm"


def test_every_section_runs_in_the_smoke_version(tmp_path):
    out = tmp_path / "suite.json"
    assert gpu_suite.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"steps", "sdpa_backend", "profile", "host_syncs", "ring_attention", "moe_gemm"} <= set(report)
    assert [r["mode"] for r in report["steps"]] == ["fp32", "bf16", "bf16+fp8", "bf16+fp8-emulated"]
    assert report["moe_gemm"]["max_rel_error"] < 1e-5  # the grouped GEMM computes what the loop does (up to GEMM order)
    assert report["profile"]["kernels"] > 0
