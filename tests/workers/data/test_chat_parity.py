"""Layout invariance on chat data (training.chat_data; see parity.py): conversations rendered with a
Llama-3 template, the loss on the assistant turns only, packed into rows whose documents straddle
CP chunks and whose loss tokens differ across microbatches and DP ranks, give the single process's
per-iteration loss (1e-6), iteration-0 gradients and grad norms (1e-5) at tp2 + SP, pp2, pp2 x vpp2, dp2
with the distributed optimizer, cp2 (ring and all-gather), ep2 and an 8-rank tp2 + SP x cp2 x pp2 x
ep2 MoE."""

import pytest

from tests.helpers.chat import CONVERSATIONS, chat_tokenizer, write_jsonl
from tests.helpers.layouts import light
from tests.helpers.parity import check_layout, tiny_spec

pytestmark = pytest.mark.slow

MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}
LAYOUTS = {
    # name: (world, parallel[, model])
    "tp2-sp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "dp2-distopt": (2, {"use_distributed_optimizer": True}),
    "cp2-p2p": (2, {"context_parallel_size": 2}),
    "cp2-all-gather": (2, {"context_parallel_size": 2, "cp_comm_type": "all_gather"}),
    "moe-ep2": (2, {"expert_model_parallel_size": 2}, MOE),
    "moe-tp2-sp-cp2-pp2-ep2-8": (8, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                     "context_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                     "expert_model_parallel_size": 2}, MOE),
}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tokenizer = chat_tokenizer(root / "tok", "llama3")
    longer = [{"role": "user", "content": "tell me a story about a cat"},
              {"role": "assistant", "content": "a cat sat on a mat. it is fine. thank you"}]
    records = [{"messages": c} for c in CONVERSATIONS + [longer]] * 12
    return {"chat_data": write_jsonl(root / "chat.jsonl", records), "chat_tokenizer": tokenizer,
            "eval_interval": None, "micro_batch_size": 2}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chat_layout_matches_single_process(name, chat):
    world, parallel, model = (LAYOUTS[name] + ({},))[:3]
    # 2 microbatches of 2 conversations an iteration (4 on the data-parallel ranks together).
    model, training = light(parallel, {**model, "vocab_size": 320, "seq_length": 32}, {"global_batch_size": 4, **chat})
    check_layout(tiny_spec(world=world, parallel=parallel, model=model, training=training), model, training)
