"""The sections of a job spec: parallel, training, checkpoint, resources, fault_tolerance, as strict
pydantic models with Megatron-Core's field names, and the training and resources sections' own
cross-field rules. The model section is :mod:`service.spec.model_section`;
:mod:`service.spec.spec` assembles them into the whole :class:`~service.spec.spec.JobSpec`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.data.blend import parse_split
from workers.data.dataset import data_form_problem
from workers.train.lr_schedule import LRSchedule

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""Unknown fields refused, no type coercion (``"2"`` is not 2), only finite numbers."""

AUTO = "auto"
"""The value of a field that ``raytron plan --auto`` / submission chooses (:mod:`service.spec.auto`)."""
Auto = Literal["auto"]
Size = Annotated[int, Field(ge=1)]


class ParallelSpec(BaseModel):
    """Any field but ``expert_tensor_parallel_size``, ``cp_comm_type`` and ``order`` may be ``auto``
    (and the whole section may be the string ``auto``): :mod:`service.spec.auto` chooses it."""

    model_config = STRICT
    tensor_model_parallel_size: Size | Auto = 1
    pipeline_model_parallel_size: Size | Auto = 1
    virtual_pipeline_model_parallel_size: Size | Auto | None = None
    pipeline_schedule: Literal["1f1b", "interleaved", "zb-h1", "zbv"] | None = Field(
        None, description="null: interleaved when virtual_pipeline_model_parallel_size > 1, else 1f1b (as before). "
        "zb-h1: zero-bubble H1 (backward split into input and weight gradient, the weight gradients fill the "
        "bubble; one chunk per stage). zbv: the V-shaped zero-bubble schedule (vpp 2, the chunks placed in a V, "
        "the loss on stage 0; needs num_microbatches >= 2 pp and untied embeddings)")
    context_parallel_size: Size | Auto = 1
    expert_model_parallel_size: Size | Auto = 1
    expert_tensor_parallel_size: int | None = Field(None, ge=1, description="default = tensor_model_parallel_size")
    sequence_parallel: bool | Auto = False
    use_distributed_optimizer: bool | Auto = False
    overlap_param_gather: bool = Field(False, description="with the distributed optimizer: the updated params' "
                                       "all-gather runs under the next forward, waited for layer by layer "
                                       "(one extra copy of the params in their dtype)")
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = Field(
        "p2p", description="context parallelism's attention: p2p (ring), all_gather (of K/V), a2a (all-to-all from "
        "sequence to head shards; heads per TP rank divisible by cp), a2a+p2p (a2a inside groups of consecutive CP "
        "ranks, the ring across them: hierarchical_context_parallel_sizes)")
    hierarchical_context_parallel_sizes: list[int] | None = Field(
        None, description="with cp_comm_type a2a+p2p: [a2a size, p2p size], product context_parallel_size")
    order: str = "tp-cp-ep-dp-pp"

    @model_validator(mode="before")
    @classmethod
    def _all_auto(cls, data):
        """``parallel: auto``: every field the search may choose is open."""
        if data == AUTO:
            return {name: AUTO for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                            "virtual_pipeline_model_parallel_size", "context_parallel_size",
                                            "expert_model_parallel_size", "sequence_parallel",
                                            "use_distributed_optimizer")}
        return data


