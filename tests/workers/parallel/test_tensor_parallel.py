"""Parity of the tensor/sequence-parallel layers with unsharded torch.

Each rank returns its local outputs and gradients tagged with how they assemble into the
full tensor ("same": replicated, "catD": concatenated along dim D in rank order); the
parent assembles them and compares with plain ``F.linear`` / ``F.embedding`` /
``F.cross_entropy`` on the full tensors. One ``run_ranks`` per tp size checks every layer
with SP off and on, the SP mappings, a composed stack and the user-error messages.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from workers.parallel import comm
from workers.parallel.sequence import (
    allreduce_sequence_parallel_grads,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from workers.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from workers.parallel.cross_entropy import vocab_parallel_cross_entropy
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.slow

S, B, H, FF, V = 8, 2, 8, 16, 16  # all divisible by tp in {2, 4}
TOL = dict(atol=1e-5, rtol=1e-5)


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {
        "x": r(S, B, H), "w_col": r(FF, H) * 0.3, "g_col": r(S, B, FF),
        "xr": r(S, B, FF), "w_row": r(H, FF) * 0.3, "g_row": r(S, B, H),
        "tokens": torch.randint(0, V, (S, B), generator=g), "w_emb": r(V, H), "g_emb": r(S, B, H),
        # +100 makes a naive exp overflow in float32; *5 gives each shard a different max.
        "logits": r(S, B, V) * 5 + 100, "g_ce": r(S, B),
        # S*B == V: the targets are a permutation of the vocab, so every shard owns some.
        "target": torch.randperm(V, generator=g).view(S, B),
        "norm1": 1 + 0.1 * r(H), "w1": r(FF, H) * 0.3, "w2": r(H, FF) * 0.3,
        "norm2": 1 + 0.1 * r(H), "w_out": r(V, H) * 0.3,
    }


def _seq(t, group):
    return t.chunk(comm.world_size(group), 0)[comm.rank(group)]


def _last(t, group):
    return t.chunk(comm.world_size(group), -1)[comm.rank(group)]


def _rms(h):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)


def _leaf(t):
    return t.clone().requires_grad_()


def _run_parallel(d, group, sp: bool) -> dict:
    """Every layer on this rank's shards; values are (assembly mode, local tensor)."""
    out = {}
    seq = (lambda t: _seq(t, group)) if sp else (lambda t: t)
    s_mode = "cat0" if sp else "same"
    for go in (False, True):
        col = ColumnParallelLinear(d["w_col"], group, sequence_parallel=sp, gather_output=go)
        x = _leaf(seq(d["x"]))
        y = col(x)
        (y * (d["g_col"] if go else _last(d["g_col"], group))).sum().backward()
        out[f"col{int(go)}.y"] = ("same" if go else "cat-1", y.detach())
        out[f"col{int(go)}.dx"] = (s_mode, x.grad)
        out[f"col{int(go)}.dw"] = ("cat0", col.weight.grad)

    row = RowParallelLinear(d["w_row"], group, sequence_parallel=sp)
    x = _leaf(_last(d["xr"], group))
    y = row(x)
    (y * seq(d["g_row"])).sum().backward()
    out.update({"row.y": (s_mode, y.detach()), "row.dx": ("cat-1", x.grad), "row.dw": ("cat1", row.weight.grad)})

    emb = VocabParallelEmbedding(d["w_emb"], group, sequence_parallel=sp)
    y = emb(d["tokens"])
    (y * seq(d["g_emb"])).sum().backward()
    out.update({"emb.y": (s_mode, y.detach()), "emb.dw": ("cat0", emb.weight.grad)})

    logits = _leaf(_last(d["logits"], group))
    loss = vocab_parallel_cross_entropy(logits, d["target"], group)
    (loss * d["g_ce"]).sum().backward()
    out.update({"ce.loss": ("same", loss.detach()), "ce.dlogits": ("cat-1", logits.grad)})

    if sp:  # the SP mappings the layers do not use on their own
        x = _leaf(d["x"])
        y = scatter_to_sequence_parallel_region(x, group)
        (y * _seq(d["g_emb"], group)).sum().backward()
        out.update({"scatter.y": ("cat0", y.detach()), "scatter.dx": ("same", x.grad)})
        x = _leaf(_seq(d["x"], group))
        y = gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=False)
        (y * d["g_emb"]).sum().backward()
        out.update({"gather.y": ("same", y.detach()), "gather.dx": ("cat0", x.grad)})

    # Composed stack: embedding -> norm -> column -> silu -> row (+ residual) -> norm ->
    # output column -> vocab-parallel CE, mean loss.
    emb = VocabParallelEmbedding(d["w_emb"], group, sequence_parallel=sp)
    n1 = mark_sequence_parallel(nn.Parameter(d["norm1"].clone()), sp)
    c1 = ColumnParallelLinear(d["w1"], group, sequence_parallel=sp)
    r2 = RowParallelLinear(d["w2"], group, sequence_parallel=sp)
    n2 = mark_sequence_parallel(nn.Parameter(d["norm2"].clone()), sp)
    head = ColumnParallelLinear(d["w_out"], group, sequence_parallel=sp)
    h = emb(d["tokens"])
    h = h + r2(F.silu(c1(_rms(h) * n1)))
    loss = vocab_parallel_cross_entropy(head(_rms(h) * n2), d["target"], group).mean()
    loss.backward()
    params = [emb.weight, n1, c1.weight, r2.weight, n2, head.weight]
    # Unmarked (sharded) params are passed too: summing them would be caught below.
    allreduce_sequence_parallel_grads(params, group)
    out["stack.loss"] = ("same", loss.detach())
    modes = ["cat0", "same", "cat0", "cat1", "same", "cat0"]
    for name, mode, p in zip(["emb", "norm1", "w1", "w2", "norm2", "w_out"], modes, params):
        out[f"stack.d{name}"] = (mode, p.grad)
    return {f"sp{int(sp)}.{k}": v for k, v in out.items()}


