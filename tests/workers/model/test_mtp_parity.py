"""Layout invariance of multi-token prediction (workers/model/mtp.py; see parity.py): with
``mtp_num_layers`` the LM and MTP losses (1e-6), the iteration-0 gradients of every parameter, the
MTP modules' included (1e-5), and the grad norms equal the single process's, with bit-equal
replicas, at tp2 + SP, pp2 (the last stage's copy of the embedding, untied and tied), cp2, dp2
with the distributed optimizer and ep2 on a DeepSeek-V3-style MoE with MLA (the MTP layer an MoE
layer, with its expert bias)."""

import pytest

from tests.helpers.hf import MLA
from tests.helpers.parity import V3_MODEL, V3_TRAIN, check_layout, tiny_spec

pytestmark = pytest.mark.slow

MTP = {"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3}
MTP2_TIED = {"mtp_num_layers": 2, "untie_embeddings_and_output_weights": False}
V3_MTP = {**MLA, **V3_MODEL, **MTP}

LAYOUTS = {
    # name: (world, parallel, model[, training])
    "tp2-sp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, MTP),
    "pp2-tied-depth2": (2, {"pipeline_model_parallel_size": 2}, MTP2_TIED),
    "cp2": (2, {"context_parallel_size": 2}, MTP),
    "pp2-dp2-distopt": (4, {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True}, MTP),
    "v3-mla-ep2": (2, {"expert_model_parallel_size": 2}, V3_MTP, V3_TRAIN),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mtp_layout_matches_single_process(name):
    world, parallel, model, training = (LAYOUTS[name] + (None,))[:4]
    per_rank = check_layout(tiny_spec(world=world, parallel=parallel, model=model, training=training), model,
                            training)
    assert per_rank[0]["metrics"][0]["mtp_loss"] > 0
