"""Layout invariance with context parallelism and MoE/expert parallelism (see parity.py).

Every MoE layout runs with ``moe_aux_loss_coeff: 0.01``: the load-balancing loss, its value and
its gradient, must not depend on how the tokens of a microbatch are sharded over TP and CP.
"""

import pytest

from tests.parity import check_layout, tiny_spec

pytestmark = pytest.mark.slow

MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}

LAYOUTS = {
    # name: (moe, world, parallel[, training overrides[, model overrides]])
    "cp2-p2p": (False, 2, {"context_parallel_size": 2}),
    "cp2-all-gather": (False, 2, {"context_parallel_size": 2, "cp_comm_type": "all_gather"}),
    "cp4": (False, 4, {"context_parallel_size": 4}),
    "cp2-tp2-sp": (False, 4, {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "cp2-pp2-distopt": (False, 4, {"context_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                   "use_distributed_optimizer": True}),
    "moe-dp2": (True, 2, {}),
    "moe-ep2": (True, 2, {"expert_model_parallel_size": 2}),
    "moe-ep4": (True, 4, {"expert_model_parallel_size": 4}),
    "moe-tp2-sp-ep2": (True, 4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                 "expert_model_parallel_size": 2}),
    "moe-tp2-sp-etp1-ep2-distopt": (True, 4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                              "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1,
                                              "use_distributed_optimizer": True}),
    "moe-pp2-ep2": (True, 4, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
    "moe-cp2-ep2": (True, 4, {"context_parallel_size": 2, "expert_model_parallel_size": 2}),
    "moe-mb2-cp2-ep2": (True, 4, {"context_parallel_size": 2, "expert_model_parallel_size": 2},
                        {"micro_batch_size": 2}),
    # A large coefficient: the aux loss and its gradient dominate, still layout-invariant.
    "moe-aux1-tp2-sp-cp2": (True, 4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                      "context_parallel_size": 2}, None, {"moe_aux_loss_coeff": 1.0}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name):
    moe, world, parallel, training, extra = (LAYOUTS[name] + (None, None))[:5]
    model = {**MOE, **(extra or {})} if moe else None
    spec = tiny_spec(moe=moe, world=world, parallel=parallel, training=training, model=extra)
    check_layout(spec, model, training)


def test_full_5d_moe_layout_16_ranks():
    """tp2 x cp2 x pp2 x dp2 with MoE over ep2: every dimension at once."""
    spec = tiny_spec(moe=True, world=16, parallel={
        "tensor_model_parallel_size": 2, "context_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 2, "sequence_parallel": True, "use_distributed_optimizer": True,
        "overlap_param_gather": True})
    spec["resources"] = {"num_nodes": 2, "gpus_per_node": 8}
    check_layout(spec, MOE)