class TrainingSpec(BaseModel):
    model_config = STRICT
    train_iters: int = Field(20, ge=1)
    global_batch_size: int = Field(16, ge=1)
    micro_batch_size: Size | Auto = Field(2, description="auto: chosen by the cost model")
    lr: float = Field(1e-3, gt=0)
    seed: int = 1234
    data: str | list[str | float] = Field(
        "builtin:tiny", description="builtin:tiny, a .npy/.bin token file, a Megatron PATH prefix (PATH.bin + "
        "PATH.idx), or a blend as Megatron's --data-path: ['0.7', 'a', '0.3', 'b']")
    weight_decay: float = Field(0.0, ge=0)
    min_lr: float = Field(0.0, ge=0, description="the LR floor after decay")
    lr_warmup_iters: int = Field(0, ge=0, description="linear warmup from 0 over this many iterations")
    lr_warmup_fraction: float | None = Field(None, ge=0, le=1,
                                             description="warmup as a fraction of lr_decay_iters; exclusive with lr_warmup_iters")
    lr_decay_iters: int | None = Field(None, ge=1, description="default train_iters")
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "constant"
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    lr_wsd_decay_iters: int | None = Field(None, ge=1, description="WSD: the annealing phase, at the end of decay")
    split: str = Field("969,30,1", description="train, validation, test shares (Megatron's --split)")
    eval_interval: int | None = Field(None, ge=1, description="evaluate every this many iterations; null = never")
    eval_iters: int = Field(10, ge=0, description="validation global batches per evaluation")
    clip_grad: float = Field(1.0, ge=0, description="clip the global grad L2 norm to this; 0 = off")
    bf16: bool = Field(False, description="bf16 compute, fp32 main params and grads")
    fp16: bool = Field(False, description="fp16 compute with a dynamic loss scaler")
    initial_loss_scale: float = Field(2.0**32, gt=0, description="fp16: the loss scaler's first scale")
    main_grads_dtype: Literal["fp32", "fp64"] = Field(
        "fp32", description="the gradient buffers' dtype (microbatch accumulation and the data-parallel reduction; "
        "the optimizer steps in fp32): fp64 makes the sums exact in any order (the norm, embedding and bias gradients "
        "added in fp64 too, and the attention core run in fp64 and rounded once, so context parallelism's split "
        "changes nothing), so every DP, PP and CP layout's weights equal the single process's bit for bit (FP8 needs "
        "it; 8 bytes per gradient element, twice the gradient traffic)")
    fp8: Literal["e4m3", "hybrid"] | None = Field(None, description="FP8 linears: e4m3 everywhere, or hybrid (e5m2 "
                                                  "gradients); null = off")
    fp8_recipe: Literal["tensorwise", "delayed", "blockwise"] = Field("delayed", description="FP8 scales: per tensor "
                                                                      "now, from an amax history, or per tile")
    fp8_amax_history_len: int = Field(1, ge=1, description="delayed: iterations of amax history")
    fp8_amax_compute_algo: Literal["most_recent", "max"] = Field("most_recent", description="delayed: the scale "
                                                                 "from the newest amax or the history's max")
    fp8_block_size: int = Field(128, ge=1, description="blockwise: the tile (1 x B activations, B x B weights)")
    fp8_gemm: Literal["auto", "scaled_mm", "emulated"] = Field("auto", description="FP8 GEMMs: torch._scaled_mm "
                                                                "on FP8 operands, or fp32 GEMMs on the dequantised "
                                                                "operands (emulated, CPU's default); auto: scaled_mm "
                                                                "on an FP8 GPU (H100+) with tensorwise/delayed")
    first_last_layers_bf16: bool = Field(False, description="FP8: keep the first and last layers in bf16")
    num_layers_at_start_in_bf16: int = Field(1, ge=0, description="with first_last_layers_bf16")
    num_layers_at_end_in_bf16: int = Field(1, ge=0, description="with first_last_layers_bf16")
    tensorboard_dir: str | None = Field(None, description="write TensorBoard scalars here")
    reset_position_ids: bool = Field(False, description="packed documents: RoPE positions restart at each document")
    reset_attention_mask: bool = Field(False, description="packed documents: attention and the loss never cross "
                                       "a document boundary (indexed-dataset boundaries and eod_token_id)")
    eod_mask_loss: bool = Field(False, description="no loss where the input token is eod_token_id")
    eod_token_id: int | None = Field(None, ge=0, description="the end-of-document token id; a document starts "
                                     "after each")
    calculate_per_token_loss: bool = Field(False, description="the loss is the mean over the global batch's loss "
                                           "tokens (Megatron's); required by reset_attention_mask and eod_mask_loss")
    chat_data: str | None = Field(None, min_length=1, description="fine-tune on chat/instruction records (a .jsonl, "
                                  ".json, .parquet or .arrow file or directory, or the prefix `raytron preprocess --format "
                                  "chat` wrote) instead of training.data: rendered with the tokenizer's chat "
                                  "template, packed, loss on chat_loss_on (docs/fine-tuning.md)")
    chat_format: Literal["messages", "prompt_completion"] = Field(
        "messages", description="messages: {messages: [{role, content}]}; prompt_completion: {prompt, completion} as "
        "plain text")
    chat_tokenizer: str | None = Field(None, min_length=1, description="tokenizer directory; default model.from_hf")
    chat_loss_on: Literal["assistant", "last_assistant", "all"] = Field(
        "assistant", description="the tokens that carry loss (each assistant turn with its end-of-turn token)")
    chat_overflow: Literal["truncate", "drop", "error"] = Field(
        "truncate", description="a sample longer than seq_length + 1 tokens")
    chat_streaming: bool = Field(False, description="read chat_data as a stream, packed 1024 samples at a time "
                                 "(data larger than memory; the spec check reads its first 1000 records)")