def _reference(d) -> dict[str, torch.Tensor]:
    ref = {}
    x, w = _leaf(d["x"]), _leaf(d["w_col"])
    y = F.linear(x, w)
    (y * d["g_col"]).sum().backward()
    for go in (0, 1):
        ref.update({f"col{go}.y": y.detach(), f"col{go}.dx": x.grad, f"col{go}.dw": w.grad})
    x, w = _leaf(d["xr"]), _leaf(d["w_row"])
    y = F.linear(x, w)
    (y * d["g_row"]).sum().backward()
    ref.update({"row.y": y.detach(), "row.dx": x.grad, "row.dw": w.grad})
    w = _leaf(d["w_emb"])
    y = F.embedding(d["tokens"], w)
    (y * d["g_emb"]).sum().backward()
    ref.update({"emb.y": y.detach(), "emb.dw": w.grad})
    logits = _leaf(d["logits"])
    loss = F.cross_entropy(logits.reshape(-1, V), d["target"].reshape(-1), reduction="none").view(S, B)
    (loss * d["g_ce"]).sum().backward()
    ref.update({"ce.loss": loss.detach(), "ce.dlogits": logits.grad})
    ref.update({"scatter.y": d["x"], "scatter.dx": d["g_emb"], "gather.y": d["x"], "gather.dx": d["g_emb"]})

    p = {k: _leaf(d[k]) for k in ("w_emb", "norm1", "w1", "w2", "norm2", "w_out")}
    h = F.embedding(d["tokens"], p["w_emb"])
    h = h + F.linear(F.silu(F.linear(_rms(h) * p["norm1"], p["w1"])), p["w2"])
    logits = F.linear(_rms(h) * p["norm2"], p["w_out"])
    loss = F.cross_entropy(logits.reshape(-1, V), d["target"].reshape(-1))
    loss.backward()
    ref["stack.loss"] = loss.detach()
    for k, name in [("w_emb", "emb"), ("norm1", "norm1"), ("w1", "w1"), ("w2", "w2"), ("norm2", "norm2"),
                    ("w_out", "w_out")]:
        ref[f"stack.d{name}"] = p[k].grad
    return ref


def _user_errors(group) -> list[str]:
    n = comm.world_size(group)
    msgs = []
    for make in (
        lambda: VocabParallelEmbedding(torch.zeros(n * 3 + 1, H), group),
        lambda: ColumnParallelLinear(torch.zeros(n + 1, H), group),
        lambda: RowParallelLinear(torch.zeros(H, n + 1), group),
        lambda: reduce_scatter_to_sequence_parallel_region(torch.zeros(n + 1, B, H), group),
    ):
        try:
            make()
            msgs.append("no error")
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


def _rank_main(rank, world_size):
    group = torch.distributed.new_group(list(range(world_size)))
    d = _data()
    out = {**_run_parallel(d, group, False), **_run_parallel(d, group, True)}
    comm.reset_stats()
    vocab_parallel_cross_entropy(_last(d["logits"], group), d["target"], group)
    # numpy, not tensors: torch's queue pickler passes tensors as file descriptors, which
    # vanish if this process exits before the parent reads them.
    out = {k: (mode, t.detach().numpy().copy()) for k, (mode, t) in out.items()}
    return out, comm.stats(), _user_errors(group)


