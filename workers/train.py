"""One rank's training loop: build the shard, run iterations, report metrics.

An iteration: the global batch of iteration i is cut into ``dp`` contiguous slices, each
rank's slice into microbatches; the pipeline schedule (1F1B, interleaved, or plain gradient
accumulation when pp = 1) runs forwards and backwards; gradients are reduced once (dense over
dp-cp, sequence-parallel weights over tp-dp-cp, experts over expert-dp); AdamW steps. Each
microbatch's loss is ``sum(token losses) / tokens_in_global_batch``, so the gradients summed
over all ranks are exactly the single-process gradient of the global-batch mean loss, and the
reported loss is the same number whatever the layout.
"""

from __future__ import annotations

import resource
import time

import torch

from workers.config import JobConfig
from workers.dataset import GlobalSampler
from workers.grid import ParallelGrid
from workers.groups import ProcessGroups, build_process_groups
from workers.model import ModelChunk, ShardContext, local_positions
from workers.parallel import comm
from workers.parallel.context import cp_split
from workers.parallel.optimizer import build_optimizer
from workers.parallel.pipeline import partition_layers, schedule
from workers.parallel.pipeline_exec import run_pipeline
from workers.parallel.tensor import vocab_parallel_cross_entropy


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
        self.grid = ParallelGrid.from_config(job.parallel, world_size)
        self.groups: ProcessGroups = build_process_groups(self.grid, rank)
        self.coords = self.grid.coords(rank)
        g, c, p = self.grid, self.coords, job.parallel
        t = job.training
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * g.dp)
        self.vpp = p.virtual_pipeline_model_parallel_size or 1
        self.stage = c["pp"]
        self.ctx = ShardContext(
            tp_group=self.groups.tp, cp_group=self.groups.cp, tp_cp_group=self.groups.tp_cp, cp_ranks=tuple(self.groups.ranks("cp")),
            ep_group=self.groups.ep, etp_group=self.groups.etp, sequence_parallel=p.sequence_parallel,
            cp_comm_type=p.cp_comm_type, seed=t.seed,
        )
        positions = local_positions(job.model, self.ctx, c["cp"])
        layers = partition_layers(job.model.num_layers, g.pp, p.virtual_pipeline_model_parallel_size)[self.stage]
        self.chunks = [
            ModelChunk(job.model, self.ctx, ids, positions=positions,
                       pre_process=(chunk == 0 and self.stage == 0),
                       post_process=(chunk == self.vpp - 1 and self.stage == g.pp - 1)).to(self.device)
            for chunk, ids in enumerate(layers)
        ]
        self.optimizer = build_optimizer(
            self._param_groups(), distributed=p.use_distributed_optimizer, lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay,
        )
        self.sampler = GlobalSampler(t.data, job.model.seq_length, t.seed, t.global_batch_size)
        self.tokens_per_iteration = t.global_batch_size * job.model.seq_length
        s_local = job.model.seq_length // g.cp // (g.tp if p.sequence_parallel else 1)
        self.activation_shape = (s_local, t.micro_batch_size, job.model.hidden_size)
        if g.pp > 1:
            # NCCL: batched p2p on a group whose communicator does not exist yet needs every
            # member to take part in that first call; one collective creates it up front.
            comm.all_reduce(torch.zeros(1, device=self.device), self.groups.pp)

    @property
    def iteration(self) -> int:
        return self.sampler.iteration

    def _param_groups(self):
        """Dense params reduce over dp-cp; weights applied to sequence shards (norms, routers
        with SP) over tp-dp-cp, since their TP ranks saw different tokens; experts over expert-dp."""
        dense, seq, expert = [], [], []
        for chunk in self.chunks:
            for prm in chunk.parameters():
                if getattr(prm, "is_expert", False):
                    expert.append(prm)
                elif getattr(prm, "sequence_parallel", False):
                    seq.append(prm)
                else:
                    dense.append(prm)
        g = self.groups
        groups = [(dense, g.dp_cp), (seq, g.tp_dp_cp), (expert, g.expert_dp)]
        return [(params, group) for params, group in groups if params]

    def _microbatch(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (tokens, labels) of microbatch ``mb``, ``[s_local, micro_batch]`` each."""
        t, g, c = self.job.training, self.grid, self.coords
        per_dp = t.global_batch_size // g.dp
        start = c["dp"] * per_dp + mb * t.micro_batch_size
        tokens, labels = self.sampler.batch(self.iteration, start, t.micro_batch_size)
        tokens, labels = tokens.t(), labels.t()  # [s, b]: Megatron's sequence-first layout
        if g.cp > 1:
            tokens, labels = cp_split(tokens, g.cp, c["cp"]), cp_split(labels, g.cp, c["cp"])
        return tokens.to(self.device), labels.to(self.device)

    def train_step(self) -> dict:
        """Run one iteration; returns its metrics (the loss on every rank)."""
        t0 = time.perf_counter()
        for chunk in self.chunks:
            for layer in chunk.layers:
                # Each rank backpropagates its share of each microbatch's aux loss; the global
                # objective is the mean over the num_microbatches x dp microbatches.
                layer.aux_scale = 1.0 / (self.num_microbatches * self.grid.dp)
        self.optimizer.zero_grad()
        actions = schedule(self.num_microbatches, self.grid.pp, self.job.parallel.virtual_pipeline_model_parallel_size,
                           self.stage)
        labels: dict[int, torch.Tensor] = {}

        def get_input(mb: int) -> torch.Tensor:
            tokens, labels[mb] = self._microbatch(mb)
            return tokens

        def loss_fn(mb: int, logits: torch.Tensor) -> torch.Tensor:
            target = labels.pop(mb) if mb in labels else self._microbatch(mb)[1]
            losses = vocab_parallel_cross_entropy(logits, target, self.groups.tp)
            return losses.sum() / self.tokens_per_iteration

        mb_losses = run_pipeline(
            actions, stage=self.stage, pp=self.grid.pp, vpp=self.vpp, pp_ranks=self.groups.ranks("pp"),
            chunks=self.chunks, num_microbatches=self.num_microbatches, get_input=get_input, loss_fn=loss_fn,
            tensor_shape=self.activation_shape, group=self.groups.pp, device=self.device,
            before_last_backward=lambda chunk: self.optimizer.grads.arm(self.chunks[chunk].parameters()),
        )
        self.optimizer.step()
        loss = self._global_loss(mb_losses)
        aux = self._global_aux_loss() if self.job.model.is_moe else None
        self.sampler.iteration += 1
        dt = time.perf_counter() - t0
        return {
            "iteration": self.iteration,
            "loss": loss,
            "moe_aux_loss": aux,
            "step_time_s": dt,
            "tokens_per_s": self.tokens_per_iteration / dt,
            "peak_mem_mb": peak_memory_mb(self.device),
        }

    def _global_loss(self, mb_losses: list[torch.Tensor]) -> float:
        """Sum the last stage's microbatch losses over dp-cp, then share it along the pipeline."""
        last = self.stage == self.grid.pp - 1
        value = torch.stack(mb_losses).sum() if last else torch.zeros((), device=self.device)
        value = value.reshape(1).to(torch.float64)
        if last:
            comm.all_reduce(value, self.groups.dp_cp)
        comm.all_reduce(value, self.groups.pp)  # other stages hold 0
        return float(value.item())

    def _global_aux_loss(self) -> float:
        """The MoE load-balancing loss (summed over layers, averaged over microbatches),
        reported apart from the LM loss: every rank's shares, summed over the world. Without
        SP the TP ranks compute the same share, so it is counted once per TP group."""
        import torch.distributed as dist

        local = sum(chunk.pop_aux_loss() for chunk in self.chunks)
        replicas = 1 if self.job.parallel.sequence_parallel else self.grid.tp
        value = torch.tensor([local / (self.num_microbatches * self.grid.dp * replicas)], dtype=torch.float64,
                             device=self.device)
        if self.grid.world_size > 1:
            comm.all_reduce(value, dist.group.WORLD)
        return float(value.item())

    # -- checkpoint hooks (workers/checkpoint.py stores the tensors; this is the rest) --------
    def state_for_checkpoint(self) -> dict:
        """JSON-able trainer state beside the tensors; add the LR schedule's and the loss
        scaler's state here when they exist (``load_state_from_checkpoint`` restores them)."""
        return {"sampler": self.sampler.state_dict(), "optimizer_steps": self.optimizer.num_steps,
                "lr": self.optimizer.lr}

    def load_state_from_checkpoint(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.optimizer.num_steps = int(state["optimizer_steps"])


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
