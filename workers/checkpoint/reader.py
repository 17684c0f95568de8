"""Reading a checkpoint into a trainer of any layout.

:func:`load_checkpoint` is what a rank does at start when the job has ``checkpoint.load`` (or
restarts): build the :class:`~workers.train.trainer.Trainer` as usual (its O(shard) init is cheap),
then overwrite every parameter, Adam moment and the trainer state from a source. A source is
anything with the :class:`CheckpointReader` interface (``model``, ``trainer_state``, ``has``,
``shape``, ``read``): a raytron checkpoint here, a Hugging Face directory
(:class:`workers.hf.interop.HFReader`), which has weights only, or a Megatron-Core checkpoint
(:class:`workers.checkpoint.megatron_import.MegatronReader`), which may add Adam's state and step
(``optimizer_steps``) but no trainer state.

A rank reads just the pieces that overlap its boxes (``read_at``, never whole files) and
checks each piece's CRC-32; the manifest (file sizes) and the index (its CRC-32) are checked
when the checkpoint is opened. :meth:`CheckpointReader.verify` checks every file's CRC-32.
"""

from __future__ import annotations

import json
import math

import torch

from workers.checkpoint.checkpointer import set_rng_state
from workers.checkpoint.layout import Box, buffer_views, fill, param_views
from workers.checkpoint.storage import MANIFEST, Storage, crc32, latest_checkpoint, read_manifest
from workers.grid import COORDS
from workers.parallel.fp8 import delayed_state_loaded

# ModelConfig fields that must agree between a checkpoint and the job that loads it: the
# shapes, and the function the weights were trained for. (seq_length may change.)
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "vocab_size", "num_moe_experts", "moe_router_topk", "rotary_base", "norm_epsilon",
                "add_qkv_bias", "qk_layernorm", "kv_channels", "untie_embeddings_and_output_weights")
MODEL_FIELDS += ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_score_function",
                 "moe_layer_freq")  # MoE routing (issue 21)
MODEL_FIELDS += ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                 "v_head_dim", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
                 "beta_fast", "beta_slow")  # MLA and YaRN (issue 21)


class CheckpointReader:
    """One complete raytron checkpoint directory, opened and checked.

    Raises:
        ValueError: incomplete or damaged (see :func:`read_manifest`).
    """

    def __init__(self, ckpt: Storage):
        self.storage = ckpt
        self.manifest = read_manifest(ckpt)
        raw = ckpt.read(ckpt.join("index.json"))
        if crc32(raw) != self.manifest["files"]["index.json"]["crc32"]:
            raise ValueError(f"{ckpt.join('index.json')}: CRC-32 mismatch; the checkpoint is damaged")
        self.pieces: dict[str, list[dict]] = {}
        for entry in json.loads(raw):
            self.pieces.setdefault(entry["key"], []).append(entry)
        self._files = {}

    @classmethod
    def open(cls, uri: str) -> "CheckpointReader":
        """A checkpoint directory, or the latest complete checkpoint under a root."""
        storage = Storage.from_uri(uri)
        if MANIFEST in storage.sizes(storage.root):
            return cls(storage)
        latest = latest_checkpoint(storage)
        if latest is None:
            raise ValueError(f"no complete checkpoint under {uri!r} (incomplete saves are ignored); "
                             f"check checkpoint.load / checkpoint.dir")
        return cls(latest.storage)

    @property
    def model(self) -> dict:
        return self.manifest["model"]

    @property
    def trainer_state(self) -> dict | None:
        return self.manifest["trainer_state"]

    @property
    def iteration(self) -> int:
        return int(self.manifest["iteration"])

    def has(self, key: str) -> bool:
        return key in self.pieces

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.pieces[key][0]["shape"])

    def rank_state(self, rank: int) -> dict:
        return json.loads(self.storage.read(self.storage.join(f"rank_{rank:05d}.json")))

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The ``box`` of logical tensor ``key``, assembled from every piece that overlaps it."""
        if key not in self.pieces:
            raise ValueError(f"checkpoint {self.storage.root} has no tensor {key!r}")
        out = torch.empty(box.lengths, dtype=torch.float32)
        covered = torch.zeros(box.lengths, dtype=torch.bool)
        for e in self.pieces[key]:
            piece_box = Box(tuple(e["offsets"]), tuple(e["lengths"]))
            if box.intersect(piece_box) is None:
                continue
            raw = self._file(e["file"]).read_at(e["nbytes"], e["offset"])
            if crc32(raw) != e["crc32"]:
                raise ValueError(f"{self.storage.join(e['file'])}: CRC-32 mismatch in {key} at byte {e['offset']}; "
                                 f"the checkpoint is damaged, load an earlier one")
            data = torch.frombuffer(bytearray(raw), dtype=getattr(torch, e["dtype"]))
            fill(out, box, piece_box, data, tuple(e["flat"]) if e["flat"] else None, covered)
        if not bool(covered.all()):
            raise ValueError(f"checkpoint {self.storage.root}: {key} box {box} is not fully covered by its pieces")
        return out

    def _file(self, name: str):
        if name not in self._files:
            self._files[name] = self.storage.fs.open_input_file(self.storage.join(name))
        return self._files[name]

    def verify(self) -> None:
        """Check every file's CRC-32 against the manifest (reads the whole checkpoint)."""
        for name, entry in self.manifest["files"].items():
            if crc32(self.storage.read(self.storage.join(name))) != entry["crc32"]:
                raise ValueError(f"{self.storage.join(name)}: CRC-32 mismatch; the checkpoint is damaged")


