"""``checkpoint.load: megatron:DIR``: a Megatron-Core ``torch_dist`` checkpoint as a checkpoint source.

DIR is one checkpoint (``.metadata``, ``*.distcp``, ``metadata.json``, and ``common.pt`` from
megatron-core before 0.19) or a Megatron-LM ``--save`` root (its ``latest_checkpointed_iteration.txt``
names the one). :class:`MegatronReader` has the interface :func:`workers.checkpoint.reader.load_checkpoint`
reads (``model``, ``trainer_state``, ``has``, ``shape``, ``read``): each rank reads only the chunks of
the stored tensors that overlap its own boxes, through ``torch.distributed.checkpoint``'s reader and
a planner of those boxes (no collectives, no megatron-core import). Names and shapes are
:mod:`workers.checkpoint.megatron_names`'. The model fields come from the tensors' shapes and from the
checkpoint's Megatron-LM ``args`` where it has them. Adam's moments, the fp32 main params and Adam's step
come along where the checkpoint holds them in a format raytron reads
(:mod:`workers.checkpoint.megatron_optim`); otherwise the job starts a fresh optimizer. Either way the
job counts its iterations from 0.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from workers.checkpoint.layout import Box
from workers.checkpoint.megatron_names import model_from_args, raytron_names, stored_parts
from workers.checkpoint.megatron_optim import optimizer_source

# one process reads (writes) its own part: torch.distributed need not be initialised, as it says each time
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
TRACKER = "latest_checkpointed_iteration.txt"
COMMON_KEY = "common_state/shard_0_1"


def checkpoint_dir(directory: str) -> Path:
    """The torch_dist checkpoint ``directory`` is, or the latest one under a Megatron-LM root.

    Raises:
        ValueError: no such directory, or not a torch_dist checkpoint (one line, with the fix).
    """
    path = Path(directory)
    where = f"checkpoint.load megatron:{directory}"
    if not path.is_dir():
        raise ValueError(f"{where}: no such directory; give a Megatron-Core torch_dist checkpoint directory "
                         f"(iter_NNNNNNN) or a Megatron-LM --save root")
    if (path / TRACKER).is_file() and not (path / ".metadata").is_file():
        it = (path / TRACKER).read_text().strip()
        path = path / ("release" if it == "release" else f"iter_{int(it):07d}")
    config = path / "metadata.json"
    backend = json.loads(config.read_text()).get("sharded_backend") if config.is_file() else None
    if backend != "torch_dist" or not (path / ".metadata").is_file():
        raise ValueError(f"{where}: {path} is not a Megatron-Core torch_dist checkpoint (it needs metadata.json with "
                         f"sharded_backend torch_dist, found {backend!r}, and .metadata); save with "
                         f"--ckpt-format torch_dist or convert it with Megatron-LM's checkpoint converter")
    return path


class _Placeholder:
    """What an object of a class outside :data:`_SAFE` unpickles as (its state kept, no code run)."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


_SAFE = {"builtins": {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool",
                      "complex", "slice", "range", "bytearray"},
         "collections": {"OrderedDict", "defaultdict", "deque"}, "argparse": {"Namespace"}}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "torch" or module.startswith(("torch.", "numpy")) or name in _SAFE.get(module, ()):
            return super().find_class(module, name)
        return _Placeholder


class _SafePickle:
    """A ``pickle_module`` for ``torch.load`` that builds no class outside torch, numpy and plain data."""

    Unpickler = _SafeUnpickler
    load = staticmethod(lambda f, **kw: _SafeUnpickler(f, **kw).load())
    __name__ = "raytron_safe_pickle"


def safe_load(f) -> object:
    return torch.load(f, map_location="cpu", weights_only=False, pickle_module=_SafePickle)


