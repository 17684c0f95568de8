"""The layouts the parity suites run, shared by the suites that repeat them in another precision."""

from __future__ import annotations

MB2 = {"micro_batch_size": 2}


def light(parallel: dict, model: dict | None = None, training: dict | None = None) -> tuple[dict, dict]:
    """The model and training overrides a parity layout runs with (its own over these): as many
    layers as the pipeline has virtual stages, at least 2; 4 sequences an iteration, unless the
    layout sets its micro-batch size. On a 2-core box every collective of a 4-rank group costs
    about 4 ms of context switches (2026-12-07, 2-core CPU VM: an all-reduce of 1024 floats 5.3 ms
    at 4 ranks, 0.6 ms at 2), so a layout's time is its number of collectives: layers times
    microbatches times iterations."""
    stages = parallel.get("pipeline_model_parallel_size", 1) * (parallel.get("virtual_pipeline_model_parallel_size") or 1)
    model = {"num_layers": max(2, stages), **(model or {})}
    training = {**({} if "micro_batch_size" in (training or {}) else {"global_batch_size": 4}), **(training or {})}
    return model, training


DENSE_LAYOUTS = {
    # name: (world, parallel[, model overrides[, training overrides]])
    "tp2": (2, {"tensor_model_parallel_size": 2}),
    "tp2-sp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    # 4 query groups (one per TP rank): its own single-process reference.
    "tp4-sp": (4, {"tensor_model_parallel_size": 4, "sequence_parallel": True}, {"num_query_groups": 4}),
    # vocab 250 pads to 252 over tp4: the masked padding must not change the loss.
    "tp4-sp-padded-vocab": (4, {"tensor_model_parallel_size": 4, "sequence_parallel": True},
                            {"num_query_groups": 4, "vocab_size": 250}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "pp4": (4, {"pipeline_model_parallel_size": 4}),
    "dp2": (2, {}),
    "dp4-distopt": (4, {"use_distributed_optimizer": True}),
    "tp2-pp2": (4, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    "tp2-sp-dp2-distopt": (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                               "use_distributed_optimizer": True}),
    "pp2-dp2-distopt": (4, {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True}),
    # The params' all-gather under the next forward, waited for by each module of each model chunk.
    "pp2-vpp2-dp2-distopt-overlap": (4, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                                         "use_distributed_optimizer": True, "overlap_param_gather": True}),
    "tp2-pp2-vpp2-sp-order-pp-first": (4, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                           "virtual_pipeline_model_parallel_size": 2, "sequence_parallel": True,
                                           "order": "tp-pp-dp"}),
    "dp2-tp2-order-dp-first": (4, {"tensor_model_parallel_size": 2, "order": "dp-tp-pp"}),
    # micro_batch_size 2: two sequences per microbatch through every layer and the pipeline.
    "mb2-dp2": (2, {}, {}, MB2),
    "mb2-tp2-sp-pp2-vpp2": (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
                            {}, MB2),
}


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
    # All-to-all CP: heads split over cp (2 K/V heads split at cp2; repeated per query head at cp4 and
    # under tp2, where each TP rank has one).
    "cp2-a2a": (False, 2, {"context_parallel_size": 2, "cp_comm_type": "a2a"}),
    "cp4-a2a": (False, 4, {"context_parallel_size": 4, "cp_comm_type": "a2a"}),
    "cp2-a2a-tp2-sp": (False, 4, {"context_parallel_size": 2, "cp_comm_type": "a2a", "tensor_model_parallel_size": 2,
                                  "sequence_parallel": True}),
    "moe-cp2-a2a-ep2": (True, 4, {"context_parallel_size": 2, "cp_comm_type": "a2a",
                                  "expert_model_parallel_size": 2}),
    # Hierarchical CP: the all-to-all inside pairs of CP ranks, the ring across the pairs (each ring
    # member holds its pair's four scattered chunks).
    "cp4-a2a+p2p-2x2": (False, 4, {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
                                   "hierarchical_context_parallel_sizes": [2, 2]}),
    "moe-cp4-a2a+p2p-2x2-ep2": (True, 4, {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
                                          "hierarchical_context_parallel_sizes": [2, 2],
                                          "expert_model_parallel_size": 2}),
}


BF16 = {"bf16": True}


BF16_TOL = {"loss_rtol": 1e-2, "grad_rtol": 5e-2, "norm_rtol": 1e-2}
