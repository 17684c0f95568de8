"""Hugging Face interop: export a checkpoint as a Hugging Face model of one of the families of
:mod:`workers.hf.families` (Llama, Mixtral, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3), and read such
a directory as a checkpoint source (``checkpoint.load: hf:DIR``).

raytron's decoder is those architectures exactly (rotate-half rotary, RMSNorm, SwiGLU, Qwen2's
QKV bias, Qwen3's q/k norms, tied or untied output), so the conversion only renames and splits
or fuses tensors:

=====================================  ==============================================
raytron logical tensor                 Hugging Face (``model.`` prefix but lm_head)
=====================================  ==============================================
embedding.weight [V, h]                embed_tokens.weight
layers.i.input_norm.weight             layers.i.input_layernorm.weight
layers.i.attention.qkv.weight          layers.i.self_attn.{q,k,v}_proj.weight: per
  [G * (H/G + 2) * d, h]                 query group g: H/G q heads, k_g, v_g
layers.i.attention.qkv.bias            layers.i.self_attn.{q,k,v}_proj.bias (Qwen2)
layers.i.attention.{q,k}_norm.weight   layers.i.self_attn.{q,k}_norm.weight (Qwen3)
layers.i.attention.proj.weight         layers.i.self_attn.o_proj.weight
layers.i.post_norm.weight              layers.i.post_attention_layernorm.weight
layers.i.mlp.gate_up.weight [2, F, h]  layers.i.mlp.{gate,up}_proj.weight
layers.i.mlp.down.weight               layers.i.mlp.down_proj.weight
layers.i.mlp.router.weight [E, h]      layers.i.block_sparse_moe.gate.weight
layers.i.mlp.experts.w_{gate,up,down}  layers.i.block_sparse_moe.experts.e.w{1,3,2}.weight
final_norm.weight / output.weight      norm.weight / lm_head.weight (tied: no lm_head)
=====================================  ==============================================

``d`` is the head dimension (``kv_channels``, Hugging Face's ``head_dim``). Qwen3-MoE and
DeepSeek-V3 name their MoE tensors as :func:`workers.hf.moe.hf_moe_names` says (router, expert
bias, experts, shared experts) and MLA's (:mod:`workers.model.mla`) are transformers' own
(``layers.i.attention.X`` <-> ``layers.i.self_attn.X``).

Mixtral's router (softmax over all experts, top-k, renormalised) equals raytron's (softmax
over the top-k logits). Import also takes transformers 5's in-memory Mixtral names
(``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` / ``down_proj``) and a tied lm_head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from workers.checkpoint.layout import Box
from workers.config import moe_layer_at
from workers.hf.families import family_of, hf_config, model_from_hf_config, read_hf_config  # noqa: F401
from workers.hf.moe import ARCHITECTURES, hf_moe_names
from workers.hf.mtp import as_layer_name, mtp_layers_in, mtp_own_shapes, mtp_own_to_hf, shared_copies


def head_dim(m: dict) -> int:
    return m.get("kv_channels") or m["hidden_size"] // m["num_attention_heads"]


def logical_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    """Every logical tensor of a model (a ModelConfig as a dict) with its shape, MoE expert
    biases included."""
    h, v = m["hidden_size"], m["vocab_size"]
    out = {"embedding.weight": (v, h)}
    for i in range(m["num_layers"]):
        out.update(_layer_shapes(m, f"layers.{i}", _is_moe_layer(m, i)))
    out["final_norm.weight"] = (h,)
    if m.get("untie_embeddings_and_output_weights", True):
        out["output.weight"] = (v, h)
    for k in range(m.get("mtp_num_layers") or 0):  # workers/model/mtp.py: the last layer's kind
        out.update(mtp_own_shapes(m, k))
        out.update(_layer_shapes(m, f"mtp.layers.{k}.layer", _is_moe_layer(m, m["num_layers"] - 1)))
    return out


def _layer_shapes(m: dict, p: str, moe: bool) -> dict[str, tuple[int, ...]]:
    """The tensors of one decoder layer named ``p``."""
    h, f = m["hidden_size"], m["ffn_hidden_size"]
    heads, groups = m["num_attention_heads"], m["num_query_groups"]
    d = head_dim(m)
    out = {f"{p}.input_norm.weight": (h,)}
    if m.get("multi_latent_attention"):
        out.update({f"{p}.attention.{k}.weight": s for k, s in _mla_shapes(m).items()})
    else:
        out[f"{p}.attention.qkv.weight"] = ((heads + 2 * groups) * d, h)
        if m.get("add_qkv_bias"):
            out[f"{p}.attention.qkv.bias"] = ((heads + 2 * groups) * d,)
        if m.get("qk_layernorm"):
            out.update({f"{p}.attention.q_norm.weight": (d,), f"{p}.attention.k_norm.weight": (d,)})
        out[f"{p}.attention.proj.weight"] = (h, heads * d)
    out[f"{p}.post_norm.weight"] = (h,)
    if moe:
        e, fe = m["num_moe_experts"], m.get("moe_ffn_hidden_size") or f
        shared = m.get("moe_shared_expert_intermediate_size")
        out.update({f"{p}.mlp.router.weight": (e, h), f"{p}.mlp.experts.w_gate": (e, fe, h),
                    f"{p}.mlp.experts.w_up": (e, fe, h), f"{p}.mlp.experts.w_down": (e, h, fe)})
        if m.get("moe_router_enable_expert_bias"):
            out[f"{p}.mlp.router.expert_bias"] = (e,)
        if shared:
            out.update({f"{p}.mlp.shared_mlp.gate_up.weight": (2, shared, h),
                        f"{p}.mlp.shared_mlp.down.weight": (h, shared)})
    else:
        out.update({f"{p}.mlp.gate_up.weight": (2, f, h), f"{p}.mlp.down.weight": (h, f)})
    return out


def _is_moe_layer(m: dict, i: int) -> bool:
    """:meth:`workers.config.ModelConfig.is_moe_layer` of a model dict."""
    return bool(m.get("num_moe_experts")) and moe_layer_at(m.get("moe_layer_freq", 1), i)


def _mla_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    """The attention weights of an MLA layer (:mod:`workers.model.mla`), transformers' names."""
    h, heads, rope = m["hidden_size"], m["num_attention_heads"], m["qk_pos_emb_head_dim"]
    qk, q_rank, kv_rank = m["qk_head_dim"] + rope, m.get("q_lora_rank"), m["kv_lora_rank"]
    q = ({"q_proj": (heads * qk, h)} if q_rank is None else
         {"q_a_proj": (q_rank, h), "q_a_layernorm": (q_rank,), "q_b_proj": (heads * qk, q_rank)})
    return {**q, "kv_a_proj_with_mqa": (kv_rank + rope, h), "kv_a_layernorm": (kv_rank,),
            "kv_b_proj": (heads * (m["qk_head_dim"] + m["v_head_dim"]), kv_rank),
            "o_proj": (h, heads * m["v_head_dim"])}


