"""One rank's training loop: build the shard, run iterations, report metrics.

An iteration: the global batch of iteration i is cut into ``dp`` contiguous slices, each
rank's slice into microbatches; the pipeline schedule (``parallel.pipeline_schedule``: 1F1B,
interleaved, ZB-H1 or the V-shaped ZBV, whose loss is on stage 0; plain gradient accumulation
when pp = 1) runs forwards and backwards; gradients are reduced once (dense over
dp-cp, sequence-parallel weights over tp-dp-cp, experts over expert-dp); AdamW steps. Each
microbatch's loss is ``sum(token losses) / tokens_in_global_batch`` (packed documents:
``sum(loss_mask x token losses) / loss tokens of the global batch``, :mod:`workers.train.packed`),
so the gradients summed over all ranks are exactly the single-process gradient of the global-batch
mean loss, and the reported loss is the same number whatever the layout.

Before the optimizer step the LR of this update is set from Megatron's schedule
(:class:`workers.train.lr_schedule.LRSchedule`, indexed by successful updates so far, so a step
the fp16 loss scaler skips does not advance it); the step unscales (fp16), takes the global
grad norm and clips by it (``training.clip_grad``), then updates the fp32 main params
(:mod:`workers.parallel.optimizer`). Evaluation (:mod:`workers.train.evaluation`) follows the
iterations Megatron evaluates after.

On the dense path an iteration makes one host sync: clipping, the non-finite-norm skip and
fp16's overflow skip are decided on the device (``AdamWOverGrads.step_on_device``), and the
loss, the grad norm and the skip flags are read together by one ``tolist`` at the end (MoE
layers add their own routing reads, evaluation its loss). On CUDA the batches go up from
pinned memory with ``non_blocking`` copies.

``train_step()`` returns the iteration's metrics, the same on every rank:

* ``iteration``: completed iterations; ``loss``: the global-batch LM loss (unscaled);
  ``moe_aux_loss``: the MoE load-balancing loss (None for a dense model);
* ``lr``: the LR applied by this iteration's update (Megatron's log line shows the next
  one, :meth:`LRSchedule.logged_lr`); on a skipped step, the LR it would have applied;
* ``grad_norm``: the global L2 norm of the gradient before clipping, ``nan``/``inf`` when it
  is not finite (no update then: the caller fails the job), ``None`` on an fp16 overflow step;
* ``loss_scale``: the loss scale this iteration's backward used (1.0 without fp16);
  ``skipped``: 1 if no update happened this iteration, else 0;
* ``val_loss``: the validation loss when evaluation ran after this iteration, else None;
* ``tokens_per_s``, ``step_time_s`` (training only, evaluation excluded), ``peak_mem_mb``.

With ``training.tensorboard_dir`` the last rank also writes them as TensorBoard scalars under
Megatron's names (:mod:`workers.train.tensorboard`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from workers.train import evaluation
from workers.config import JobConfig
from workers.grid import ParallelGrid
from workers.train.heap import peak_memory_mb, pin_mmap_threshold, release_free_heap
from workers.parallel.groups import ProcessGroups, build_process_groups
from workers.train.lr_schedule import LRSchedule
from workers.train.mixed_precision import DynamicGradScaler, compute_dtype
from workers.model.decoder import ModelChunk, ShardContext, local_positions
from workers.model.mtp import shifted_targets
from workers.train.objective import Objective, load_trainer_state, trainer_state
from workers.parallel import comm
from workers.parallel.context import cp_split
from workers.parallel.fp8 import Fp8Recipe, update_delayed_scales
from workers.parallel.optimizer import build_optimizer
from workers.parallel.pipeline import V_SHAPED, default_schedule, partition_layers, place, schedule, virtual_stage
from workers.parallel.pipeline_exec import run_pipeline
from workers.parallel.pipeline_p2p import plan_all
from workers.parallel.router import update_expert_biases
from workers.data.packing import PackedBatch
from workers.train.packed import local_batch, packed_iteration, sampler_of
from workers.train.tensorboard import EventWriter
from workers.train.reduce import global_aux_loss, global_loss_tensor, param_groups


class Trainer:
    """The model shard, optimizer and data position of one rank.

    Args:
        job: the job.
        rank: this rank (torch.distributed must be initialised when world_size > 1).
        world_size: ranks in the job (the job's own world size, or a resized one).
        device: where to compute; default CPU.
    """

    def __init__(self, job: JobConfig, rank: int, world_size: int, device: torch.device | None = None):
        self.job, self.rank = job, rank
        self.device = device or torch.device("cpu")
        pin_mmap_threshold()
        self.grid = ParallelGrid.from_config(job.parallel, world_size)
        t0 = (time.perf_counter(), time.process_time())
        self.groups: ProcessGroups = build_process_groups(
            self.grid, rank, hierarchical_cp=job.parallel.hierarchical_context_parallel_sizes
            if job.parallel.cp_comm_type == "a2a+p2p" else None)
        self.groups_s = (time.perf_counter() - t0[0], time.process_time() - t0[1])  # wall, CPU: a restart's timeline
        self.coords = self.grid.coords(rank)
        g, c, p = self.grid, self.coords, job.parallel
        t = job.training
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * g.dp)
        self.vpp = p.virtual_pipeline_model_parallel_size or 1
        self.stage = c["pp"]
        self.pipeline_schedule = p.pipeline_schedule or default_schedule(p.virtual_pipeline_model_parallel_size)
        self.v_shape = self.pipeline_schedule in V_SHAPED
        # The stage that computes the loss: the last, or stage 0 in the V shape.
        self.loss_stage = place(g.pp * self.vpp - 1, g.pp, self.v_shape)[0]
        pg = self.groups
        self.ctx = ShardContext(
            tp_group=pg.tp_group, cp_group=pg.cp_group, tp_cp_group=pg.tp_cp_group, cp_ranks=tuple(pg.ranks("cp")),
            ep_group=pg.ep_group, etp_group=pg.etp_group, sequence_parallel=p.sequence_parallel,
            cp_comm_type=p.cp_comm_type, seed=t.seed, fp8=Fp8Recipe.of(t, self.device),
            attention_dtype=torch.float64 if t.main_grads_dtype == "fp64" else None,
            hcp_groups=(pg.hcp_a2a_group, pg.hcp_p2p_group, tuple(pg.ranks("hcp_p2p")))
            if p.cp_comm_type == "a2a+p2p" else None,
        )
        positions = local_positions(job.model, self.ctx, c["cp"])
        layers = partition_layers(job.model.num_layers, g.pp, p.virtual_pipeline_model_parallel_size,
                                  v_shape=self.v_shape)[self.stage]
        pieces = [virtual_stage(self.stage, chunk, g.pp, self.v_shape) for chunk in range(self.vpp)]
        self.chunks = [
            ModelChunk(job.model, self.ctx, ids, positions=positions, pre_process=pieces[chunk] == 0,
                       post_process=pieces[chunk] == g.pp * self.vpp - 1).to(self.device)
            for chunk, ids in enumerate(layers)
        ]
        self.dtype = compute_dtype(t)
        self.grad_scaler = DynamicGradScaler(initial_scale=t.initial_loss_scale) if t.fp16 else None
        dp_groups, self.tied_buffer = param_groups(self.chunks, self.groups)
        self.optimizer = build_optimizer(
            dp_groups, distributed=p.use_distributed_optimizer, lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay,
            param_dtype=self.dtype, main_grads_dtype=torch.float64 if t.main_grads_dtype == "fp64" else torch.float32,
            clip_grad=t.clip_grad, grad_scaler=self.grad_scaler, tp_rank=c["tp"],
            norm_group=dist.group.WORLD if g.world_size > 1 else None, overlap_param_gather=p.overlap_param_gather,
        )
        self._gather_hooks = self.optimizer.hook_param_gather(self.chunks)
        for chunk in self.chunks:
            chunk.to(self.dtype)  # the params are cast already; this casts the rotary tables
        self.lr_schedule = LRSchedule.from_config(t)
        self.num_skipped = 0
        self.mtp_loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # Objective.mtp adds to it
        # Megatron's rule: the last rank (it holds the loss) writes TensorBoard.
        self.tensorboard = EventWriter(t.tensorboard_dir) if t.tensorboard_dir and rank == g.world_size - 1 else None
        self.packed, self.sampler = sampler_of(t, job.model.seq_length)  # packed: workers.train.packed
        self.tokens_per_iteration = t.global_batch_size * job.model.seq_length
        s_local = job.model.seq_length // g.cp // (g.tp if p.sequence_parallel else 1)
        self.activation_shape = (s_local, t.micro_batch_size, job.model.hidden_size)
        if g.pp > 1:
            # NCCL: batched p2p on a group whose communicator does not exist yet needs every
            # member to take part in that first call; one collective creates it up front.
            comm.all_reduce(torch.zeros(1, device=self.device), self.groups.pp_group)
        release_free_heap()

    def close(self) -> None:
        """Release what outlives a dropped reference: the gradient hooks (a param -> hook ->
        gradient buffer -> param cycle that keeps the model, and with it every process group,
        alive) and the TensorBoard file."""
        self.optimizer.grads.remove_hooks()
        for handle in self._gather_hooks:
            handle.remove()
        if self.tensorboard is not None:
            self.tensorboard.close()

    @property
    def iteration(self) -> int:
        return self.sampler.iteration

    def _sum_tied_grads(self) -> None:
        """Megatron's embedding-group all-reduce: the first stage's embedding and the last
        stage's copy get the sum of both grads (after the dp reduction), so they stay equal."""
        if self.tied_buffer is not None:
            self.optimizer.grads.finish()
            comm.all_reduce(self.optimizer.main_grads()[self.tied_buffer], self.groups.embedding_group)

    def _microbatch(self, mb: int):
        """This rank's (tokens, labels) of microbatch ``mb``, ``[s_local, micro_batch]`` each
        (packed: a :class:`~workers.train.packed.LocalBatch`)."""
        return self.local_slice(lambda start, count: self.sampler.batch(self.iteration, start, count), mb)

    def local_slice(self, read, mb: int, *, mtp: bool = False):
        """This rank's part of microbatch ``mb`` of a global batch: ``read(start, count)`` gives
        samples ``[start, start + count)`` as (tokens, labels) ``[count, seq]`` or a
        :class:`~workers.data.packing.PackedBatch`; the dp cut, the sequence-first transpose and the
        CP split are the training ones. With ``mtp``: those samples' MTP targets
        (:class:`workers.model.mtp.MTPTargets`) instead."""
        t, g, c = self.job.training, self.grid, self.coords
        per_dp = t.global_batch_size // g.dp
        start = c["dp"] * per_dp + mb * t.micro_batch_size
        batch = read(start, t.micro_batch_size)
        if isinstance(batch, PackedBatch):
            return local_batch(batch, g.cp, c["cp"], self._to_device)
        tokens, labels = batch
        tokens, labels = tokens.t(), labels.t()  # [s, b]: Megatron's sequence-first layout
        if mtp:  # shifted on the full sequence, then split: no CP exchange (workers.model.mtp)
            targets = shifted_targets(tokens, labels, self.job.model.mtp_num_layers)
            return targets.map(lambda x: (cp_split(x, g.cp, c["cp"], seq_dim=1) if g.cp > 1 else x).to(self.device))
        if g.cp > 1:
            tokens, labels = cp_split(tokens, g.cp, c["cp"]), cp_split(labels, g.cp, c["cp"])
        return self._to_device(tokens), self._to_device(labels)

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            # Pinned, so the copies are async DMA that overlap the previous microbatch's
            # kernels instead of blocking the host on pageable memory (the caching host
            # allocator keeps the pinned buffer alive until its copy has run).
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def train_step(self) -> dict:
        """Run one iteration (and the evaluation due after it); returns its metrics (see the
        module docstring), the same on every rank."""
        t0 = time.perf_counter()
        scale = self.grad_scaler.scale if self.grad_scaler is not None else 1.0
        for chunk in self.chunks:
            for layer in chunk.all_layers():
                # Each rank backpropagates its share of each microbatch's aux loss; the global
                # objective is the mean over the num_microbatches x dp microbatches (x the loss
                # scale, which rides on the aux gradient too, as Megatron's MoEAuxLossAutoScaler).
                layer.aux_scale = scale / (self.num_microbatches * self.grid.dp)
        self.optimizer.zero_grad()
        lr = self.lr_schedule.lr_for_update(self.optimizer.num_steps)
        self.optimizer.lr = lr
        self.mtp_loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        mb_losses = self.run_microbatches(self._microbatch, loss_scale=scale, forward_only=False)
        self._sum_tied_grads()
        update_delayed_scales(self.chunks, self.groups.tp_dp_cp_group)  # FP8 delayed scaling only
        pending = self.optimizer.step_on_device()
        mtp = [self._global_loss_tensor([self.mtp_loss_sum])] if self.job.model.mtp_num_layers else []
        # The iteration's one host read (dense path): loss, grad norm and skip flags together.
        loss_sum, *mtp, grad_norm, skipped, found_inf = torch.cat(
            [self._global_loss_tensor(mb_losses), *mtp, *pending.tensors()]).tolist()
        info = self.optimizer.finish_step(grad_norm, skipped, found_inf)
        # Aux-loss-free balancing: every expert bias moves by the global batch's loads.
        update_expert_biases(self.chunks, self.groups.tp_dp_cp_group)
        loss = loss_sum / scale  # a power of two: exact
        aux = self._global_aux_loss() if self.job.model.is_moe else None
        self.sampler.iteration += 1
        self.num_skipped += int(info.skipped)
        dt = time.perf_counter() - t0
        val_loss = evaluation.evaluate_if_due(self)
        metrics = {
            "iteration": self.iteration,
            "loss": loss,
            "moe_aux_loss": aux,
            "mtp_loss": mtp[0] if mtp else None,
            "lr": lr,
            "grad_norm": info.grad_norm,
            "loss_scale": scale,
            "skipped": int(info.skipped),
            "val_loss": val_loss,
            "step_time_s": dt,
            "tokens_per_s": self.tokens_per_iteration / dt,
            "peak_mem_mb": peak_memory_mb(self.device),
        }
        if hasattr(self.sampler, "batch_stats"):  # chat data: loss tokens, packing efficiency, loss-token share
            metrics.update(self.sampler.batch_stats(self.iteration - 1))
        if self.tensorboard is not None:
            self.tensorboard.write_metrics(metrics)
        return metrics

    def run_microbatches(self, microbatch, *, loss_scale: float = 1.0, forward_only: bool = False):
        """Run this stage's schedule over ``microbatch(mb) -> (tokens, labels)`` (or a packed
        :class:`~workers.train.packed.LocalBatch`); returns the last stage's per-microbatch losses
        (each ``sum(token losses) / tokens_per_iteration``, or over the loss tokens, times ``loss_scale``)."""
        from workers.parallel.pipeline import schedule_forward_only

        vpp_cfg = self.job.parallel.virtual_pipeline_model_parallel_size
        make = schedule_forward_only if forward_only else schedule
        tables = [make(self.num_microbatches, self.grid.pp, vpp_cfg, s, self.pipeline_schedule)
                  for s in range(self.grid.pp)]
        actions = tables[self.stage]
        chunks, denominator = self.chunks, self.tokens_per_iteration
        if self.packed:
            microbatch, chunks, denominator = packed_iteration(
                microbatch, self.num_microbatches, self.chunks, actions, self.groups.dp_cp_group,
                last_stage=self.stage == self.loss_stage)
        objective = Objective(self, microbatch, denominator, loss_scale=loss_scale, forward_only=forward_only)
        return run_pipeline(
            actions, stage=self.stage, pp=self.grid.pp, vpp=self.vpp, pp_ranks=self.groups.ranks("pp"),
            chunks=chunks, num_microbatches=self.num_microbatches, get_input=objective.get_input,
            loss_fn=objective.loss,
            tensor_shape=self.activation_shape, dtype=self.dtype, group=self.groups.pp_group, device=self.device,
            before_last_backward=None if forward_only else (
                lambda chunk: self.optimizer.grads.arm(self.chunks[chunk].parameters())),
            forward_only=forward_only, v_shape=self.v_shape,
            plan=plan_all(tables, self.vpp, self.v_shape)[self.stage] if self.v_shape else None,
        )

    def global_loss(self, mb_losses: list[torch.Tensor]) -> float:
        """The global batch's mean loss from this rank's microbatch losses (what :meth:`run_microbatches`
        returned): the last stage's sum over dp-cp, shared along the pipeline. A collective."""
        return float(self._global_loss_tensor(mb_losses).item())

    def _global_loss_tensor(self, mb_losses: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`global_loss` left on the device (:func:`workers.train.reduce.global_loss_tensor`)."""
        return global_loss_tensor(mb_losses, last_stage=self.stage == self.loss_stage, pg=self.groups,
                                  device=self.device)

    def _global_aux_loss(self) -> float:
        return global_aux_loss(self.chunks, microbatches=self.num_microbatches * self.grid.dp,
                               tp_replicas=1 if self.job.parallel.sequence_parallel else self.grid.tp,
                               world_size=self.grid.world_size, device=self.device)

    # -- checkpoint hooks (workers/checkpoint/checkpointer.py stores the tensors; this is the rest) --------
    def state_for_checkpoint(self) -> dict:
        """:func:`workers.train.objective.trainer_state` (restored by :meth:`load_state_from_checkpoint`)."""
        return trainer_state(self)

    def load_state_from_checkpoint(self, state: dict) -> None:
        load_trainer_state(self, state)