class _BoxPlanner(LoadPlanner):
    """Reads boxes of stored tensors into given tensors, and byte objects by key."""

    def __init__(self, boxes: list[tuple[str, Box, torch.Tensor]], objects: tuple[str, ...] = ()):
        self.targets = {(key, box.offsets): out for key, box, out in boxes}
        self.objects, self.loaded = objects, {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, offsets in self.targets:
            out = self.targets[(key, offsets)]
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(out.shape))
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        for key in self.objects:
            index = MetadataIndex(key)
            items.append(ReadItem(LoadItemType.BYTE_IO, index, torch.Size((0,)), index, torch.Size((0,)),
                                  torch.Size((0,))))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        self.loaded[read_item.dest_index.fqn] = safe_load(value)

    def resolve_tensor(self, read_item):
        out = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            out = out.narrow(dim, o, n)
        return out

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor gave a view of the target: the data is in place


class MegatronReader:
    """A Megatron-Core torch_dist checkpoint of a GPT/Llama model (dense or MoE) as a checkpoint source:
    the weights (``model/NAME``) and, where :attr:`optim` found them, Adam's moments and fp32 main params
    (``optim/exp_avg/NAME``, ``optim/exp_avg_sq/NAME``, ``optim/master/NAME``) and step
    (:attr:`optimizer_steps`). A tied model also loads into an untied job: its output layer starts as a
    copy of the embedding."""

    trainer_state = None

    def __init__(self, directory: str):
        self.path = checkpoint_dir(directory)
        self.reader = FileSystemReader(str(self.path))
        self.metadata = self.reader.read_metadata()
        self.tensors, layers_of = {}, {}
        for k, v in self.metadata.state_dict_metadata.items():
            if isinstance(v, TensorStorageMetadata):
                self.tensors[k] = tuple(v.size)
                stacked = k.startswith("decoder.layers.")  # dim 0: the global layer number
                layers_of[k] = {i for c in v.chunks for i in range(c.offsets[0], c.offsets[0] + c.sizes[0])} \
                    if stacked else set()
        self.split_experts = self._split_experts(layers_of)
        qkv = self.tensors.get("decoder.layers.self_attention.linear_qkv.weight")
        embedding = self.tensors.get("embedding.word_embeddings.weight")
        if qkv is None or embedding is None:
            raise ValueError(f"checkpoint.load megatron:{directory}: {self.path} has no GPT decoder tensors "
                             f"(decoder.layers.self_attention.linear_qkv.weight, embedding.word_embeddings.weight); "
                             f"raytron reads Megatron-Core GPT models")
        self.common = self._common()
        args = self.common.get("args")
        try:
            from_args = model_from_args(vars(args)) if isinstance(args, argparse.Namespace) else {}
        except ValueError as e:
            raise ValueError(f"checkpoint.load megatron:{directory}: {e}") from None
        self.names = raytron_names(layers_of, qkv[0])
        self.model = {"num_layers": qkv[0], "hidden_size": embedding[1], "vocab_size": embedding[0],
                      **self._shape_fields(qkv[0], layers_of), **from_args}
        self.model.pop("untie_embeddings_and_output_weights", None)  # either kind of job may load it
        self.names["output.weight"] = self.names.get("output.weight", self.names["embedding.weight"])
        self.iteration = int(self.common.get("iteration") or 0)
        self.optim = optimizer_source(self.tensors, {k for k, _ in self.names.values()}, self.common,
                                      self.split_experts)
        self.optimizer_steps = self.optim.step

    def _split_experts(self, layers_of: dict) -> set[str]:
        """With ``singleton_local_shards`` each expert has keys of its own
        (``decoder.layers.mlp.experts.experts.E.linear_fc1.weight``): each such set, seen as the stacked
        ``[L, E, ...]`` key of the default format. Returns those stacked keys."""
        out = set()
        for which in ("linear_fc1.weight", "linear_fc2.weight"):
            e = 0
            while f"decoder.layers.mlp.experts.experts.{e}.{which}" in self.tensors:
                e += 1
            if e:
                first = f"decoder.layers.mlp.experts.experts.0.{which}"
                key = f"decoder.layers.mlp.experts.experts.{which}"
                size = self.tensors[first]
                self.tensors[key] = (size[0], e, *size[1:])
                layers_of[key] = layers_of[first]
                out.add(key)
        return out

    def _shape_fields(self, layers: int, layers_of: dict) -> dict:
        """The model fields the stored shapes give: the dense and the expert ffn, the experts, which
        layers are MoE."""
        out = {}
        if "decoder.layers.mlp.linear_fc2.weight" in self.tensors:
            out["ffn_hidden_size"] = self.tensors["decoder.layers.mlp.linear_fc2.weight"][2]
        router = self.tensors.get("decoder.layers.mlp.router.weight")
        if router is not None:
            out["num_moe_experts"] = router[1]
            out["moe_ffn_hidden_size"] = self.tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"][3]
            moe = layers_of["decoder.layers.mlp.router.weight"]
            out["moe_layer_freq"] = 1 if len(moe) == layers else tuple(int(i in moe) for i in range(layers))
            if out["moe_ffn_hidden_size"] == out.get("ffn_hidden_size"):
                out["moe_ffn_hidden_size"] = None  # raytron's default: the dense ffn
        return out

    def _common(self) -> dict:
        """The common (non-sharded) state: ``common.pt`` (megatron-core < 0.19) or the DCP object."""
        if (self.path / "common.pt").is_file():
            with open(self.path / "common.pt", "rb") as f:
                common = safe_load(f)
        elif COMMON_KEY in self.metadata.state_dict_metadata:
            planner = _BoxPlanner([], (COMMON_KEY,))
            dcp_load({}, storage_reader=self.reader, planner=planner, no_dist=True)
            common = planner.loaded[COMMON_KEY]
            common = common[0] if isinstance(common, list) else common
        else:
            common = {}
        return common if isinstance(common, dict) else {}

    def _stored(self, key: str) -> tuple[str, str, int | None] | None:
        """``(name, stored key, layer)`` of ``model/NAME`` or ``optim/KIND/NAME``; None: not held."""
        if key.startswith("model/"):
            name, kind = key[6:], None
        elif key.startswith("optim/") and key.count("/") >= 2:
            kind, name = key[6:].split("/", 1)
        else:
            return None
        if name not in self.names:
            return None
        mkey, layer = self.names[name]
        if kind is not None:
            mkey = self.optim.keys.get(kind, {}).get(mkey)
            if mkey is None:
                return None
        return name, mkey, layer

    def has(self, key: str) -> bool:
        return self._stored(key) is not None

    def shape(self, key: str) -> tuple[int, ...]:
        name, _, _ = self._stored(key)
        mkey, layer = self.names[name]
        shape = self.tensors[mkey][0 if layer is None else 1 :]
        if name.endswith("gate_up.weight"):
            return (2, shape[0] // 2, *shape[1:])
        if name.endswith(("experts.w_gate", "experts.w_up")):
            return (shape[0], shape[1] // 2, *shape[2:])
        return shape

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The ``box`` of logical tensor ``key`` (``model/NAME``, ``optim/KIND/NAME``), from the stored
        chunks that overlap it."""
        name, stored, layer = self._stored(key)
        mkey = self.names[name][0]
        out = torch.empty(box.lengths, dtype=torch.float32)
        boxes = []
        for j, offsets in stored_parts(name, box.offsets, box.lengths, self.tensors[mkey][0 if layer is None else 1 :]):
            target = out if j is None else out[j]
            if mkey in self.split_experts:  # one key per expert: dim 0 of the box, expert by expert
                for e in range(target.shape[0]):
                    one = stored.replace(".experts.experts.", f".experts.experts.{offsets[0] + e}.")
                    boxes.append(_stored_box(one, layer, offsets[1:], target[e]))
            else:
                boxes.append(_stored_box(stored, layer, offsets, target))
        dcp_load({}, storage_reader=self.reader, planner=_BoxPlanner(boxes), no_dist=True)
        return out


def _stored_box(key: str, layer: int | None, offsets: tuple, target: torch.Tensor) -> tuple[str, Box, torch.Tensor]:
    """A read of ``target`` from ``key`` at ``offsets`` (in layer ``layer`` of a stacked key)."""
    if layer is not None:
        target, offsets = target.unsqueeze(0), (layer, *offsets)
    return key, Box(tuple(offsets), tuple(target.shape)), target