def _split_qkv(qkv: torch.Tensor, m: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV weight ``[rows, h]`` or bias ``[rows]`` as Hugging Face's q, k, v."""
    groups, d = m["num_query_groups"], head_dim(m)
    per = m["num_attention_heads"] // groups
    rest = qkv.shape[1:]
    x = qkv.view(groups, per + 2, d, *rest)
    return (x[:, :per].reshape(groups * per * d, *rest), x[:, per].reshape(groups * d, *rest),
            x[:, per + 1].reshape(groups * d, *rest))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: dict) -> torch.Tensor:
    groups, d = m["num_query_groups"], head_dim(m)
    per = m["num_attention_heads"] // groups
    rest = q.shape[1:]
    parts = [q.view(groups, per, d, *rest), k.view(groups, 1, d, *rest), v.view(groups, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape((per + 2) * groups * d, *rest)


def to_hf(name: str, t: torch.Tensor, m: dict) -> dict[str, torch.Tensor]:
    """One raytron logical tensor as Hugging Face tensors (hub names); DeepSeek-V3's MTP
    modules as :mod:`workers.hf.mtp` says."""
    if name.startswith("mtp.layers."):
        layer = as_layer_name(name, m)
        return to_hf(layer, t, m) if layer else mtp_own_to_hf(name, t, m)
    if name == "output.weight":
        return {"lm_head.weight": t, **shared_copies(name, t, m)}
    simple = {"embedding.weight": "embed_tokens.weight", "final_norm.weight": "norm.weight"}
    if name in simple:
        return {f"model.{simple[name]}": t, **shared_copies(name, t, m)}
    _, i, rest = name.split(".", 2)
    p = f"model.layers.{i}"
    if m.get("multi_latent_attention") and rest.startswith("attention."):  # transformers' names already
        return {f"{p}.self_attn.{rest[len('attention.'):]}": t}
    if family_of(m) in ARCHITECTURES:  # Qwen3-MoE, DeepSeek-V3: workers.hf.moe's names
        hub = hf_moe_names(name, m["num_moe_experts"])
        if hub is not None:
            return {hub[0]: t} if len(hub) == 1 else dict(zip(hub, t))
    if rest in ("attention.qkv.weight", "attention.qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return {f"{p}.self_attn.{x}_proj.{kind}": part for x, part in zip("qkv", _split_qkv(t, m))}
    renames = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
               "input_norm.weight": "input_layernorm.weight", "post_norm.weight": "post_attention_layernorm.weight",
               "attention.proj.weight": "self_attn.o_proj.weight", "mlp.down.weight": "mlp.down_proj.weight",
               "mlp.router.weight": "block_sparse_moe.gate.weight"}
    if rest in renames:
        return {f"{p}.{renames[rest]}": t}
    if rest == "mlp.gate_up.weight":
        return {f"{p}.mlp.gate_proj.weight": t[0], f"{p}.mlp.up_proj.weight": t[1]}
    w = {"mlp.experts.w_gate": "w1", "mlp.experts.w_down": "w2", "mlp.experts.w_up": "w3"}[rest]
    return {f"{p}.block_sparse_moe.experts.{e}.{w}.weight": t[e] for e in range(t.shape[0])}


def tensor_files(directory: Path) -> dict[str, Path]:
    """Which file holds each tensor of a model directory: one ``model.safetensors`` or the
    shards named by ``model.safetensors.index.json``."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        for f in sorted(set(weight_map.values())):
            with safe_open(directory / f, framework="pt"):  # every shard is there and has a header
                pass
        return {name: directory / f for name, f in weight_map.items()}
    paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise ValueError(f"{directory} has no *.safetensors files; save the model with "
                         f"save_pretrained(..., safe_serialization=True)")
    where = {}
    for path in paths:
        with safe_open(path, framework="pt") as f:  # the header only
            where.update(dict.fromkeys(f.keys(), path))
    return where


class HFReader:
    """A Hugging Face directory of a family of :mod:`workers.hf.families` as a checkpoint
    source (weights only: no optimizer state, no trainer state, so training starts at
    iteration 0). A tied model also loads into an untied job: its output layer starts as a
    copy of the embedding."""

    trainer_state = None

    def __init__(self, directory: str):
        self.path = Path(directory)
        config = read_hf_config(self.path, f"checkpoint.load hf:{directory}")
        self.model = model_from_hf_config(config)
        self.files = tensor_files(self.path)
        # output.weight is readable either way (lm_head, or the tied embedding); DeepSeek-V3's
        # MTP modules where the directory has their weights (a job asks for them or not)
        self.shapes = logical_shapes({**self.model, "untie_embeddings_and_output_weights": True,
                                      "mtp_num_layers": mtp_layers_in(self.files, config)})
        if not self.model["untie_embeddings_and_output_weights"]:
            del self.model["untie_embeddings_and_output_weights"]  # either kind of job may load it
        self._cache: tuple[str, torch.Tensor] | None = None

    def has(self, key: str) -> bool:
        return key.startswith("model/") and key[6:] in self.shapes

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key[6:]]

    def read(self, key: str, box: Box) -> torch.Tensor:
        name = key[6:]
        if self._cache is None or self._cache[0] != name:
            self._cache = (name, self._full(name))
        full = self._cache[1]
        return full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))].float()

    def _get(self, hf_name: str) -> torch.Tensor:
        if hf_name not in self.files:
            raise ValueError(f"hf:{self.path}: tensor {hf_name} is missing")
        with safe_open(self.files[hf_name], framework="pt") as f:  # this one tensor, not the file
            return f.get_tensor(hf_name).float()

    def _full(self, name: str) -> torch.Tensor:
        """The logical tensor ``name``, assembled from the Hugging Face tensors."""
        m, shape = self.model, self.shapes[name]
        name = as_layer_name(name, m) or name  # an MTP module's layer: DeepSeek-V3's layer N + k
        if name == "output.weight" and "lm_head.weight" not in self.files:
            return self._get("model.embed_tokens.weight")  # tied embeddings
        if name.endswith("mlp.router.weight") and f"model.{name.split('.mlp')[0]}.block_sparse_moe.gate.weight" not in self.files:
            return self._get(f"model.{name.split('.mlp')[0]}.mlp.gate.weight")  # transformers 5 names
        if ".mlp.experts." in name:
            p = f"model.{name.split('.mlp')[0]}.mlp.experts"
            if f"{p}.gate_up_proj" in self.files:  # transformers 5: fused [E, 2F, h]
                f = m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]
                gate_up, down = self._get(f"{p}.gate_up_proj"), self._get(f"{p}.down_proj")
                return {"w_gate": gate_up[:, :f], "w_up": gate_up[:, f:], "w_down": down}[name.rsplit(".", 1)[1]]
        hub = to_hf(name, torch.empty(shape, device="meta"), {**m, "mtp_num_layers": None})  # no copies
        parts = {k: self._get(k) for k in hub}
        if name.endswith(("attention.qkv.weight", "attention.qkv.bias")):
            q, k, v = parts.values()
            return _fuse_qkv(q, k, v, m)
        if len(parts) == 1:
            return next(iter(parts.values()))
        return torch.stack(list(parts.values()))  # gate_up [2, F, h]; experts [E, ...] in order


def open_source(load: str):
    """``checkpoint.load``: ``hf:DIR`` (a Hugging Face model directory), ``megatron:DIR`` (a
    Megatron-Core torch_dist checkpoint), a checkpoint directory, or a checkpoint root (its latest
    complete checkpoint)."""
    if load.startswith("hf:"):
        return HFReader(load[3:])
    if load.startswith("megatron:"):
        from workers.checkpoint.megatron_import import MegatronReader

        return MegatronReader(load[len("megatron:"):])
    from workers.checkpoint.reader import CheckpointReader

    return CheckpointReader.open(load)
