"""Multi-token prediction (DeepSeek-V3's MTP; Megatron-Core's ``mtp_num_layers``).

After the last decoder layer, ``D = mtp_num_layers`` modules each predict one token further
ahead, chained on the previous one's hidden state. Module ``k`` (1-based), at position ``i``:

    x_i   = eh_proj([enorm(emb(t[i+k])) ; hnorm(h[i])])    h: the main model's last hidden state
                                                            (before its final norm) for k = 1,
                                                            module k-1's output for k > 1
    h'    = DecoderLayer(x)                                 causal over the sequence, same positions
    loss  = CE(output(final_norm(h'[i])), t[i+k+1])         for i + k < s (else no target: masked)

The embedding and the output layer are the main model's own (shared, as DeepSeek-V3 and
Megatron-Core: on a pipeline the last stage keeps a copy of the embedding whose gradient is
summed with the first stage's, as a tied output layer's is). The module's transformer layer is
an MoE layer when the model's last layer is one.

The loss of depth ``k`` is ``L_k = sum of the valid token losses / valid tokens`` over the global
batch (``global_batch x (s - k)`` tokens), a number no layout changes; the objective adds
``mtp_loss_scaling_factor / D * sum_k L_k`` to the LM loss. Its gradient joins the LM loss's
through :func:`join_loss` while the reported ``loss`` stays the LM loss (Megatron's
``MTPLossAutoScaler``); the mean of ``L_k`` is reported as ``mtp_loss``.

Each rank reads its whole samples, so the shifted tokens and labels are cut from the full
sequence before the CP split (:func:`shifted_targets`): no communication, whatever the CP layout.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.config import ModelConfig
from workers.model.attention import RMSNorm
from workers.parallel.cross_entropy import vocab_parallel_cross_entropy
from workers.parallel.initializer import NormalInit
from workers.parallel.sequence import scatter_to_sequence_parallel_region
from workers.parallel.tensor import ColumnParallelLinear


class MTPModule(nn.Module):
    """One depth: the two norms, the projection of their concatenation, a decoder layer and the
    final norm before the shared output layer. Parameter names ``mtp.layers.{k}.*``."""

    def __init__(self, cfg: ModelConfig, ctx, k: int, layer_cls):
        super().__init__()
        prefix = f"mtp.layers.{k}"
        h, sp, eps = cfg.hidden_size, ctx.sequence_parallel, cfg.norm_epsilon
        self.ctx = ctx
        self.enorm = RMSNorm(h, eps, sp)
        self.hnorm = RMSNorm(h, eps, sp)
        # Column-parallel with the output gathered back to the full hidden size (Megatron's
        # eh_proj), then, with SP, this rank's sequence shard again.
        self.eh_proj = ColumnParallelLinear(NormalInit(ctx.seed, f"{prefix}.eh_proj", (h, 2 * h), cfg.init_method_std),
                                            ctx.tp_group, sequence_parallel=sp, gather_output=True)
        self.layer = layer_cls(cfg, ctx, cfg.num_layers + k, prefix=f"{prefix}.layer",
                               moe=cfg.is_moe_layer(cfg.num_layers - 1))
        self.final_norm = RMSNorm(h, eps, sp)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        if self.ctx.sequence_parallel and self.ctx.tp_size > 1:
            x = scatter_to_sequence_parallel_region(x, self.ctx.tp_group)
        return self.layer(x, rotary)


class MultiTokenPrediction(nn.Module):
    """The ``D`` chained MTP modules of the last pipeline stage."""

    def __init__(self, cfg: ModelConfig, ctx, layer_cls):
        super().__init__()
        self.ctx = ctx
        self.layers = nn.ModuleList(MTPModule(cfg, ctx, k, layer_cls) for k in range(cfg.mtp_num_layers))

    def forward(self, hidden: torch.Tensor, targets: "MTPTargets", rotary: torch.Tensor, embed, head) -> torch.Tensor:
        """Per-depth sums of the valid token losses, ``[D]`` fp32.

        Args:
            hidden: the main model's last hidden state (before its final norm), as the layers hold it.
            targets: this rank's shifted tokens, labels and validity (:func:`shifted_targets`).
            rotary: the chunk's rotary tables.
            embed: tokens ``[s, b]`` -> embeddings as the first layer gets them (the shared embedding).
            head: normed hidden -> vocab-parallel logits (the shared output layer, padding masked).
        """
        sums = []
        for k, module in enumerate(self.layers):
            hidden = module(hidden, embed(targets.tokens[k]), rotary)
            losses = vocab_parallel_cross_entropy(head(module.final_norm(hidden)), targets.labels[k],
                                                  self.ctx.tp_group)
            sums.append((losses * targets.valid[k]).sum())
        return torch.stack(sums)


class MTPTargets:
    """``tokens``, ``labels`` ``[D, s, b]`` long and ``valid`` ``[D, s, b]`` fp32 of one microbatch:
    depth k's input tokens ``t[i+k]``, labels ``t[i+k+1]`` and whether position i has one."""

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor):
        self.tokens, self.labels, self.valid = tokens, labels, valid

    def map(self, fn) -> "MTPTargets":
        return MTPTargets(fn(self.tokens), fn(self.labels), fn(self.valid))


def shifted_targets(tokens: torch.Tensor, labels: torch.Tensor, depth: int) -> MTPTargets:
    """Depths 1..``depth`` of full-sequence ``tokens`` and ``labels`` ``[s, b]`` (labels[i] =
    t[i+1]): each shifted left by k, the k positions past the end filled with token 0 and
    marked invalid (Megatron's ``roll_tensor`` with a zeroed loss mask)."""
    s = tokens.shape[0]
    out_t, out_l, out_v = [], [], []
    for k in range(1, depth + 1):
        pad = tokens.new_zeros((k, *tokens.shape[1:]))
        out_t.append(torch.cat([tokens[k:], pad]))
        out_l.append(torch.cat([labels[k:], pad]))
        out_v.append((torch.arange(s) < s - k).to(torch.float32)[:, None].expand(tokens.shape))
    return MTPTargets(torch.stack(out_t), torch.stack(out_l), torch.stack(out_v).contiguous())


def valid_tokens(seq_length: int, global_batch: int, depth: int) -> list[int]:
    """Tokens with a depth-k target in a global batch, k = 1..depth: the per-depth denominators."""
    return [global_batch * (seq_length - k) for k in range(1, depth + 1)]


class _JoinLoss(torch.autograd.Function):
    """``loss`` in the forward; the backward sends the incoming gradient to both ``loss`` and
    ``extra``: ``extra`` is optimised without entering the reported value."""

    @staticmethod
    def forward(ctx, loss, extra):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def join_loss(loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    return _JoinLoss.apply(loss, extra)