def check_model(source, model_config, where: str) -> None:
    """Refuse a source whose model differs from the job's, naming every differing field."""
    mine = {k: getattr(model_config, k) for k in MODEL_FIELDS}
    theirs = source.model
    diff = [f"model.{k}: {theirs.get(k)!r} there, {mine[k]!r} in this job" for k in MODEL_FIELDS
            if k in theirs and _differs(theirs[k], mine[k])]
    if diff:
        raise ValueError(f"{where} holds another model ({'; '.join(diff)}); load a checkpoint of this model "
                         f"or set those model fields to the checkpoint's")


def _differs(a, b) -> bool:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):  # JSON gives lists for tuples
        return not isinstance(a, (list, tuple)) or not isinstance(b, (list, tuple)) or list(a) != list(b)
    if isinstance(a, float) or isinstance(b, float):
        return a is None or b is None or abs(float(a) - float(b)) > 1e-12 * max(abs(float(a)), 1.0)
    return a != b


@torch.no_grad()
def load_checkpoint(trainer, source) -> dict:
    """Load ``source`` (a reader, or a checkpoint directory or root) into ``trainer``, whatever
    the layout either was saved at. Every rank calls it; it issues no collectives.

    Returns:
        ``{"iteration", "path"}``: where training resumes.
    """
    if isinstance(source, str):
        source = CheckpointReader.open(source)
    where = getattr(source, "storage", None)
    where = where.uri if where is not None else str(getattr(source, "path", "the source"))
    check_model(source, trainer.job.model, where)
    views = param_views(trainer)
    for v in views:
        key = f"model/{v.name}"
        if not source.has(key):
            raise ValueError(f"{where} has no weight {v.name!r}; it is not a checkpoint of this model")
        if source.shape(key) != v.shape:
            raise ValueError(f"{where}: {v.name} has shape {source.shape(key)}, this model needs {v.shape}; "
                             f"it is a checkpoint of another model")
        v.assign(v.param.detach(), source.read(key, v.box))
    for v in buffer_views(trainer):  # MoE expert biases, FP8 amax histories; a source without them leaves zeros
        if source.has(f"model/{v.name}"):
            v.assign(v.param, source.read(f"model/{v.name}", v.box))
    delayed_state_loaded(trainer.chunks)
    _load_optimizer(trainer, views, source)
    state = source.trainer_state
    if state is not None:
        trainer.load_state_from_checkpoint(state)
        _load_rng(trainer, source)
    elif getattr(source, "optimizer_steps", None):  # a Megatron-Core optimizer's step: Adam's bias
        trainer.optimizer.num_steps = int(source.optimizer_steps)  # correction and the LR schedule go on
    return {"iteration": trainer.iteration, "path": where}


def _master_key(source, name: str) -> str:
    """Where a bf16/fp16 trainer's fp32 main params come from: the saved main params of a
    mixed-precision checkpoint, else the (fp32) weights of an fp32 checkpoint or HF model."""
    return f"optim/master/{name}" if source.has(f"optim/master/{name}") else f"model/{name}"


def _load_optimizer(trainer, views, source) -> None:
    opt = trainer.optimizer
    has_moments = source.has(f"optim/exp_avg/{views[0].name}")
    low = getattr(opt, "low_precision", False)
    by_id = {id(v.param): v for v in views}
    if hasattr(opt, "moments"):  # replicated: moments are param-shaped
        for buf, moments, masters in zip(opt.grads.buffers, opt.moments, opt.masters):
            for p, m, main in zip(buf.params, moments, masters):
                v = by_id[id(p)]
                if low:
                    v.assign(main, source.read(_master_key(source, v.name), v.box))
                for k in ("exp_avg", "exp_avg_sq"):
                    if has_moments:
                        v.assign(m[k], source.read(f"optim/{k}/{v.name}", v.box))
                    else:
                        m[k].zero_()
        return
    for buf, shard in zip(opt.grads.buffers, opt.shards):
        # fp32: the model params (read above) are the main params; no "param" in the shard.
        for k in ("exp_avg", "exp_avg_sq", "param"):
            if k not in shard:
                continue
            shard[k].zero_()
            if k != "param" and not has_moments:
                continue
            for p, a, b, s in buf.pieces():
                v = by_id[id(p)]
                b = min(b, v.box.numel)
                if a < b:
                    # Read only the rows that hold flat elements [a, b), ~1/dp of the box.
                    row = math.prod(v.box.lengths[1:])
                    r0, r1 = a // row, -(-b // row)
                    rows = Box((v.box.offsets[0] + r0, *v.box.offsets[1:]), (r1 - r0, *v.box.lengths[1:]))
                    key = _master_key(source, v.name) if k == "param" else f"optim/{k}/{v.name}"
                    flat = source.read(key, rows).reshape(-1)
                    shard[k][s : s + b - a].copy_(flat[a - r0 * row : b - r0 * row])


def _load_rng(trainer, source) -> None:
    """Each rank takes its own RNG state when the layout is the one saved; otherwise rank
    0's (no RNG stream is consumed in training today: dropout is 0 and data sampling is
    keyed by sample index, so the loss curve does not depend on it)."""
    layout = source.manifest.get("layout", {})
    same = layout.get("world_size") == trainer.grid.world_size and all(
        layout.get(k) == getattr(trainer.grid, k) for k in COORDS)
    set_rng_state(source.rank_state(trainer.rank if same else 0)["rng"])
