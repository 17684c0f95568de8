"""A Llama/Mixtral-style decoder built from the parallel layers.

RMSNorm, rotary embeddings, grouped-query attention (fused QKV, column-parallel, optionally
with a bias (Qwen2) and RMSNorm on each q and k head (Qwen3); output row-parallel) or DeepSeek's
multi-latent attention (:mod:`workers.model.mla`), SwiGLU MLP (gate/up column-parallel, down
row-parallel) or a Mixtral MoE, vocab-parallel embedding and output layer, untied or tied (see
:meth:`ModelChunk.tied_parameters`). Activations are ``[seq, batch, hidden]``;
with sequence parallelism the sequence is sharded over TP outside the TP regions, and with
context parallelism each CP rank holds its two load-balanced chunks of the sequence.

Every parameter is a pure function of (seed, name, full shape)
(:class:`workers.parallel.initializer.NormalInit`), of which each rank makes only its own
shard: every layout starts from the same model, and init costs O(shard) per rank. The vocabulary is padded to a multiple of tp with zero rows whose logits are masked
to -inf: the padding changes with tp but never the loss.

A pipeline stage builds only its own layers: :class:`ModelChunk` holds a contiguous run of
layers, plus the embedding on the first virtual stage and the final norm and output layer
on the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.config import ModelConfig
from workers.model.attention import PackedRotary, RMSNorm, rotary_tables
from workers.model.layer import DecoderLayer
from workers.model.mtp import MultiTokenPrediction
from workers.parallel import comm
from workers.parallel.context import cp_positions
from workers.parallel.fp8 import Fp8Recipe, attach_fp8
from workers.parallel.initializer import Cat, NormalInit, Zeros
from workers.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from workers.parallel.recompute import run_layers
from workers.model.yarn import mla_rotary_tables


@dataclass(frozen=True)
class ShardContext:
    """What a rank's model shard needs to know about its layout."""

    tp_group: object = None
    cp_group: object = None
    tp_cp_group: object = None
    cp_ranks: tuple[int, ...] | None = None
    hcp_groups: tuple | None = None
    """Hierarchical CP (cp_comm_type a2a+p2p): (a2a group, p2p group, the p2p ring's global ranks)."""
    ep_group: object = None
    etp_group: object = None
    sequence_parallel: bool = False
    cp_comm_type: str = "p2p"
    seed: int = 1234
    fp8: Fp8Recipe | None = None
    """training.fp8: the decoder layers' linears run in FP8 (workers.parallel.fp8)."""
    attention_dtype: torch.dtype | None = None
    """The attention core's dtype where wider than the compute dtype: float64 under
    ``main_grads_dtype: fp64`` (:func:`workers.parallel.context.context_parallel_attention`)."""

    @property
    def tp_size(self) -> int:
        return comm.world_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        return comm.rank(self.tp_group)

    @property
    def cp_size(self) -> int:
        return comm.world_size(self.cp_group)

    @property
    def token_group(self):
        """The ranks whose tokens together make one microbatch: TP x CP with SP, else CP."""
        return self.tp_cp_group if self.sequence_parallel and self.tp_size > 1 else self.cp_group


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class ModelChunk(nn.Module):
    """A contiguous run of decoder layers (one pipeline virtual stage).

    Args:
        cfg: the model.
        ctx: the rank's groups and settings.
        layer_ids: global indices of this chunk's layers.
        pre_process: holds the embedding (first virtual stage): input is tokens ``[s, b]``.
        post_process: holds the final norm and output layer (last virtual stage): output is
            vocab-parallel logits ``[s, b, padded_vocab / tp]`` with padding masked.
    """

    def __init__(self, cfg: ModelConfig, ctx: ShardContext, layer_ids: list[int], *, pre_process: bool,
                 post_process: bool, positions: torch.Tensor):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.pre_process, self.post_process = pre_process, post_process
        self.register_buffer("rotary", self.rotary_of(positions), persistent=False)
        vocab = padded_vocab(cfg.vocab_size, ctx.tp_size)
        if pre_process:
            emb = _padded_table(ctx.seed, "embedding", cfg, vocab)
            self.embedding = VocabParallelEmbedding(emb, ctx.tp_group, sequence_parallel=ctx.sequence_parallel)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ctx, i) for i in layer_ids)
        self.mtp = MultiTokenPrediction(cfg, ctx, DecoderLayer) if post_process and cfg.mtp_num_layers else None
        attach_fp8(self.layers, ctx.fp8, ctx.tp_cp_group, cfg.num_layers, (ColumnParallelLinear, RowParallelLinear))
        # The RoPE tables now, so they count as buffers from the start (MLA rotates without them).
        for layer in self.all_layers() if not cfg.multi_latent_attention else ():
            layer.attention._rope_tables(self.rotary, cfg.num_attention_heads // cfg.num_query_groups + 2)
        if post_process:
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, ctx.sequence_parallel)
            out = _padded_table(ctx.seed, "embedding" if cfg.tied_embeddings else "output", cfg, vocab)
            self.output = ColumnParallelLinear(out, ctx.tp_group, sequence_parallel=ctx.sequence_parallel)
            if cfg.tied_embeddings:
                if pre_process:  # one stage: the output layer uses the embedding's parameter itself
                    self.output.weight = self.embedding.weight
                    # Two uses in one backward: a fused weight gradient's dummy must be zeros
                    # (Megatron's zero_out_wgrad, see workers.parallel.wgrad).
                    self.output.weight.zero_out_wgrad = True
                else:  # the last stage's copy (Megatron's): equal at init, grads summed with stage 0's
                    self.output.weight.tied_copy = True
            if self.mtp is not None and not pre_process:
                # MTP embeds tokens on the last stage: a copy of the first stage's embedding
                # (the tied output layer itself when tied), grads summed over the embedding group.
                self.embedding = VocabParallelEmbedding(_padded_table(ctx.seed, "embedding", cfg, vocab),
                                                        ctx.tp_group, sequence_parallel=ctx.sequence_parallel)
                if cfg.tied_embeddings:
                    self.embedding.weight = self.output.weight
                    self.output.weight.zero_out_wgrad = True  # fused output GEMM + embedding lookup
                self.embedding.weight.tied_copy = True
            per = vocab // ctx.tp_size
            start = ctx.tp_rank * per
            pad = torch.arange(start, start + per) >= cfg.vocab_size
            self.register_buffer("vocab_pad_mask", pad, persistent=False)
            self.has_vocab_pad = bool(pad.any())  # known at build time: no per-step check

    def rotary_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The rotary tables of ``positions`` (``[s]``, or per token ``[s, b]``)."""
        cfg = self.cfg
        return (mla_rotary_tables(positions, cfg) if cfg.multi_latent_attention
                else rotary_tables(positions, cfg.head_dim, cfg.rotary_base))

    def forward(self, x: torch.Tensor, packing: tuple | None = None):
        """Run the chunk on ``x`` (tokens ``[s, b]`` on the first stage, else activations); the last
        virtual stage returns the vocab-parallel logits (with MTP: ``(logits, last hidden state)``,
        for :meth:`mtp_losses`).

        ``packing``: ``(position_ids [s, b], docs)`` of a packed microbatch (this rank's position
        ids, each row's ``cu_seqlens`` over the whole sequence, :mod:`workers.data.packing`): RoPE
        sees each document from 0 and attention stays inside documents. None: one causal sequence
        per row at the chunk's own positions.
        """
        rotary = self.rotary
        if packing is not None:
            positions, docs = packing
            rotary = PackedRotary(self.rotary_of(positions).to(self.rotary.dtype), docs)
        if self.pre_process:
            x = self.embedding(x)
        x = run_layers(self.layers, x, rotary, self.cfg)
        if self.post_process:
            logits = self.head(self.final_norm(x))
            return (logits, x) if self.mtp is not None else logits
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer on normed hidden states: vocab-parallel logits, padding masked."""
        logits = self.output(x)
        return logits.masked_fill(self.vocab_pad_mask, float("-inf")) if self.has_vocab_pad else logits

    def mtp_losses(self, hidden: torch.Tensor, targets) -> torch.Tensor:
        """Per-depth sums of the MTP token losses ``[D]`` (:mod:`workers.model.mtp`) on the last
        hidden state the forward returned, with the shared embedding and output layer."""
        return self.mtp(hidden, targets, self.rotary, self.embedding, self.head)

    def all_layers(self) -> list[DecoderLayer]:
        """The decoder layers and the MTP modules' layers (MoE aux losses, biases, RoPE tables)."""
        return list(self.layers) + ([m.layer for m in self.mtp.layers] if self.mtp is not None else [])

    def logical_parameters(self):
        """Yield ``(full name, param, shards)`` for every parameter of this chunk.

        The full name uses the global layer index (``layers.5.attention.qkv.weight``), the
        same on every layout. ``shards`` says which part of the full tensor ``param`` is: a
        tuple of ``(dim, index, count)``, i.e. the ``index``-th of ``count`` equal slices of
        ``dim`` (empty for a replicated param). The vocab-parallel tables include the vocab
        padding rows; ``mlp.gate_up`` is laid out ``[gate_r; up_r]`` per TP rank.
        """
        # (rank, size) in each group a parameter may be sliced over
        tp_slice = (self.ctx.tp_rank, self.ctx.tp_size)
        ep_slice = (comm.rank(self.ctx.ep_group), comm.world_size(self.ctx.ep_group))
        etp_slice = (comm.rank(self.ctx.etp_group), comm.world_size(self.ctx.etp_group))
        for name, p in self.named_parameters():
            if name == "output.weight" and self.cfg.tied_embeddings:
                name = "embedding.weight"  # the last stage's copy: the same logical tensor
            if name.startswith("layers."):
                _, local, rest = name.split(".", 2)
                name = f"layers.{self.layers[int(local)].index}.{rest}"
            shards = []
            if getattr(p, "tensor_model_parallel", False) and tp_slice[1] > 1:
                shards.append((p.partition_dim, *tp_slice))
            if getattr(p, "is_expert", False):
                shards += [(dim, *where) for dim, where in ((p.ep_partition_dim, ep_slice),
                                                            (p.etp_partition_dim, etp_slice)) if where[1] > 1]
            yield name, p, tuple(shards)

    def tied_parameters(self) -> list[nn.Parameter]:
        """With tied embeddings or MTP over several stages: this chunk's embedding or its copy
        on the last stage, whose gradient is summed over the embedding group (first and last stage)."""
        if not (self.cfg.tied_embeddings or self.cfg.mtp_num_layers) or self.pre_process == self.post_process:
            return []
        return [self.embedding.weight if self.pre_process or not self.cfg.tied_embeddings else self.output.weight]

    def pop_aux_loss(self) -> float:
        """Sum of this chunk's MoE aux losses over layers and microbatches since the last call."""
        total = 0.0
        for layer in self.all_layers():
            if layer.aux_loss_sum is not None:
                total += float(layer.aux_loss_sum)
                layer.aux_loss_sum = None
        return total


def _padded_table(seed: int, name: str, cfg: ModelConfig, padded: int) -> Cat:
    """A vocab table ``[padded, hidden]``: the real rows, then zero rows up to a multiple of tp."""
    rows = NormalInit(seed, name, (cfg.vocab_size, cfg.hidden_size), cfg.init_method_std)
    return Cat([rows] + ([Zeros((padded - cfg.vocab_size, cfg.hidden_size))] if padded > cfg.vocab_size else []))


def local_positions(cfg: ModelConfig, ctx: ShardContext, cp_rank: int) -> torch.Tensor:
    """Global positions of this CP rank's tokens (its two load-balanced chunks)."""
    if ctx.cp_size == 1:
        return torch.arange(cfg.seq_length)
    return cp_positions(cfg.seq_length, ctx.cp_size, cp_rank)
