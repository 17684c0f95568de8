"""Sharded, atomic, layout-independent checkpoints of a :class:`workers.train.trainer.Trainer`.

Every rank writes its shard of the model and of Adam's moments, by logical parameter name
with the box each piece holds (:mod:`workers.checkpoint.layout`), so a checkpoint saved at
one layout loads into any other valid layout of the same model: tp, pp, vpp, cp, ep, etp,
dp, and the distributed optimizer on or off. A copy held by several ranks (TP-replicated
norms, DP replicas) is written once, by one owner chosen at the first save so that the bytes
spread evenly over the ranks. Beside the tensors: the trainer state (data position, successful
updates, the LR schedule's position, skipped steps, the fp16 loss scaler:
:meth:`Trainer.state_for_checkpoint`) and each rank's RNG states.

Files of ``iter_0000010/``: ``rank_00003.bin`` (the rank's pieces, raw, back to back),
``rank_00003.json`` (what they are, their CRC-32s, the rank's RNG), ``index.json`` (every
piece, merged by rank 0) and ``manifest.json`` (written last: every file with size and
CRC-32, the model config, the layout, the trainer state). Atomicity and discovery:
:mod:`workers.checkpoint.storage`. Reading: :mod:`workers.checkpoint.reader`.

The fp32 parameters are the optimizer's master copy (the distributed optimizer re-reads its
master from them), so they are stored once, as the model; a bf16/fp16 model (its params are
the rounded copy) adds its fp32 main params under ``optim/master/``, laid out as the moments
(param boxes, or the distributed optimizer's flat ranges).

Async saves (``async_save=True``): :meth:`Checkpointer.save` copies this rank's pieces (on
the CPU) and returns; a background thread writes them, and on rank 0 then waits for every
rank's files and commits. Guarantee: the checkpoint holds the state at the ``save()`` call;
it is complete once :meth:`Checkpointer.wait` returns on rank 0; the next ``save()`` and
``close()`` wait for the previous one first; a crash before the commit leaves the previous
checkpoint as the latest. The background thread issues no collectives.
"""

from __future__ import annotations

import base64
import json
import math
import random
import time
import uuid
from dataclasses import asdict, dataclass

import numpy as np
import torch

from workers.checkpoint.background import Background
from workers.checkpoint.layout import ParamView, buffer_views, param_views
from workers.checkpoint.storage import (FORMAT, MANIFEST, VERSION, Storage, checkpoint_name, crc32,
                                        list_checkpoints, prune, retained, wait_for_files)
from workers.grid import COORDS


@dataclass(frozen=True)
class Piece:
    """What one stored piece is: a box (or a flat range of it) of a logical tensor."""

    key: str  # "model/<name>", "optim/exp_avg/<name>", "optim/exp_avg_sq/<name>"
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    flat: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return self.flat[1] - self.flat[0] if self.flat else int(np.prod(self.lengths, dtype=np.int64))


def local_pieces(trainer) -> list[tuple[Piece, torch.Tensor]]:
    """Every piece this rank holds, with a view of its live data (model and its buffers such as
    the MoE expert biases, then moments)."""
    views = param_views(trainer)
    out = [(Piece(f"model/{v.name}", v.shape, v.box.offsets, v.box.lengths), v.logical(v.param.detach()))
           for v in views + buffer_views(trainer)]
    opt = trainer.optimizer
    by_id = {id(v.param): v for v in views}
    master = getattr(opt, "low_precision", False)
    if hasattr(opt, "moments"):  # ReplicatedOptimizer: full moments per param
        for buf, moments, masters in zip(opt.grads.buffers, opt.moments, opt.masters):
            for p, m, main in zip(buf.params, moments, masters):
                v = by_id[id(p)]
                state = {**m, **({"master": main} if master else {})}
                out += [(Piece(f"optim/{k}/{v.name}", v.shape, v.box.offsets, v.box.lengths), v.logical(t))
                        for k, t in state.items()]
    else:  # DistributedOptimizer: flat ranges of params
        keys = ("exp_avg", "exp_avg_sq") + (("param",) if master else ())
        for buf, shard in zip(opt.grads.buffers, opt.shards):
            for p, a, b, s in buf.pieces():
                v = by_id[id(p)]
                b = min(b, v.box.numel)  # the rest is vocab padding
                if a < b:
                    out += [(Piece(f"optim/{_KEY.get(k, k)}/{v.name}", v.shape, v.box.offsets, v.box.lengths, (a, b)),
                             shard[k][s : s + b - a]) for k in keys]
    return out


