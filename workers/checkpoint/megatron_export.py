"""``raytron export --format megatron``: a raytron checkpoint as a Megatron-Core ``torch_dist`` checkpoint.

The output is laid out as Megatron-LM's ``--save`` root: ``OUT/latest_checkpointed_iteration.txt``
and ``OUT/iter_NNNNNNN/`` holding ``.metadata`` and ``__0_0.distcp`` (written by
``torch.distributed.checkpoint``, one process, whole tensors: any megatron-core layout reads its own
slices of them), ``metadata.json`` and ``common.pt``. The tensors are under Megatron-Core's keys,
decoder layers stacked (:mod:`workers.checkpoint.megatron_names`), each layer linear's (empty)
``_extra_state`` beside them, as megatron-core's GPTModel asks for them in a strict load. The common
state (Megatron-LM's ``args``, ``iteration``, ``checkpoint_version``) is both in ``common.pt``, which
megatron-core before 0.19 requires and 0.19 prefers, and in the DCP files as 0.19 writes it.
Float32. Adam's state goes along in megatron-core's ``fully_reshardable`` distributed-optimizer
format (:mod:`workers.checkpoint.megatron_optim`): the moments and fp32 main params of each tensor
under ``optimizer.state.*.KEY``, the step and the hyperparameters in the common ``optimizer`` entry.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from workers.checkpoint.layout import Box
from workers.checkpoint.megatron_import import COMMON_KEY, TRACKER
from workers.checkpoint.megatron_names import EXTRA_STATE, args_from_model, megatron_key
from workers.checkpoint.megatron_optim import optimizer_common
from workers.checkpoint.reader import CheckpointReader

CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
          "common_backend_version": 1}
UNSUPPORTED = ("num_moe_experts", "multi_latent_attention", "mtp_num_layers")


def _object(value) -> io.BytesIO:
    """A ShardedObject's bytes as megatron-core stores them: ``torch.save([value])``."""
    raw = io.BytesIO()
    torch.save([value], raw)
    raw.seek(0)
    return raw


class _Planner(DefaultSavePlanner):
    """Writes the objects' bytes as they are (the default planner would pickle the BytesIO again)."""

    def transform_object(self, write_item, object):
        return object if isinstance(object, io.BytesIO) else super().transform_object(write_item, object)


def megatron_state(reader: CheckpointReader) -> dict:
    """The checkpoint's model as Megatron-Core's keyed tensors (layers stacked) and extra-state objects,
    and its Adam state under ``optimizer.state.{exp_avg,exp_avg_sq,param}.KEY`` (megatron-core's
    ``fully_reshardable`` format; ``param``: the fp32 main params, the weights of an fp32 job)."""
    m = reader.model
    refused = [k for k in UNSUPPORTED if m.get(k)]
    if refused:
        raise ValueError(f"{reader.storage.uri}: --format megatron writes dense GPT/Llama models; this checkpoint's "
                         f"model has {', '.join(f'{k}={m[k]!r}' for k in refused)}; export it with --format hf")
    layers = m["num_layers"]
    state = _stacked(reader, "model/", layers)
    if any(k.startswith("optim/exp_avg/") for k in reader.pieces):
        master = "optim/master/" if any(k.startswith("optim/master/") for k in reader.pieces) else "model/"
        for kind, prefix in (("exp_avg", "optim/exp_avg/"), ("exp_avg_sq", "optim/exp_avg_sq/"), ("param", master)):
            state.update({f"optimizer.state.{kind}.{k}": v for k, v in _stacked(reader, prefix, layers).items()})
    for linear in EXTRA_STATE:
        state.update({f"decoder.layers.{linear}._extra_state/shard_{i}_{layers}": _object(None) for i in range(layers)})
    return state


def _stacked(reader: CheckpointReader, prefix: str, layers: int) -> dict[str, torch.Tensor]:
    """The logical tensors ``prefix + NAME`` under Megatron-Core's keys, decoder layers stacked."""
    state = {}
    for key in sorted(reader.pieces):
        if not key.startswith(prefix):
            continue
        name, shape = key[len(prefix):], reader.shape(key)
        mkey, layer = megatron_key(name)
        full = reader.read(key, Box((0,) * len(shape), shape))
        if name.endswith("mlp.gate_up.weight"):
            full = full.reshape(2 * shape[1], shape[2])  # [gate; up] rows
        if layer is None:
            state[mkey] = full
        else:
            state.setdefault(mkey, torch.empty(layers, *full.shape))[layer] = full
    return state


def export_megatron(checkpoint: str, out_dir: str) -> dict:
    """Write a raytron checkpoint (a directory, or the latest under a root) as a Megatron-LM
    ``--save`` root with one torch_dist checkpoint.

    Returns:
        ``{"iteration", "path", "bytes", "tensors", "optimizer"}`` (``path``: the iter_NNNNNNN directory;
        ``optimizer``: whether Adam's state was written).
    """
    reader = CheckpointReader.open(checkpoint)
    reader.verify()  # every byte against the manifest before it leaves raytron
    state = megatron_state(reader)
    it = reader.iteration
    common = {"args": argparse.Namespace(**args_from_model(reader.model, it)), "iteration": it,
              "checkpoint_version": 3.0}
    if any(k.startswith("optimizer.state.") for k in state):
        steps = (reader.trainer_state or {}).get("optimizer_steps", it)
        common["optimizer"] = optimizer_common(reader.manifest.get("training") or {}, int(steps))
    root = Path(out_dir)
    path = root / f"iter_{it:07d}"
    path.mkdir(parents=True, exist_ok=True)
    tensors = sum(1 for v in state.values() if isinstance(v, torch.Tensor))
    dcp_save({**state, COMMON_KEY: _object(common)}, storage_writer=FileSystemWriter(str(path)),
             planner=_Planner(), no_dist=True)
    torch.save(common, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps(CONFIG))
    (root / TRACKER).write_text(str(it))
    size = sum(f.stat().st_size for f in path.iterdir())
    return {"iteration": it, "path": str(path), "bytes": size, "tensors": tensors, "optimizer": "optimizer" in common}
