"""The analytic minimum of the bytes each rank sends per iteration, per traffic, that
``bench/comm_bench.py`` measures against (and the plan's traffic estimate is checked with).

Derivation of the minimum (per rank, one iteration)
===================================================

Notation: ``s = seq_length / cp`` tokens per CP rank, ``b`` micro batch, ``h`` hidden, ``d``
head dim, ``g = num_query_groups / tp`` local kv heads, ``V`` vocab padded to a multiple of tp,
``m = global_batch / (micro_batch * dp)`` microbatches, ``L`` decoder layers on this rank,
4-byte floats, ``A = s*b*h*4`` one activation. Ring formulas (comm.py):
``AR(n, B) = 2 (n-1)/n B``, all-gather ``(n-1)/n x output``, reduce-scatter
``(n-1)/n x input``, all-to-all and p2p: the bytes that leave the rank.

* **tp** (tensor parallel activations). A column->row region needs its input complete on every
  rank and its partial output summed: per dense layer per microbatch 2 forward all-reduces
  (after proj and after down) and 2 backward all-reduces (the input grads of qkv and gate_up),
  ``4 AR(tp, A)``; a MoE layer (its tokens are SP-sharded, no TP inside) only attention's
  ``2 AR(tp, A)``. With SP each all-reduce becomes a reduce-scatter + all-gather of the same
  volume (``2 x (tp-1)/tp A``), and each column-parallel layer (qkv, gate_up, the output
  layer) gathers its input shard once more in backward, ``(tp-1)/tp A`` each: it saves only
  the shard for backward (Megatron's trade of bytes for activation memory). The vocab-parallel embedding adds
  one AR of its partial lookup (SP: RS forward, AG backward), the output layer one AR of its
  input grad (SP: AG forward, RS backward). Cross-entropy needs, per token, the log-sum-exp
  over the vocab shards and the target logit: 2 floats, ``AR(tp, 2 s b 4)`` (the
  implementation also all-reduces the max for numerical stability, a third float per token,
  ~0.1% here; a log-add-exp reduction would avoid it). Multi-latent attention: its down
  projections are whole on every rank and run on the layer's input as it comes, so the
  column-parallel inputs are the up projections' (the latents, ``q_lora_rank`` and
  ``kv_lora_rank`` wide; ``q_proj``'s: ``h``), each an AR of its width (SP: AG forward, RS
  backward, plus the backward re-gather), and the rotary key (``qk_pos_emb_head_dim`` wide, one
  for every head of the rank) has its grad summed over tp (SP: AG forward, RS backward), in place
  of qkv's ``AR(tp, A)`` (and re-gather).
* **sp grads** (``tp-dp-cp``): weights applied to sequence shards (RMSNorm weights, MoE routers
  with SP; with multi-latent attention also its down projections ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` and their latent norms, whole on every TP rank:
  ``MLADims.replicated_parameters``) have grads partial over tp and dp-cp: ``AR(tp dp cp, P_sp 4)``.
* **dp grads** (``dp-cp``): every other non-expert local param once, ``AR(dp cp, P_dense 4)``
  (MLA's attention: ``MLADims.parameters`` less its replicated part);
  with the distributed optimizer a reduce-scatter of the grads plus an all-gather of the params,
  ``2 (n-1)/n P 4``, the same volume (buckets pad to a multiple of n: a few elements).
* **expert grads** (``expert-dp``): ``AR(expert_dp, P_expert 4)``.
* **pp**: per microbatch one activation forward and one gradient backward across every
  virtual-stage boundary; the rank sends one ``A_pp = (s / tp if SP) b h 4`` for each of its
  virtual stages that is not the last (forward) and each that is not the first (backward).
* **cp**: only attention mixes tokens. The K/V block of a rank is ``K = s b g 2d 4``. Ring
  (``p2p``): forward, each block visits the cp-1 other ranks (cp-1 sends per rank); backward
  recomputes from the saved local q,k,v (FlashAttention's recipe, as Megatron/TE: K/V are not
  saved from the forward ring) so K/V circulate again (cp-1) and each block's dK/dV, partial on
  the cp-1 ranks that used it, must be summed back to its owner: a chain of cp-1 hops
  (reduce-scatter bound ``(cp-1)/cp x cp K``). Total ``3 (cp-1) K`` per layer per microbatch.
  ``all_gather``: AG of K/V forward + RS of dK/dV backward, ``2 (cp-1) K``. ``a2a``: each
  token's q, k, v and attention output cross once each way, ``(a2a-1)/a2a`` of them leaving the
  rank: ``2 (a2a-1)/a2a s b (2 H + 2 G) d 4`` (``H`` query heads, ``G`` K/V heads per TP rank; K/V
  heads that do not divide by the a2a size travel repeated, ``G = H``); ``a2a+p2p`` adds the ring
  across the a2a groups, ``3 (cp/a2a - 1)`` blocks of ``s b G 2d 4``. Multi-latent attention
  expands K and V per head (``G = H``), and its attention runs at one head dim,
  ``d = max(qk_head_dim + qk_pos_emb_head_dim, v_head_dim)`` (the smaller padded with zeros: the
  attention kernels take one head dim), so the minimum counts that width.
* **ep**: each token choice routed to an expert on another EP rank must go there and its output
  come back, forward and backward: ``2 (sent + received) h 4`` with ``sent`` / ``received``
  the rank's remote choices counted from the actual routing (a forward hook on the routers),
  plus the per-expert counts (``(E - E/ep)`` int64 per MoE layer per microbatch). This is the
  per-choice minimum of Megatron's all-to-all dispatcher; deduplicating the k choices of one
  token that go to the same rank (DeepEP style) would be lower still (see the report line).
* **etp**: expert tensor parallelism gathers the EP-received rows of the ETP group (forward),
  reduce-scatters the partial outputs (forward) and the adjoints backward:
  ``4 (etp-1)/etp x rows_group h 4`` plus the counts all-gather ``(etp-1) E 8``.
* **loss**: the reported loss is one float64 all-reduced over dp-cp (last stage) and pp; a MoE
  model also all-reduces its reported aux loss (one float64) over the world.
* **grad-norm**: the global gradient norm (clipping, reported every step) is one float64 sum
  of squares all-reduced over the world (Megatron: one all-reduce over its grad-stats group).
"""