_KEY = {"param": "master"}  # the distributed optimizer's name for its fp32 main params
# the optimizer's hyperparameters kept in the manifest (an export to Megatron-Core writes them)
OPTIMIZER_FIELDS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")


def assign_owners(per_rank: list[list[tuple[Piece, int]]]) -> list[set[Piece]]:
    """Who writes each piece: one holder per distinct piece, the one with the fewest bytes
    assigned so far (largest pieces first, ties to the lowest rank). Deterministic, so every
    rank computes the same plan from the same gathered list."""
    holders: dict[Piece, list[int]] = {}
    size: dict[Piece, int] = {}
    for rank, pieces in enumerate(per_rank):
        for piece, nbytes in pieces:
            holders.setdefault(piece, []).append(rank)
            size[piece] = nbytes
    load = [0] * len(per_rank)
    owned: list[set[Piece]] = [set() for _ in per_rank]
    for piece in sorted(holders, key=lambda p: (-size[p], p.key, p.offsets, p.flat or (0, 0))):
        rank = min(holders[piece], key=lambda r: (load[r], r))
        load[rank] += size[piece]
        owned[rank].add(piece)
    return owned


def rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "python": repr(random.getstate()), "numpy": repr(_np_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _np_state():
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return name, keys.tolist(), pos, has_gauss, gauss


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    random.setstate(_literal(state["python"]))
    name, keys, pos, has_gauss, gauss = _literal(state["numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def _literal(text: str):
    import ast

    return ast.literal_eval(text)


def _rank_file(rank: int, ext: str) -> str:
    return f"rank_{rank:05d}.{ext}"


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


class Checkpointer:
    """Saves a trainer's checkpoints under one root; every rank of the job makes one.

    One per trainer: the first save fixes who writes which piece of this layout.

    Args:
        uri: the checkpoint root (``checkpoint.dir``): a path or a pyarrow URI.
        keep_last: complete checkpoints to keep (older ones are pruned after each commit).
        keep_best: besides those, the checkpoints with the lowest ``best_metric`` to keep.
        best_metric: ``val_loss`` or ``lm_loss``, as given to :meth:`save` with each checkpoint.
        async_save: write in a background thread (see the module docstring).
        timeout_s: how long rank 0 waits for the other ranks' files before giving up.
    """

    def __init__(self, uri: str, *, keep_last: int = 2, keep_best: int = 0, best_metric: str = "val_loss",
                 async_save: bool = False, timeout_s: float = 600.0):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last {keep_last} must be >= 1 (the checkpoint to restart from)")
        self.root = Storage.from_uri(uri)
        self.keep_last, self.keep_best, self.best_metric = keep_last, keep_best, best_metric
        self.rank, self.world_size = 0, 1
        self.async_save, self.timeout_s = async_save, timeout_s
        self._owned: set[Piece] | None = None
        self._pieces: tuple[Piece, ...] | None = None
        self._background = Background()
        self.last_committed: str | None = None  # rank 0: where the last checkpoint was committed
        self.last_stats: dict = {}
        self._retention: dict | None = None  # rank 0: what the last commit kept and pruned, until taken

    def save(self, trainer, metrics: dict | None = None) -> None:
        """Save ``trainer`` now; every rank calls it at the same iteration (it is collective
        the first time, to agree who writes what, and each time, for a fresh nonce). ``metrics``:
        the iteration's ``val_loss`` and ``lm_loss``, kept in the manifest for ``keep_best``."""
        self.wait()
        t0 = time.perf_counter()
        pieces = local_pieces(trainer)
        layout = tuple(piece for piece, _ in pieces)
        if self._owned is None:
            self.rank, self.world_size = trainer.rank, trainer.grid.world_size
            self._owned, self._pieces = self._plan(pieces), layout
        elif layout != self._pieces:
            raise ValueError("this Checkpointer planned the writes of another trainer's layout; "
                             "make one Checkpointer per Trainer")
        # The snapshot: a CPU copy of what this rank writes, so training can go on at once.
        mine = [(piece, data.detach().to("cpu", copy=True)) for piece, data in pieces if piece in self._owned]
        meta = {"iteration": trainer.iteration, "model": asdict(trainer.job.model),
                "layout": {**{k: getattr(trainer.grid, k) for k in COORDS},
                           "etp": trainer.grid.etp, "vpp": trainer.vpp, "world_size": self.world_size,
                           "use_distributed_optimizer": trainer.job.parallel.use_distributed_optimizer},
                "trainer_state": trainer.state_for_checkpoint(), "rng": rng_state(),
                "training": {k: getattr(trainer.job.training, k) for k in OPTIMIZER_FIELDS},
                "metrics": {k: float(v) for k, v in (metrics or {}).items()
                            if k in ("val_loss", "lm_loss") and isinstance(v, (int, float)) and math.isfinite(v)}}
        tmp = f".{checkpoint_name(trainer.iteration)}.tmp-{self._nonce()}"
        self.last_stats = {"snapshot_s": time.perf_counter() - t0}
        if self.async_save:
            self._background.start(self._run, tmp, mine, meta)
        else:
            self._run(tmp, mine, meta)
            if self.world_size > 1 and torch.distributed.is_initialized():
                torch.distributed.barrier()  # a synchronous save returns once it is committed

    def wait(self) -> None:
        """Block until the pending save is written (and, on rank 0, committed); re-raises its error."""
        self._background.wait()

    close = wait

    def take_retention(self) -> dict | None:
        """Rank 0, once per commit: ``{"iteration", "kept": [{"iteration", "why"}], "pruned": [names]}``
        of the last committed save (None when nothing was committed since the last call)."""
        retention, self._retention = self._retention, None
        return retention

    def _plan(self, pieces) -> set[Piece]:
        sized = [(piece, data.numel() * data.element_size()) for piece, data in pieces]
        if self.world_size > 1 and torch.distributed.is_initialized():
            gathered = [None] * self.world_size
            torch.distributed.all_gather_object(gathered, sized)
        else:
            gathered = [sized]
        return assign_owners(gathered)[self.rank]

    def _nonce(self) -> str:
        nonce = [uuid.uuid4().hex[:12]]
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(nonce, src=0)
        return nonce[0]

    def _run(self, tmp: str, mine, meta: dict) -> None:
        t0 = time.perf_counter()
        directory = self.root.join(tmp)
        self.root.makedirs(directory)
        self._write_rank(directory, mine, meta)
        self.last_stats.update(write_s=time.perf_counter() - t0,
                               bytes=sum(d.numel() * d.element_size() for _, d in mine))
        if self.rank == 0:
            self._commit(tmp, meta)
            self.last_stats["commit_s"] = time.perf_counter() - t0

    def _write_rank(self, directory: str, mine, meta: dict) -> None:
        entries, offset = [], 0
        for piece, data in mine:
            nbytes = data.numel() * data.element_size()
            entries.append({"key": piece.key, "shape": piece.shape, "offsets": piece.offsets,
                            "lengths": piece.lengths, "flat": piece.flat, "dtype": str(data.dtype).removeprefix("torch."),
                            "offset": offset, "nbytes": nbytes, "crc32": crc32(_bytes(data))})
            offset += nbytes
        data_file = _rank_file(self.rank, "bin")
        size, value = self.root.write(f"{directory}/{data_file}", (_bytes(d) for _, d in mine))
        record = {"rank": self.rank, "file": data_file, "size": size, "crc32": value, "pieces": entries,
                  "rng": meta["rng"]}
        # Written last: its presence tells rank 0 that this rank is done.
        self.root.write_json(f"{directory}/{_rank_file(self.rank, 'json')}", record)

    def _commit(self, tmp: str, meta: dict) -> None:
        directory = self.root.join(tmp)
        names = [_rank_file(r, "json") for r in range(self.world_size)]
        wait_for_files(self.root, directory, names, self.timeout_s)
        files, index = {}, []
        for name in names:
            raw = self.root.read(f"{directory}/{name}")
            record = json.loads(raw)
            files[name] = {"size": len(raw), "crc32": crc32(raw)}
            files[record["file"]] = {"size": record["size"], "crc32": record["crc32"]}
            index += [{**e, "file": record["file"]} for e in record["pieces"]]
        size, value = self.root.write_json(f"{directory}/index.json", index)
        files["index.json"] = {"size": size, "crc32": value}
        manifest = {"format": FORMAT, "version": VERSION, "created_unix": time.time(), "files": files,
                    **{k: v for k, v in meta.items() if k != "rng"}}
        self.root.write_json(f"{directory}/{MANIFEST}", manifest)  # the commit point
        final = self.root.rename_dir(directory, self.root.join(checkpoint_name(meta["iteration"])))
        self.last_committed = final
        pruned = prune(self.root, self.keep_last, meta["iteration"], keep_best=self.keep_best,
                       best_metric=self.best_metric)
        kept = retained(list_checkpoints(self.root), self.keep_last, self.keep_best, self.best_metric)
        self._retention = {"iteration": meta["iteration"], "pruned": pruned,
                           "kept": [{"iteration": it, "why": why} for it, why in kept.items()]}


__all__ = ["Checkpointer", "Piece", "ParamView", "local_pieces", "set_rng_state"]