def training_problems(t: TrainingSpec) -> list[str]:
    """Problems of the data, split, LR-schedule and evaluation fields, each naming the fields and the fix."""
    out: list[str] = []
    if t.bf16 and t.fp16:
        out.append("training.bf16 and training.fp16 are both true; they are exclusive, set one")
    problem = data_form_problem(t.data)
    if problem:
        out.append(problem)
    try:
        shares = parse_split(t.split)
    except ValueError as e:
        out.append(str(e))
    else:
        if shares[0] == 0:
            out.append(f"training.split {t.split!r} gives training no data; give the first share a positive value")
        if t.eval_interval and t.eval_iters and shares[1] == 0:
            out.append(f"training.eval_interval {t.eval_interval} needs validation data but training.split "
                       f"{t.split!r} gives it no share; use a split such as '969,30,1' or eval_interval: null")
    try:
        LRSchedule.from_iters(
            lr=t.lr, min_lr=t.min_lr, train_iters=t.train_iters, global_batch_size=t.global_batch_size,
            lr_warmup_iters=t.lr_warmup_iters, lr_warmup_fraction=t.lr_warmup_fraction,
            lr_decay_iters=t.lr_decay_iters, lr_decay_style=t.lr_decay_style,
            lr_wsd_decay_iters=t.lr_wsd_decay_iters, lr_wsd_decay_style=t.lr_wsd_decay_style)
    except ValueError as e:
        out.append(f"training: {e}")
    return out


class CheckpointSpec(BaseModel):
    """Sharded, layout-independent checkpoints; a restarted or resized attempt loads the latest."""

    model_config = STRICT
    save_interval: int | None = Field(None, ge=1, description="save every this many iterations; null = never")
    dir: str | None = Field(None, min_length=1, description="default: under the service's data dir (raytron run: "
                            "./raytron-checkpoints/JOB_ID); a shared path or an s3:// gs:// file:// URI")
    keep_last: int = Field(2, ge=1, description="complete checkpoints kept (older ones are pruned)")
    keep_best: int = Field(0, ge=0, description="besides keep_last, the checkpoints with the lowest best_metric "
                           "are never pruned")
    best_metric: Literal["val_loss", "lm_loss"] = Field(
        "val_loss", description="what keep_best ranks by: val_loss (an evaluation at the checkpoint's iteration: "
        "training.eval_interval dividing save_interval) or lm_loss (the iteration's training loss)")
    async_save: bool = Field(False, description="overlap the write with training")
    save_hf: bool = Field(False, description="also write a Hugging Face model directory (config.json, "
                          "model.safetensors) of every save_hf_interval-th checkpoint and of the last one, under "
                          "DIR/hf/iter_N, in the background")
    save_hf_interval: int = Field(1, ge=1, description="with save_hf: every this many checkpoints (and the last)")
    hf_tokenizer: str | None = Field(None, min_length=1, description="with save_hf: a tokenizer directory whose "
                                     "files each copy also gets (default training.chat_tokenizer or model.from_hf)")
    save_format: Literal["raytron", "megatron"] = Field(
        "raytron", description="megatron: each committed checkpoint is also written as a Megatron-Core torch_dist "
        "checkpoint under DIR/megatron (a Megatron-LM --save root), in the background (dense models; raytron's own "
        "checkpoint is still what a restart resumes from)")
    load: str | None = Field(None, min_length=1, description="start from a raytron checkpoint (dir or root), "
                             "hf:DIR (a Hugging Face model directory) or megatron:DIR (a Megatron-Core torch_dist "
                             "checkpoint or Megatron-LM --save root; Adam's state too where it is fully_reshardable) when "
                             "checkpoint.dir holds none")