from __future__ import annotations

import math

from service.spec.mla import MLADims
from workers.config import JobConfig
from workers.grid import ParallelGrid
from workers.parallel.pipeline import partition_layers

FLOAT = 4  # fp32 activations, grads and params
INDEX = 8  # int64 per-expert counts
LOSS = 8  # the float64 loss scalar
TRAFFIC = ("tp", "cp", "pp", "ep", "etp", "grads:dense", "grads:sp", "grads:expert", "loss:dp-cp", "loss:pp",
           "loss:world", "grad-norm")


def all_reduce_bytes(n: int, nbytes: float) -> float:
    """Ring all-reduce: 2 (n-1)/n x bytes (0 for a group of one)."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def ratio(measured: float, minimum: float) -> float:
    """measured / minimum; 1 when both are 0, inf when only the minimum is 0."""
    if minimum <= 0:
        return 1.0 if measured <= 0 else math.inf
    return measured / minimum


def _padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def _experts_of(ep_index: int, num_experts: int, ep: int) -> range:
    per = num_experts // ep
    return range(ep_index * per, (ep_index + 1) * per)


def analytic_bytes(job: JobConfig, rank: int, routes: dict[int, list[int]] | None = None) -> dict[str, float]:
    """The minimum bytes ``rank`` sends in one iteration, per traffic (see the module docstring).

    Args:
        job: the job.
        rank: a global rank.
        routes: for MoE with ep or etp > 1, each global rank's number of token choices per
            expert during the iteration (summed over its MoE layers and microbatches).

    Returns:
        ``{traffic: bytes}`` for every name in :data:`TRAFFIC`.
    """
    m, p, t = job.model, job.parallel, job.training
    grid = ParallelGrid.from_config(p, job.world_size)
    tp, pp, cp, dp, ep, etp, edp = grid.tp, grid.pp, grid.cp, grid.dp, grid.ep, grid.etp, grid.expert_dp
    vpp = p.virtual_pipeline_model_parallel_size or 1
    sp = p.sequence_parallel and tp > 1
    nmb = t.global_batch_size // (t.micro_batch_size * dp)
    s, b, h, d = m.seq_length // cp, t.micro_batch_size, m.hidden_size, m.head_dim
    act = s * b * h * FLOAT
    stage = grid.coords(rank)["pp"]
    layers = sum(len(c) for c in partition_layers(m.num_layers, pp, p.virtual_pipeline_model_parallel_size)[stage])
    pre, post = stage == 0, stage == pp - 1
    out = dict.fromkeys(TRAFFIC, 0.0)

    # Tensor parallelism: per layer, attention's and (dense) the MLP's row-parallel output summed
    # and column-parallel input grads summed: 4 (dense) or 2 (MoE) all-reduce volumes. With SP,
    # each column-parallel layer re-gathers its saved input shard in backward. MLA's column-parallel
    # layers take the latents (q_lora_rank, kv_lora_rank wide; q_proj: hidden), and its rotary key
    # (qk_pos_emb_head_dim wide, whole on each rank) has its grad summed too.
    regather = (tp - 1) / tp * act if sp else 0.0

    def columns(*widths: int) -> float:  # column-parallel layers on inputs this wide per token
        return sum(all_reduce_bytes(tp, s * b * w * FLOAT) + ((tp - 1) / tp * (s * b * w * FLOAT) if sp else 0.0)
                   for w in widths)

    mla = MLADims.of(m)
    if mla:
        rotary_key = all_reduce_bytes(tp, s * b * mla.qk_pos_emb_head_dim * FLOAT)
        attention = columns(mla.q_lora_rank or h, mla.kv_lora_rank) + rotary_key
    else:
        attention = columns(h)
    per_layer = all_reduce_bytes(tp, act) + attention + (0 if m.is_moe else all_reduce_bytes(tp, act) + columns(h))
    per_mb = layers * per_layer + pre * all_reduce_bytes(tp, act)
    per_mb += post * (all_reduce_bytes(tp, act) + regather + all_reduce_bytes(tp, 2 * s * b * FLOAT))
    out["tp"] = nmb * per_mb

    # Pipeline: one tensor per virtual-stage boundary and direction.
    last = pp * vpp - 1
    sends = sum(int(v < last) + int(v > 0) for v in (c * pp + stage for c in range(vpp)))
    out["pp"] = nmb * sends * (s // (tp if sp else 1)) * b * h * FLOAT if pp > 1 else 0.0

    # Context parallelism: K/V blocks of the local kv heads (ring, all-gather); with a2a every
    # token's q, k, v and output once each way, (cp-1)/cp of them leaving the rank (K/V heads that do
    # not divide by cp travel repeated to one per query head).
    # Multi-latent attention: K and V expanded per head, q, k, v and the output at one head dim.
    groups, width = (m.num_attention_heads, max(mla.qk, mla.v_head_dim)) if mla else (m.num_query_groups, d)
    if cp > 1 and p.cp_comm_type in ("a2a", "a2a+p2p"):
        a2a = p.hierarchical_context_parallel_sizes[0] if p.cp_comm_type == "a2a+p2p" else cp
        heads = m.num_attention_heads // tp
        kv_heads = groups // tp if (groups // tp) % a2a == 0 else heads
        out["cp"] = nmb * layers * 2 * (a2a - 1) / a2a * s * b * (2 * heads + 2 * kv_heads) * width * FLOAT
        # a2a+p2p: the ring across the a2a groups, each member's block its group's tokens, its kv heads
        out["cp"] += nmb * layers * 3 * (cp // a2a - 1) * s * b * kv_heads * 2 * width * FLOAT
    elif cp > 1:
        kv_block = s * b * (groups // tp) * 2 * width * FLOAT
        blocks = 3 * (cp - 1) if p.cp_comm_type == "p2p" else 2 * (cp - 1)
        out["cp"] = nmb * layers * blocks * kv_block

    # Gradients (and the distributed optimizer's param all-gather) per param group.
    vocab = _padded_vocab(m.vocab_size, tp)
    heads, groups, f = m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
    seq = layers * 2 * h + post * h
    if mla:  # the down projections and latent norms are whole on every TP rank: SP-marked, as the norms
        dense = layers * (mla.parameters(h, heads, tp) - mla.replicated_parameters(h))
        seq += layers * mla.replicated_parameters(h)
    else:
        dense = layers * (groups * (heads // groups + 2) * d * h // tp + h * heads * d // tp)
    dense += (pre + post) * vocab * h // tp
    expert = 0
    if m.is_moe:
        seq += layers * m.num_moe_experts * h  # routers
        expert = layers * 3 * (m.num_moe_experts // ep) * (f // etp) * h
    else:
        dense += layers * 3 * f * h // tp
    if not p.sequence_parallel:
        dense, seq = dense + seq, 0
    out["grads:dense"] = all_reduce_bytes(dp * cp, dense * FLOAT)
    out["grads:sp"] = all_reduce_bytes(tp * dp * cp, seq * FLOAT)
    out["grads:expert"] = all_reduce_bytes(edp, expert * FLOAT)
    out["loss:dp-cp"] = post * all_reduce_bytes(dp * cp, LOSS)
    out["loss:pp"] = all_reduce_bytes(pp, LOSS)
    out["loss:world"] = m.is_moe * all_reduce_bytes(job.world_size, LOSS)  # the reported MoE aux loss
    out["grad-norm"] = all_reduce_bytes(job.world_size, LOSS)  # the float64 sum of squares

    # Experts: the routed token rows (from the actual routing) and the per-expert counts.
    if m.is_moe and (ep > 1 or etp > 1):
        if routes is None:
            raise ValueError("analytic_bytes: a MoE layout with ep or etp > 1 needs the routes of every rank")
        num_e, calls = m.num_moe_experts, nmb * layers
        ep_groups = grid.groups("ep", expert=True)
        ep_group_of = {r: g for g in ep_groups for r in g}

        def received(q: int) -> int:  # rows rank q's experts get from its EP group (itself included)
            g = ep_group_of[q]
            mine = _experts_of(g.index(q), num_e, ep)
            return sum(routes[src][e] for src in g for e in mine)

        if ep > 1:
            g = ep_group_of[rank]
            mine = _experts_of(g.index(rank), num_e, ep)
            sent = sum(n for e, n in enumerate(routes[rank]) if e not in mine)
            recv = received(rank) - sum(routes[rank][e] for e in mine)
            out["ep"] = 2 * (sent + recv) * h * FLOAT + calls * (num_e - num_e // ep) * INDEX
        if etp > 1:
            etp_group = next(g for g in grid.groups("tp", expert=True) if rank in g)
            rows = sum(received(q) for q in etp_group)
            out["etp"] = 4 * (etp - 1) / etp * rows * h * FLOAT + calls * (etp - 1) * num_e * INDEX
    return out
