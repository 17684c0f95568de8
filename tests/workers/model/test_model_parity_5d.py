"""Layout invariance with context parallelism and MoE/expert parallelism (see parity.py).

Every MoE layout runs with ``moe_aux_loss_coeff: 0.01``: the load-balancing loss, its value and
its gradient, must not depend on how the tokens of a microbatch are sharded over TP and CP.
"""

import pytest

from tests.helpers.parity import V3_MODEL, V3_TRAIN, check_layout, tiny_spec
from tests.helpers.layouts import LAYOUTS, light

pytestmark = pytest.mark.slow

MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}


# DeepSeek-V3-style routing (tests.helpers.parity.V3_MODEL: every MoE routing feature at once).
V3_LAYOUTS = {
    "v3-tp2-sp-ep2-etp2": (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                               "expert_model_parallel_size": 2}),
    "v3-tp2-sp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "v3-pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "v3-dp2-distopt": (2, {"use_distributed_optimizer": True}),
    "v3-cp2-ep2": (4, {"context_parallel_size": 2, "expert_model_parallel_size": 2}),
    # full recompute reruns the routers in backward: their loads must count once
    "v3-tp2-sp-recompute": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True},
                            {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}),
}


@pytest.mark.parametrize("name", list(V3_LAYOUTS))
def test_deepseek_v3_routing_layout_matches_single_process(name):
    world, parallel, recompute = (V3_LAYOUTS[name] + ({},))[:3]
    spec = tiny_spec(world=world, parallel=parallel, training=V3_TRAIN, model={**V3_MODEL, **recompute})
    per_rank = check_layout(spec, V3_MODEL, V3_TRAIN, grad_rtol=1e-6, norm_rtol=1e-6)
    # The biases moved (the check above compared them): each layer's, on some rank, is not all zero.
    moved = {name for r in per_rank for name, bias in r["expert_bias"].items() if bias.any()}
    assert moved == {f"layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name):
    moe, world, parallel, training, extra = (LAYOUTS[name] + (None, None))[:5]
    extra, training = light(parallel, extra, training)
    spec = tiny_spec(moe=moe, world=world, parallel=parallel, training=training, model=extra)
    check_layout(spec, {**(MOE if moe else {}), **extra}, training)


def test_full_5d_moe_layout_16_ranks():
    """tp2 x cp2 x pp2 x dp2 with MoE over ep2: every dimension at once."""
    parallel = {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "pipeline_model_parallel_size": 2,
                "expert_model_parallel_size": 2, "sequence_parallel": True, "use_distributed_optimizer": True,
                "overlap_param_gather": True}
    model, training = light(parallel)
    spec = tiny_spec(moe=True, world=16, parallel=parallel, model=model, training=training)
    spec["resources"] = {"num_nodes": 2, "gpus_per_node": 8}
    check_layout(spec, {**MOE, **model}, training)
