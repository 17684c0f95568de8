"""Shared helpers of the whole-model parity tests.

A layout passes when, against a single process running the same spec:

* every iteration's LM loss (and MoE aux loss and MTP loss) agrees to 1e-6 relative;
* at iteration 0 every parameter's full gradient, assembled from the shards the ranks hold
  after the data-parallel reduction, agrees to 1e-5 (max abs error / max abs value);
* after the last step, every copy of a replicated parameter (over TP, CP, DP, expert-DP) is
  bit-identical to every other copy;
* every iteration's global grad norm agrees to 1e-5 and the LR to 1e-12, and the validation
  loss (one evaluation after the last iteration) to 1e-6;
* every MoE expert bias (aux-loss-free balancing) equals the single process's after the last step.

The parity job clips at ``clip_grad: 0.05``, below every iteration's grad norm, so clipping
is active in every step of every layout (the acceptance test of issue 12), and evaluates once
(``eval_interval`` = the iterations, ``eval_iters: 1``), so evaluation is layout-checked too.

The gradient check is what catches gradient bugs the loss cannot see (Adam is invariant to a
constant gradient scale, so a loss curve hides "expert grads x3"); the bit-equality check
catches replicas that drift apart (e.g. norm grads not summed over TP with SP).
"""

from __future__ import annotations

import functools
import json

import numpy as np

from service.spec.spec import parse_spec, to_job_config

ITERS = 3
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
CLIP = 0.05


