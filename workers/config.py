"""The frozen configs a job runs from (model, parallel layout, training, checkpoints).

The pydantic ``JobSpec`` (``service/spec/spec.py``) is parsed at the edge and turned into these
by one function (``service.spec.spec.to_job_config``); nothing in ``workers/`` reads YAML, and no
setting comes from an environment variable (torchrun's rendezvous variables, read by
``workers.rank.main.torchrun_env``, say where a rank is, not how the job runs).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama/Mixtral-style decoder. Field names are Megatron-Core's."""

    num_layers: int = 4
    """Transformer layers (split over pp x vpp)."""
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int
    """Key/value heads (grouped-query attention); equal to heads for plain multi-head."""
    ffn_hidden_size: int
    vocab_size: int = 256
    seq_length: int = 64
    num_moe_experts: int | None = None
    """None: dense MLP in every layer; N: the MoE layers' MLP (see moe_layer_freq) is a mixture of N experts."""
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss weight (reported apart from the LM loss)."""
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    recompute_granularity: str | None = None
    """Activation recomputation (Megatron's): None, "full" (whole layers) or "selective"
    (the attention core only). See workers.parallel.recompute."""
    recompute_method: str | None = None
    """With "full": "uniform" (groups of recompute_num_layers layers) or "block" (the first
    recompute_num_layers layers of each pipeline model chunk)."""
    recompute_num_layers: int | None = None
    # Multi-latent attention (DeepSeek-V2/V3) and its YaRN rotary scaling: workers/model/mla.py, workers/model/yarn.py.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    """None: queries from one column-parallel projection (no low-rank compression)."""
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    """The per-head query/key dim without position embedding (DeepSeek's qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """The rotary part of each query/key head; its key is one head shared by all (qk_rope_head_dim)."""
    v_head_dim: int = 128
    rotary_scaling_factor: float = 1.0
    """YaRN's factor (1: plain RoPE); with mscale, mscale_all_dim, original_max_position_embeddings,
    beta_fast, beta_slow as DeepSeek-V3's rope_scaling."""
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # Attention variants (Qwen2 / Qwen3), Megatron-Core's names.
    add_qkv_bias: bool = False
    """A bias on the fused QKV projection (Qwen2); zeros at init, TP-sharded with the weight."""
    qk_layernorm: bool = False
    """RMSNorm over each head's q and k before RoPE (Qwen3), one [head_dim] weight each."""
    kv_channels: int | None = None
    """The head dimension; None = hidden_size / num_attention_heads (Qwen3 uses 128 at any width)."""
    untie_embeddings_and_output_weights: bool = True
    """False: the output layer uses the embedding's weight (with pp > 1 the last stage keeps a
    copy whose gradient is summed with the first stage's over the embedding group)."""
    # -- MoE routing as DeepSeek-V3 and Qwen3-MoE route (Megatron-Core's names; workers.parallel.router)
    moe_ffn_hidden_size: int | None = None
    """Each routed expert's ffn size; None: ffn_hidden_size (which stays the dense layers')."""
    moe_shared_expert_intermediate_size: int | None = None
    """Shared experts' total ffn size (a SwiGLU MLP every token passes, TP-sharded like the dense
    MLP, added to the routed output); None: no shared experts."""
    moe_router_score_function: str = "softmax"
    """softmax | sigmoid (DeepSeek-V3: sigmoid, the top-k scores normalised to sum 1)."""
    moe_router_pre_softmax: bool = False
    """softmax: the softmax over all experts before the top-k (Qwen3-MoE norm_topk_prob: false);
    False: a softmax over the k chosen logits (normalised: Mixtral, norm_topk_prob: true)."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiplies the gates (DeepSeek-V3's routed_scaling_factor)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: experts in this many equal groups ..."""
    moe_router_group_topk: int | None = None
    """... of which each token may use this many (ranked by the sum of their top topk/group_topk scores)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice only."""
    moe_router_bias_update_rate: float = 1e-3
    """After each step: bias += rate * sign(mean load - load), loads counted over the global batch."""
    moe_router_load_balancing_type: str = "aux_loss"
    """aux_loss (over each microbatch) | seq_aux_loss (per sequence, averaged) | none."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """N: layers 0, N, 2N, ... are MoE; a tuple: 1 (MoE) or 0 (dense) per layer."""
    # -- Multi-token prediction (DeepSeek-V3; workers/model/mtp.py)
    mtp_num_layers: int | None = None
    """None: no MTP; D: D chained MTP modules after the last layer, each predicting one token further."""
    mtp_loss_scaling_factor: float = 0.1
    """The MTP losses' weight: the objective adds factor / D * the sum of the D depths' losses."""

    def is_moe_layer(self, index: int) -> bool:
        """Whether global layer ``index`` has a mixture of experts (else the dense MLP)."""
        return self.is_moe and moe_layer_at(self.moe_layer_freq, index)

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_schedule: str | None = None
    """1f1b, interleaved, zb-h1 or zbv (workers.parallel.pipeline.SCHEDULES); None: interleaved when vpp > 1,
    else 1f1b."""
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    cp_comm_type: str = "p2p"
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    """With cp_comm_type a2a+p2p: (a2a size, p2p size), their product the CP size; the a2a groups are
    consecutive CP ranks (in a node), the ring runs across them."""
    order: str = "tp-cp-ep-dp-pp"


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    train_iters: int = 20
    global_batch_size: int = 16
    micro_batch_size: int = 2
    lr: float = 1e-3
    seed: int = 1234
    data: str | tuple[str, ...] = "builtin:tiny"
    """A corpus (builtin:tiny, a .npy/.bin token file, a Megatron prefix) or a blend as Megatron's
    --data-path: ("0.7", "a", "0.3", "b") or ("a", "b") (see workers.data.dataset)."""
    weight_decay: float = 0.0
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    """Exclusive with lr_warmup_iters: warmup = fraction x lr_decay_iters."""
    lr_decay_iters: int | None = None
    """None: train_iters."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine | inverse-square-root | WSD (workers.train.lr_schedule)."""
    lr_wsd_decay_style: str = "exponential"
    """WSD's annealing shape: exponential | linear | cosine | minus_sqrt."""
    lr_wsd_decay_iters: int | None = None
    """WSD: iterations of annealing at the end of the decay."""
    split: str = "969,30,1"
    """Train, validation, test shares of every corpus (Megatron's --split)."""
    eval_interval: int | None = None
    """Evaluate after every eval_interval iterations; None = never."""
    eval_iters: int = 10
    """Validation global batches per evaluation."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global grad L2 norm to this value (Megatron's --clip-grad); 0 = off."""
    bf16: bool = False
    """bf16 params and compute, fp32 main params and main grads."""
    fp16: bool = False
    """fp16 params and compute with a dynamic loss scaler (exclusive with bf16)."""
    initial_loss_scale: float = 2.0**32
    """fp16: the dynamic loss scaler's first scale (Megatron's --initial-loss-scale)."""
    main_grads_dtype: str = "fp32"
    """fp32 | fp64: the gradient buffers' dtype, accumulation and data-parallel reduction (Megatron's
    --main-grads-dtype); fp64 sums are exact in any order (workers.parallel.data), the norm, embedding and
    bias gradients are added in fp64 too (workers.parallel.wgrad) and the attention core runs in fp64,
    rounded once, so a CP split changes nothing. The step is fp32."""
    fp8: str | None = None
    """FP8 linears (workers.parallel.fp8): "e4m3" (every GEMM operand e4m3) or "hybrid" (e5m2 gradients)."""
    fp8_recipe: str = "delayed"
    """tensorwise | delayed | blockwise: how the FP8 scales are chosen."""
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    """delayed: the scale from the newest amax (most_recent) or the history's max (max)."""
    fp8_block_size: int = 128
    """blockwise: the tile (1 x B for activations and gradients, B x B for weights)."""
    fp8_gemm: str = "auto"
    """auto | scaled_mm | emulated: how the FP8 GEMMs run (workers.parallel.fp8_gemm); auto is scaled_mm
    on a CUDA device with FP8 tensor cores for tensorwise/delayed, emulated otherwise."""
    first_last_layers_bf16: bool = False
    """Keep the first num_layers_at_start_in_bf16 and last num_layers_at_end_in_bf16 layers out of FP8."""
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (the last rank that holds the loss writes)."""
    reset_position_ids: bool = False
    """Packed documents: RoPE positions restart at every document (workers.data.packing)."""
    reset_attention_mask: bool = False
    """Packed documents: attention and the loss never cross a document boundary."""
    eod_mask_loss: bool = False
    """No loss where the input token is the EOD token (eod_token_id)."""
    eod_token_id: int | None = None
    """The end-of-document token: a document starts after each (indexed datasets' boundaries count too)."""
    calculate_per_token_loss: bool = False
    """The loss is the mean over the global batch's loss tokens (Megatron's), whatever the layout."""
    # Chat / instruction fine-tuning data (workers/data/chat.py): replaces data, implies packed documents
    chat_data: str | None = None
    """A .jsonl/.json/.parquet/.arrow file or directory of chat records; None: pretraining on data."""
    chat_format: str = "messages"
    """messages (role/content turns, the tokenizer's chat template) | prompt_completion (plain text)."""
    chat_tokenizer: str | None = None
    """The tokenizer directory (default: model.from_hf's)."""
    chat_loss_on: str = "assistant"
    """Which tokens carry loss: assistant | last_assistant | all."""
    chat_overflow: str = "truncate"
    """A sample longer than seq_length + 1 tokens: truncate | drop | error."""
    chat_streaming: bool = False
    """Read chat_data as a stream, packed a buffer at a time (data larger than memory)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The spec's ``checkpoint`` section, plus what the controller picks per attempt."""

    save_interval: int | None = None
    """Save every save_interval iterations (all ranks at the same iteration); None = never."""
    dir: str | None = None
    """Where this job's checkpoints live (a path or a pyarrow URI); the caller fills the default."""
    keep_last: int = 2
    keep_best: int = 0
    """Besides the newest keep_last, the checkpoints with the lowest best_metric are never pruned."""
    best_metric: str = "val_loss"
    """val_loss (the evaluation at the checkpoint's iteration) or lm_loss (its training loss)."""
    async_save: bool = False
    save_hf: bool = False
    """Also write an HF model directory of every save_hf_interval-th checkpoint and of the last, under dir/hf/."""
    save_hf_interval: int = 1
    hf_tokenizer: str | None = None
    """A tokenizer directory whose files each HF copy also gets (default: the chat tokenizer or model.from_hf)."""
    save_format: str = "raytron"
    """megatron: each committed checkpoint is also written as a Megatron-Core torch_dist checkpoint under dir/megatron/."""
    load: str | None = None
    """A raytron checkpoint (dir or root), ``hf:DIR`` or ``megatron:DIR`` to start from when ``dir`` holds none."""
    resume_from: str | None = None
    """Set by the controller for one attempt: the checkpoint its ranks load (None: from the seed)."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    name: str
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    world_size: int
    num_nodes: int = 1
    gpus_per_node: int = 1
    max_restarts: int = 3
    """New attempts after rank failures before the job fails (fault_tolerance.max_restarts)."""
    max_preemptions: int = 10
    """Preemption and drain notices the job moves off before it fails (fault_tolerance.max_preemptions);
    they do not count as restarts."""
    sigterm_grace_s: float = 30.0
    """After a SIGTERM, how long a rank process has before it is killed (fault_tolerance.sigterm_grace_s)."""
    collective_timeout_s: float = 300.0
    """A peer silent this long inside a collective is a failure (fault_tolerance.collective_timeout_s)."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    min_nodes: int | None = None
    """Elastic floor (resources.min_nodes): dp may shrink down to what min_nodes hold; None = num_nodes."""
    spare_nodes: int = 0
    """Hot spare nodes held beside the job's, with idle rank actors (resources.spare_nodes; Ray launcher)."""
    node_grace_s: float = 60.0
    """How long a lost node may take to come back before the job shrinks (fault_tolerance.node_grace_s)."""
    relayout_spec: str | None = None
    """The job's spec as JSON when fault_tolerance.relayout_on_resize: what the cost model re-plans a
    resize from (service.control.relayout). None: a resize changes dp only."""
    memory_interval: int = 0
    """Every this many iterations each rank's state is copied to host memory and replicated off-node
    (fault_tolerance.memory_interval; 0: off)."""
    memory_replicas: int = 1
    """Replicas of each rank's in-memory state, each on another node (fault_tolerance.memory_replicas)."""
    memory_upto: int | None = None
    """Set by the controller for one attempt: the newest iteration it recorded, so the newest one an
    in-memory restore may go back to (None: any)."""


def moe_layer_at(moe_layer_freq: int | tuple[int, ...], index: int) -> bool:
    """Whether global layer ``index`` of an MoE model is MoE under ``moe_layer_freq`` (N: layers 0,
    N, 2N, ...; a tuple: 1 per MoE layer)."""
    return index % moe_layer_freq == 0 if isinstance(moe_layer_freq, int) else bool(moe_layer_freq[index])