class ResourcesSpec(BaseModel):
    model_config = STRICT
    num_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(1, ge=1, description="world_size = num_nodes * gpus_per_node")
    min_nodes: int | None = Field(None, ge=1, description="elastic floor: dp may shrink down to what min_nodes "
                                  "hold; default num_nodes (no shrinking)")
    spare_nodes: int = Field(0, ge=0, le=64, description="hot spares: nodes held beside the job's with gpus_per_node "
                             "rank actors each, started and idle (Ray launcher), that take a lost node's ranks (or a "
                             "lost rank's node) at a restart instead of new actors; a spare taken is replaced in the "
                             "background when the cluster has room")
    # The cluster the cost model (raytron plan, parallel: auto) predicts for; see service/spec/cluster_figures.py.
    gpu_type: Literal["A100", "H100", "H200", "B200", "cpu"] | None = Field(
        None, description="an accelerator with known figures (memory, dense bf16 peak, NVLink, InfiniBand), or "
        "cpu: the simulated CPU cluster, ranks sharing one machine's cores (measured figures); exclusive with "
        "gpu_memory_gb and gpu_peak_tflops; default: cpu, unless gpu_peak_tflops is given")
    gpu_memory_gb: float | None = Field(None, gt=0, le=4096, description="memory per accelerator, GB (10^9 bytes)")
    gpu_peak_tflops: float | None = Field(None, gt=0, le=100000, description="dense peak TFLOP/s per accelerator "
                                          "in the training precision")
    intra_node_bandwidth_gbps: float | None = Field(
        None, gt=0, le=100000, description="GB/s (gigaBYTES per second) one rank sends to a peer in its node, "
        "one direction (H100 NVLink: 450)")
    inter_node_bandwidth_gbps: float | None = Field(
        None, gt=0, le=100000, description="GB/s (gigaBYTES per second) one rank sends across nodes, one "
        "direction (a 400 Gb/s NDR NIC per GPU: 50)")


def resources_problems(r: ResourcesSpec) -> list[str]:
    """The cluster-description rules: a known ``gpu_type`` fixes its memory and peak."""
    out = []
    if r.gpu_type is not None:
        for name in ("gpu_memory_gb", "gpu_peak_tflops"):
            if getattr(r, name) is not None:
                out.append(f"resources.{name} is given with resources.gpu_type {r.gpu_type}, which fixes it; "
                           f"drop one (give gpu_type for a known accelerator, or {name} without gpu_type)")
    if (r.intra_node_bandwidth_gbps is not None and r.inter_node_bandwidth_gbps is not None
            and r.inter_node_bandwidth_gbps > r.intra_node_bandwidth_gbps):
        out.append(f"resources.inter_node_bandwidth_gbps {r.inter_node_bandwidth_gbps:g} is above "
                   f"resources.intra_node_bandwidth_gbps {r.intra_node_bandwidth_gbps:g}; a link between nodes "
                   f"is not faster than one inside a node: check the units (both GB/s) or swap them")
    return out


class FaultToleranceSpec(BaseModel):
    model_config = STRICT
    max_restarts: int = Field(3, ge=0, description="new attempts after rank failures before the job fails")
    max_preemptions: int = Field(10, ge=0, description="preemption or drain notices of nodes holding ranks that the "
                                 "job saves a checkpoint for and moves off (not restarts) before the next one fails it")
    sigterm_grace_s: float = Field(30.0, gt=0, description="after a SIGTERM to a rank process (a preemption "
                                   "notice, like Kubernetes' terminationGracePeriodSeconds), how long the rank has "
                                   "before it is killed: the deadline the PREEMPTED event measures the save against")
    collective_timeout_s: float = Field(300.0, ge=5, description="a peer silent this long inside a collective "
                                        "is a failure")
    node_grace_s: float = Field(60.0, ge=0, description="how long a lost node may take to come back before the "
                                "job shrinks (with resources.min_nodes below num_nodes)")
    relayout_on_resize: bool = Field(False, description="when the job shrinks, let the cost model re-pick tp, pp, "
                                     "vpp, cp, ep and sp among the layouts of the nodes left, when it predicts a gain "
                                     "over changing dp alone (with resources.min_nodes below num_nodes)")
    memory_interval: int = Field(0, ge=0, description="every this many iterations each rank copies its complete "
                                 "state to host memory and sends a replica to a rank on another node; after a rank "
                                 "failure the job goes on from the newest iteration held in memory (0: off)")
    memory_replicas: int = Field(1, ge=1, description="replicas of each rank's in-memory state, each on another "
                                 "node (with memory_interval); the job needs more nodes than this")
