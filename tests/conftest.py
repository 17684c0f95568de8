import os
import sys

import pytest
import torch

# The parity helpers live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

# Ranks run one intra-op thread each on these 2-core machines; the reference runs in this
# process, where a second OpenMP thread only spins against the rank processes.
torch.set_num_threads(1)

# Test tiers (``make test-fast`` runs what carries none of slow/procs/ray/gpu). Modules whose
# tests start rank processes are tiered here, in one place, rather than in each file.
_TIERS = {
    "slow": {"test_tensor_parallel", "test_data_parallel", "test_context_parallel", "test_expert_parallel",
             "test_model_parity", "test_model_parity_5d", "test_pipeline::test_executor_matches_single_process",
             "test_bench_smoke::test_tp2_measurement_runs",
             "test_bench_smoke::test_every_bucket_launches_during_backward_with_interleaving",
             "test_bench_smoke::test_sp_saves_half_the_layer_activations_at_tp2",
             "test_hf_interop", "test_checkpoint", "test_checkpoint_reshard"},
    "procs": {"test_spawn", "test_cli_run", "test_store::test_two_processes_write_one_database"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        for tier, names in _TIERS.items():
            if module in names or f"{module}::{item.originalname}" in names:
                item.add_marker(getattr(pytest.mark, tier))
