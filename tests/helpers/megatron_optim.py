"""megatron-core's own DistributedOptimizer (Adam) beside raytron, on CPU: it trains megatron-core's
GPTModel, saves and loads its state with ``dist_checkpointing`` (the ``fully_reshardable`` format), as
the outside judge of the optimizer state that ``checkpoint.load: megatron:DIR`` reads and ``raytron
export --format megatron`` writes.

The optimizer and its DDP buffers are written for CUDA: on CPU they need, besides
:func:`tests.helpers.megatron.stand_ins`, the tensors they make on ``device='cuda'`` made on the CPU,
CPU float params typed as CUDA ones where they check (``param.type()``), ``Tensor.cuda()`` a no-op and a
current stream with nothing to wait for (:func:`optimizer_stand_ins`; rank processes only: they change
torch for the whole process). Every function that needs a process group is a rank function for
:func:`tests.helpers.ranks.run_ranks`.
"""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import torch

from tests.helpers.megatron import gpt_model, init_parallel, stand_ins

MAKERS = ("tensor", "zeros", "empty", "ones", "full", "zeros_like", "empty_like")
MODULES = ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer",
           "megatron.core.optimizer.clip_grads", "megatron.core.distributed.param_and_grad_buffer",
           "megatron.core.utils")


class _CpuTorch(types.ModuleType):
    """``torch`` as those modules see it: a tensor asked for on ``cuda`` is made on the CPU."""

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name not in MAKERS:
            return value

        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return make


def optimizer_stand_ins() -> None:
    """The CPU stand-ins megatron-core's DDP and DistributedOptimizer need (a rank process only)."""
    stand_ins()
    shim = _CpuTorch("torch")
    for name in MODULES:
        importlib.import_module(name).torch = shim
    typed = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: typed(self, *a, **k) if a or k else \
        typed(self).replace("torch.", "torch.cuda.", 1)
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_stream = lambda *a, **k: types.SimpleNamespace(
        wait_event=lambda e: None, wait_stream=lambda s: None, synchronize=lambda: None)


def model_and_optimizer(training, tp: int, seed: int = 1):
    """megatron-core's GPTModel at ``tp`` (one stage), wrapped in its DDP, and its distributed Adam with
    raytron training fields ``training`` (lr, weight decay, betas, eps, clipping)."""
    optimizer_stand_ins()
    init_parallel(tp, 1)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    gpt = gpt_model(seed=seed)
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), gpt)
    config = OptimizerConfig(optimizer="adam", lr=training.lr, min_lr=training.min_lr,
                             weight_decay=training.weight_decay, clip_grad=training.clip_grad,
                             adam_beta1=training.adam_beta1, adam_beta2=training.adam_beta2, adam_eps=training.adam_eps,
                             use_distributed_optimizer=True, params_dtype=torch.float32)
    opt = get_megatron_optimizer(config, [ddp])
    for group in opt.param_groups:  # as Megatron-LM's LR scheduler sets them (no decay of norms)
        group["weight_decay"] = training.weight_decay * group["wd_mult"]
        group["lr"] = group["max_lr"] * group["lr_mult"]
    return gpt, ddp, opt


def global_batches(job, *iterations) -> list:
    """raytron's whole global batch (tokens, labels) of each of ``iterations`` of ``job``."""
    from workers.data.dataset import GlobalSampler

    t = job.training
    sampler = GlobalSampler(t.data, job.model.seq_length, t.seed, t.global_batch_size, split=t.split)
    return [sampler.batch(i, 0, t.global_batch_size) for i in iterations]


def _loss(ddp, tokens, labels):
    b, s = tokens.shape
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    return ddp(tokens, torch.arange(s).unsqueeze(0).expand(b, s), mask, labels=labels).float().mean()


def step(ddp, opt, batch) -> float:
    """One training step of megatron-core on ``batch`` (tokens, labels); returns the loss before it."""
    ddp.train()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = _loss(ddp, *batch)
    loss.backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok, "megatron-core skipped its step"
    return float(loss)


@torch.no_grad()
def loss_of(ddp, batch) -> float:
    ddp.eval()
    return float(_loss(ddp, *batch))


METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def train_save_rank(rank, world_size, root: str, training, batches, tp: int = 1, *, args: dict | None = None) -> list:
    """A rank function: megatron-core trains one step on ``batches[0]``, saves model and optimizer as
    Megatron-LM does (``root/iter_0000001``, ``optimizer`` in fully_reshardable format, ``args``), then
    goes on: its loss on ``batches[1]``, one step on it, its loss on ``batches[2]``."""
    import argparse

    gpt, ddp, opt = model_and_optimizer(training, tp)  # first: its stand-ins come before megatron.core
    from megatron.core import dist_checkpointing

    step(ddp, opt, batches[0])
    model = gpt.sharded_state_dict()
    state = {"model": model, "optimizer": opt.sharded_state_dict(model, metadata=METADATA), "iteration": 1,
             "checkpoint_version": 3.0}
    if args is not None:
        state["args"] = argparse.Namespace(**args)
    path = Path(root) / "iter_0000001"
    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(path))
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text("1")
    return [step(ddp, opt, batches[1]), loss_of(ddp, batches[2])]


def _zero_state(opt) -> None:
    """Adam's state of a fresh optimizer, zeros at step 0, as its loading asks for (without Apex or
    Transformer Engine, megatron-core reads the step from torch's Adam state, which a fresh one lacks)."""
    for one in getattr(opt, "chained_optimizers", [opt]):
        inner = one.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                                  "step": torch.tensor(0.0)}


def _load_optimizer(opt, state: dict) -> None:
    """megatron-core's ``load_state_dict`` of its DistributedOptimizer, its fully_reshardable param state
    loaded with torch Adam's per-param ``step`` set aside: megatron-core 0.19.2 copies every tensor of a
    param's Adam state from the checkpoint, and torch's Adam (its optimizer without Apex or Transformer
    Engine) has a ``step`` tensor there that the format does not store (the step is in param_groups); and
    its ``load_state_dict`` gives every param one shared step tensor, which torch's Adam would advance
    once per param."""
    (one,) = getattr(opt, "chained_optimizers", [opt])
    param_state = state.pop("param_state")
    one.load_state_dict(state)  # param_groups, the step included
    steps = {p: s.pop("step") for p, s in one.optimizer.state.items()}
    one.load_parameter_state_from_fully_reshardable(param_state)
    for p, step in steps.items():  # one tensor each: torch's Adam adds 1 to it in place, param by param
        one.optimizer.state[p]["step"] = step.clone()


def load_step_rank(rank, world_size, ckpt_dir: str, training, batches, tp: int = 1) -> list:
    """A rank function: megatron-core's model and optimizer at ``tp`` load ``ckpt_dir`` strictly (every key
    of both sides), then its loss on ``batches[0]``, one step on it, its loss on ``batches[1]``."""
    gpt, ddp, opt = model_and_optimizer(training, tp, seed=99)  # other weights than any checkpoint's
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _zero_state(opt)
    model = gpt.sharded_state_dict()
    want = {"model": model, "optimizer": opt.sharded_state_dict(model, is_loading=True, metadata=METADATA)}
    state = dist_checkpointing.load(want, ckpt_dir, strict=StrictHandling.RAISE_ALL)
    gpt.load_state_dict(state["model"], strict=True)
    _load_optimizer(opt, state["optimizer"])
    return [step(ddp, opt, batches[0]), loss_of(ddp, batches[1])]