def tiny_spec(*, moe: bool = False, world: int = 1, parallel: dict | None = None, training: dict | None = None,
              model: dict | None = None) -> dict:
    """The parity job. MoE runs with the load-balancing loss on (coefficient 0.01), and weight
    decay is on, so both paths are part of every comparison."""
    spec = {
        "name": "parity",
        "model": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                  "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 16,
                  **({"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01} if moe else {}),
                  **(model or {})},
        "parallel": parallel or {},
        "training": {"train_iters": ITERS, "global_batch_size": 8, "micro_batch_size": 1, "lr": 3e-3,
                     "seed": 7, "weight_decay": 0.1, "clip_grad": CLIP, "eval_interval": ITERS, "eval_iters": 1,
                     **(training or {})},
        "resources": {"num_nodes": 1, "gpus_per_node": world},
    }
    return spec


# DeepSeek-V3-style routing, every MoE routing feature at once: sigmoid scores, group-limited top-k,
# (8 experts in 2 groups: a token picks 2 of the best group's 4), the aux-loss-free expert bias (a
# large rate, so the bias moves the routing within the run), topk
# scaling, shared experts, an expert ffn of its own, a dense first layer, and the sequence-wise aux
# loss (V3_TRAIN: 2 sequences per microbatch, so it differs from the microbatch's).
V3_MODEL = {"num_moe_experts": 8, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
            "moe_router_score_function": "sigmoid", "moe_router_num_groups": 2, "moe_router_group_topk": 1,
            "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01,
            "moe_router_topk_scaling_factor": 2.5, "moe_shared_expert_intermediate_size": 32,
            "moe_ffn_hidden_size": 48, "moe_layer_freq": [0, 1, 1, 1], "moe_router_load_balancing_type": "seq_aux_loss"}
V3_TRAIN = {"micro_batch_size": 2}


def job_of(spec: dict):
    return to_job_config(parse_spec(spec))


def _reduced_grads(trainer) -> dict[str, np.ndarray]:
    """Every local param's gradient after the data-parallel reduction, as the optimizer sees
    it (with the distributed optimizer, all-gathered back from the reduce-scattered shards)."""
    import torch

    from workers.parallel import comm

    opt = trainer.optimizer
    opt.grads.finish()
    flat_of = {}
    for buf in opt.grads.buffers:
        flat = buf.grad
        if buf.shard:
            flat = torch.empty(buf.numel, dtype=buf.grad.dtype)
            for bucket in buf.buckets:
                lo, hi, base = buf.shard_range(bucket)
                comm.all_gather_into(flat[bucket.start : bucket.end], buf.grad[lo:hi], buf.group)
        for p in buf.params:
            flat_of[id(p)] = flat[buf.offsets[id(p)] : buf.offsets[id(p)] + p.numel()].view(p.shape)
    return {name: flat_of[id(p)].detach().float().numpy().copy() for name, p, _ in _named(trainer)}


def _named(trainer):
    for chunk in trainer.chunks:
        yield from chunk.logical_parameters()


def run_trainer(rank, world_size, job, iters=ITERS) -> dict:
    """Train ``iters`` iterations; returns losses, aux losses, iteration-0 reduced gradients and
    final params (numpy: tensors cannot outlive a rank process), each param with its shards."""
    from workers.train.trainer import Trainer

    trainer = Trainer(job, rank, world_size)
    # The trainer steps through step_on_device (its one host read comes after); the gradients are
    # captured just before the first one.
    step, captured = trainer.optimizer.step_on_device, {}

    def capture_then_step():
        if not captured:
            captured.update(_reduced_grads(trainer))
        return step()

    trainer.optimizer.step_on_device = capture_then_step
    metrics = [trainer.train_step() for _ in range(iters)]
    # An empty capture would make every gradient check vacuous (both sides empty): fail instead.
    assert captured or not iters, "the optimizer step the trainer calls was not hooked: no gradients captured"
    shards = {name: s for name, _, s in _named(trainer)}
    biases = {f"{layer.prefix}.mlp.router.expert_bias": layer.mlp.router.expert_bias.numpy().copy()
              for chunk in trainer.chunks for layer in chunk.all_layers()
              if getattr(getattr(layer.mlp, "router", None), "expert_bias", None) is not None}
    params = {name: p.detach().float().numpy().copy() for name, p, _ in _named(trainer)}
    return {"losses": [m["loss"] for m in metrics], "aux": [m["moe_aux_loss"] for m in metrics],
            "grads": captured, "params": params, "shards": shards, "metrics": metrics, "expert_bias": biases}


@functools.lru_cache(maxsize=64)
def _reference(key: str) -> dict:
    model, training = json.loads(key)
    return run_trainer(0, 1, job_of(tiny_spec(model=model, training=training)))


def reference(model: dict | None = None, training: dict | None = None) -> dict:
    """The single-process run of the parity job (no torch.distributed at all), cached."""
    return _reference(json.dumps([model or {}, training or {}], sort_keys=True))


def distributed_run(spec: dict) -> list[dict]:
    """Every rank's :func:`run_trainer` result for ``spec``."""
    from tests.helpers.ranks import run_ranks

    job = job_of(spec)
    return run_ranks(run_trainer, job.world_size, args=(job,), timeout_s=600)


def assert_same_curve(got, ref, rtol=LOSS_RTOL, what="loss"):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        if a is None or b is None:  # e.g. no grad norm on an fp16 overflow step: both or neither
            assert a is b, f"{what} iteration {i}: {a} vs single-process {b}"
            continue
        assert abs(a - b) <= rtol * abs(b), f"{what} iteration {i}: {a} vs single-process {b} (rel {abs(a - b) / abs(b):.2e})"


def assemble(per_rank: list[dict], key: str) -> dict[str, np.ndarray]:
    """Full tensors from every rank's shards of ``key`` ("grads" or "params").

    Replicas of one shard must be bit-identical for "params"; for "grads" the first copy is
    taken (they are compared against the reference anyway).
    """
    pieces: dict[str, dict[tuple, np.ndarray]] = {}
    for r, result in enumerate(per_rank):
        for name, value in result[key].items():
            where = tuple(result["shards"][name])
            seen = pieces.setdefault(name, {})
            if where in seen and key == "params":
                assert np.array_equal(seen[where], value), (
                    f"{name} shard {where}: the copy on rank {r} differs from another replica "
                    f"(max diff {np.abs(seen[where] - value).max():.3e})")
            seen.setdefault(where, value)
    return {name: _place(name, shards) for name, shards in pieces.items()}


def _place(name: str, shards: dict[tuple, np.ndarray]) -> np.ndarray:
    where, first = next(iter(shards.items()))
    shape = list(first.shape)
    for dim, _, count in where:
        shape[dim] *= count
    full = np.full(shape, np.nan, dtype=first.dtype)
    for where, value in shards.items():
        index = [slice(None)] * len(shape)
        for dim, i, count in where:
            size = shape[dim] // count
            index[dim] = slice(i * size, (i + 1) * size)
        full[tuple(index)] = value
    assert not np.isnan(full).any(), f"{name}: the ranks' shards do not cover the full tensor"
    tp = max((count for dim, _, count in where if name.endswith("gate_up.weight")), default=1)
    if tp > 1:  # [gate_0; up_0; gate_1; up_1; ...] -> [gate; up], the single-process layout
        full = full.reshape(tp, 2, -1, full.shape[-1]).transpose(1, 0, 2, 3).reshape(full.shape)
    return full


def metric(result: dict, key: str) -> list:
    return [m[key] for m in result["metrics"]]


def check_layout(spec: dict, model: dict | None = None, training: dict | None = None, *, loss_rtol: float = LOSS_RTOL,
                 grad_rtol: float = GRAD_RTOL, norm_rtol: float = GRAD_RTOL) -> list[dict]:
    """Run ``spec`` distributed and check losses, iteration-0 gradients, grad norms, LRs,
    validation losses and replicas against the single-process reference of the same model
    and training settings (looser tolerances for bf16/fp16 runs)."""
    return check_results(distributed_run(spec), model, training, loss_rtol=loss_rtol, grad_rtol=grad_rtol,
                         norm_rtol=norm_rtol)


def check_results(per_rank: list[dict], model: dict | None = None, training: dict | None = None, *,
                  loss_rtol: float = LOSS_RTOL, grad_rtol: float = GRAD_RTOL, norm_rtol: float = GRAD_RTOL) -> list[dict]:
    """:func:`check_layout`'s checks of a distributed run's per-rank results."""
    ref = reference(model, training)
    for r in per_rank:
        for key in ("loss", "mtp_loss", "grad_norm", "lr", "val_loss", "loss_scale", "skipped"):
            assert metric(r, key) == metric(per_rank[0], key), f"every rank reports the same {key}"
    got = per_rank[0]
    assert_same_curve(got["losses"], ref["losses"], rtol=loss_rtol)
    if ref["aux"][0]:
        assert_same_curve(got["aux"], ref["aux"], rtol=loss_rtol, what="moe aux loss")
    assert_same_curve(metric(got, "mtp_loss"), metric(ref, "mtp_loss"), rtol=loss_rtol, what="mtp loss")
    assert_same_curve(metric(got, "grad_norm"), metric(ref, "grad_norm"), rtol=norm_rtol, what="grad norm")
    assert_same_curve(metric(got, "lr"), metric(ref, "lr"), rtol=1e-12, what="lr")
    vals = [(a, b) for a, b in zip(metric(got, "val_loss"), metric(ref, "val_loss")) if b is not None]
    assert [a is None for a in metric(got, "val_loss")] == [b is None for b in metric(ref, "val_loss")]
    assert_same_curve([a for a, _ in vals], [b for _, b in vals], rtol=loss_rtol, what="validation loss")
    grads = assemble(per_rank, "grads")
    assert sorted(grads) == sorted(ref["grads"])
    for name, want in ref["grads"].items():
        got_grad = grads[name][tuple(slice(0, n) for n in want.shape)]  # drop vocab padding rows
        err = np.abs(got_grad - want).max() / np.abs(want).max()
        assert err <= grad_rtol, f"iteration-0 gradient of {name}: relative error {err:.2e}"
    assemble(per_rank, "params")  # asserts replicas bit-equal
    # Aux-loss-free balancing: every rank's expert biases (updated from the global loads) are the
    # single process's, exactly; together the ranks hold every layer's.
    held = set()
    for r, result in enumerate(per_rank):
        for name, bias in result["expert_bias"].items():
            assert np.array_equal(bias, ref["expert_bias"][name]), (
                f"rank {r}: {name} {bias.tolist()} != single-process {ref['expert_bias'][name].tolist()}")
            held.add(name)
    assert held == set(ref["expert_bias"])
    return per_rank