def _assemble(per_rank: list[dict], key: str) -> torch.Tensor:
    mode = per_rank[0][key][0]
    tensors = [torch.as_tensor(r[key][1]) for r in per_rank]
    if mode == "same":
        for r, t in enumerate(tensors[1:], 1):
            torch.testing.assert_close(t, tensors[0], **TOL, msg=lambda m: f"{key}: rank {r} differs: {m}")
        return tensors[0]
    return torch.cat(tensors, int(mode[3:]))


def _check(per_rank: list[dict], ref: dict) -> None:
    assert per_rank[0], "no results"
    for key in per_rank[0]:
        torch.testing.assert_close(_assemble(per_rank, key), ref[key.split(".", 1)[1]], **TOL,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_parity(tp):
    results = run_ranks(_rank_main, tp)
    _check([r[0] for r in results], _reference(_data()))

    # The loss moves a [s, b] MAX all-reduce and one packed [2, s, b] sum, never the logits.
    stats = results[0][1]["other"]
    assert stats["calls"] == 2
    assert stats["bytes"] == pytest.approx(2 * (tp - 1) / tp * 3 * S * B * 4)

    errors = results[0][2]
    assert "vocab size" in errors[0] and "divisible" in errors[0] and str(tp) in errors[0]
    assert "output size" in errors[1] and "input size" in errors[2]
    assert "sequence length" in errors[3] and "tensor_model_parallel_size" in errors[3]


def test_group_none_matches_reference():
    """group=None: no process group, the layers are plain torch (SP flags are no-ops)."""
    assert not torch.distributed.is_initialized()
    d = _data()
    out = {**_run_parallel(d, None, False), **_run_parallel(d, None, True)}
    _check([out], _reference(d))
    assert comm.world_size(None) == 1


def test_cross_entropy_rejects_mismatched_target():
    with pytest.raises(ValueError, match="logits"):
        vocab_parallel_cross_entropy(torch.zeros(S, B, V), torch.zeros(S, B + 1, dtype=torch.long), None)


class _OpLog(TorchDispatchMode):
    """The ops a backward dispatches, plus ``wait`` where a started collective is waited for."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket).split(".")[-1])
        return func(*args, **(kwargs or {}))


def _backward_ops(rank, world_size):
    """The backward of a column-parallel linear, without and with SP, as the op sequence with the waits."""
    import torch.distributed as dist

    out = {}
    for sp in (False, True):
        lin = ColumnParallelLinear(torch.randn(8, 4), dist.group.WORLD, sequence_parallel=sp)
        y = lin(torch.randn(4, 2, 4, requires_grad=True))
        with _OpLog() as log:
            real_wait = comm.wait
            started = []

            def recording_wait(work, log=log):
                log.ops.append("wait")
                real_wait(work)

            comm.wait = recording_wait
            real_all_reduce = dist.all_reduce

            def recording_all_reduce(*a, log=log, **k):
                work = real_all_reduce(*a, **k)
                started.append(k.get("async_op"))
                return _RecordedWork(work, log) if k.get("async_op") else work

            dist.all_reduce = recording_all_reduce
            try:
                y.sum().backward()
            finally:
                comm.wait, dist.all_reduce = real_wait, real_all_reduce
        out[sp] = [op for op in log.ops if op in ("mm", "allreduce_", "_allgather_base_", "_reduce_scatter_base_", "wait")]
    return out


class _RecordedWork:
    def __init__(self, work, log):
        self.work, self.log = work, log

    def wait(self):
        self.log.ops.append("wait")
        return self.work.wait()


def test_tp_backward_collectives_run_under_the_gemms():
    """Megatron's async TP backward: without SP the input gradient's all-reduce is started, the
    weight-gradient GEMM runs, then it is waited for; with SP the input's all-gather runs under the
    input-gradient GEMM and the reduce-scatter under the weight-gradient GEMM. (Blocking
    collectives, the code before, give no ``wait`` between; the numbers are the parity test's.)"""
    ops = run_ranks(_backward_ops, 2)[0]
    assert ops[False] == ["mm", "allreduce_", "mm", "wait"], ops[False]
    assert ops[True] == ["_allgather_base_", "mm", "wait", "_reduce_scatter_base_", "mm", "wait"], ops[True]
