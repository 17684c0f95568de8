"""Layout invariance on packed, masked data (see parity.py): with Megatron's ``reset_position_ids``,
``reset_attention_mask``, ``eod_mask_loss`` and ``calculate_per_token_loss`` every layout gives the
single process's per-iteration loss (1e-6), iteration-0 gradients and grad norms (1e-5).

Documents end at every space of builtin:tiny (EOD 32: words, 1 to 15 tokens), so at seq 16 they
straddle sequence ends, CP chunks (4 tokens at cp2) and microbatches (two rows per microbatch, whose
documents differ, and uneven loss-token counts across microbatches and DP ranks). At seq 1024 the
documents are lines (EOD 10: tens to hundreds of tokens), over cp 4 as 2 x 2 all-to-all + ring.
"""

import pytest

from tests.helpers.hf import MLA
from tests.helpers.layouts import light
from tests.helpers.parity import check_layout, tiny_spec

pytestmark = pytest.mark.slow

MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}
PACKED = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True, "eod_token_id": 32,
          "calculate_per_token_loss": True, "micro_batch_size": 2}
# seq 1024: 4 sequences of lines; the validation split of builtin:tiny is shorter than a sequence.
LONG = {**PACKED, "eod_token_id": 10, "micro_batch_size": 1, "global_batch_size": 4, "eval_interval": None,
        "split": "100,0,0"}
LONG_MODEL = {"seq_length": 1024, "num_layers": 2}

LAYOUTS = {
    # name: (world, parallel[, model[, training]])
    "tp2-sp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "dp2-distopt": (2, {"use_distributed_optimizer": True}),
    # Zero-bubble schedules: the weight gradients deferred, and (zbv) the loss on stage 0.
    "pp2-zb-h1": (2, {"pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1"}),
    "pp2-zbv": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                    "pipeline_schedule": "zbv"}, None, {**PACKED, "global_batch_size": 8}),  # zbv: 2 x pp microbatches
    # Recomputation reruns the layers (full) or the attention core (selective) with the documents.
    "pp2-full-recompute": (2, {"pipeline_model_parallel_size": 2},
                           {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
    "cp2-p2p-selective-recompute": (2, {"context_parallel_size": 2}, {"recompute_granularity": "selective"}),
    "cp2-p2p": (2, {"context_parallel_size": 2}),
    "cp2-all-gather": (2, {"context_parallel_size": 2, "cp_comm_type": "all_gather"}),
    "moe-ep2": (2, {"expert_model_parallel_size": 2}, MOE),
    "moe-tp2-sp-cp2-pp2-ep2-8": (8, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                     "context_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                     "expert_model_parallel_size": 2}, MOE),
    "seq1024-cp4-a2a": (4, {"context_parallel_size": 4, "cp_comm_type": "a2a"}, LONG_MODEL, LONG),
    "seq1024-cp4-a2a+p2p-2x2": (4, {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
                                    "hierarchical_context_parallel_sizes": [2, 2]}, LONG_MODEL, LONG),
    "mla-seq1024-cp4-a2a": (4, {"context_parallel_size": 4, "cp_comm_type": "a2a"}, {**MLA, **LONG_MODEL}, LONG),
    "mla-seq1024-cp4-a2a+p2p-2x2": (4, {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
                                        "hierarchical_context_parallel_sizes": [2, 2]}, {**MLA, **LONG_MODEL}, LONG),
    "mla-cp2-all-gather-tp2-sp": (4, {"context_parallel_size": 2, "cp_comm_type": "all_gather",
                                      "tensor_model_parallel_size": 2, "sequence_parallel": True}, MLA),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_layout_matches_single_process(name):
    world, parallel, model, training = LAYOUTS[name] + (None, PACKED)[len(LAYOUTS[name]) - 2:]
    # 2 microbatches of 2 sequences an iteration (4 on the data-parallel ranks together).
    model, training = light(parallel, model, {"global_batch_size": 4, **training})
    spec = tiny_spec(world=world, parallel=parallel, model=model, training=training)
    check_layout(spec, model, training)
