"""One transformer layer of the decoder (:mod:`workers.model.decoder`): the input norm, attention
(grouped-query or multi-latent), the post-attention norm and a SwiGLU MLP or a mixture of
experts, whose load-balancing loss rides on the activations' backward. ``ctx`` is the rank's
:class:`workers.model.decoder.ShardContext`."""

from __future__ import annotations

import torch
from torch import nn

from workers.config import ModelConfig
from workers.model.attention import Attention, RMSNorm
from workers.model.fused import swiglu
from workers.model.mla import MLAttention
from workers.parallel.expert import MoELayer, Routing
from workers.parallel.initializer import Cat, NormalInit
from workers.parallel.recompute import is_recomputing
from workers.parallel.tensor import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """SwiGLU. Gate and up share one column-parallel layer (one SP all-gather, not two):
    its full weight interleaves them per TP shard so rank r holds ``[gate_r; up_r]``."""

    def __init__(self, cfg: ModelConfig, ctx, prefix: str, ffn_hidden_size: int | None = None):
        super().__init__()
        h, std, sp, tp_size = cfg.hidden_size, cfg.init_method_std, ctx.sequence_parallel, ctx.tp_size
        f = ffn_hidden_size or cfg.ffn_hidden_size
        gate = NormalInit(ctx.seed, f"{prefix}.gate", (f, h), std)
        up = NormalInit(ctx.seed, f"{prefix}.up", (f, h), std)
        per = f // tp_size
        gate_up = Cat([part for r in range(tp_size)
                       for part in (gate.narrow(0, r * per, per), up.narrow(0, r * per, per))])
        self.gate_up = ColumnParallelLinear(gate_up, ctx.tp_group, sequence_parallel=sp)
        self.down = RowParallelLinear(NormalInit(ctx.seed, f"{prefix}.down", (h, f), std), ctx.tp_group,
                                      sequence_parallel=sp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU MLP of ``x``, plus ``residual`` if given (folded into the down GEMM)."""
        return self.down(swiglu(self.gate_up(x)), residual)


def moe_layer(cfg: ModelConfig, ctx, prefix: str) -> MoELayer:
    """The MoE of layer ``prefix``: router, routed experts (``moe_ffn_hidden_size``) and, with
    ``moe_shared_expert_intermediate_size``, shared experts (an :class:`MLP`, ``mlp.shared_mlp``)."""
    e, h, f, std = cfg.num_moe_experts, cfg.hidden_size, cfg.expert_ffn_hidden_size, cfg.init_method_std
    shared = cfg.moe_shared_expert_intermediate_size
    return MoELayer.from_full(
        NormalInit(ctx.seed, f"{prefix}.router", (e, h), std),
        NormalInit(ctx.seed, f"{prefix}.experts.gate", (e, f, h), std),
        NormalInit(ctx.seed, f"{prefix}.experts.up", (e, f, h), std),
        NormalInit(ctx.seed, f"{prefix}.experts.down", (e, h, f), std),
        topk=cfg.moe_router_topk, ep_group=ctx.ep_group, etp_group=ctx.etp_group,
        aux_loss_coeff=cfg.moe_aux_loss_coeff, sequence_parallel=ctx.sequence_parallel,
        token_group=ctx.token_group, routing=Routing.of(cfg),
        shared=MLP(cfg, ctx, f"{prefix}.shared_mlp", shared) if shared else None,
    )


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the activations whose backward also backpropagates the MoE aux loss.

    The aux loss of a layer on an early pipeline stage cannot join the last stage's loss, so
    (as Megatron's MoEAuxLossAutoScaler does) its gradient rides on the activation's backward.
    """

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class DecoderLayer(nn.Module):
    """One transformer layer. ``prefix`` names its parameters (default ``layers.{index}``; an MTP
    module's layer is ``mtp.layers.{k}.layer``); ``moe`` overrides the model's layer pattern."""

    def __init__(self, cfg: ModelConfig, ctx, index: int, *, prefix: str | None = None,
                 moe: bool | None = None):
        super().__init__()
        prefix = prefix or f"layers.{index}"
        self.index = index  # global layer index: the parameter names' prefix
        self.prefix = prefix
        self.ctx = ctx
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, ctx.sequence_parallel)
        if cfg.multi_latent_attention:
            self.attention = MLAttention(cfg, ctx, f"{prefix}.attention", norm=RMSNorm)
        else:
            self.attention = Attention(cfg, ctx, f"{prefix}.attention")
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, ctx.sequence_parallel)
        if cfg.is_moe_layer(index) if moe is None else moe:
            self.mlp = moe_layer(cfg, ctx, prefix)
        else:
            self.mlp = MLP(cfg, ctx, f"{prefix}.mlp")
        self.aux_scale = 0.0  # gradient weight of this layer's aux loss, set by the trainer
        self.aux_loss_sum = None  # detached aux losses of the iteration's microbatches

    def forward(self, x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        x = self.attention(self.input_norm(x), rotary, residual=x)
        h = self.post_norm(x)
        if isinstance(self.mlp, MoELayer):
            y, aux = self.mlp(h)
            if not is_recomputing():  # a recomputed forward must not record its aux loss twice
                self.aux_loss_sum = aux.detach() if self.aux_loss_sum is None else self.aux_loss_sum + aux.detach()
            if aux.requires_grad:
                y = _AttachAuxLoss.apply(y, aux, self.aux_scale)
        else:
            return self.mlp(h, residual=x)
        return x + y
