"""The rules of context parallelism's fields (``parallel.cp_comm_type``,
``parallel.hierarchical_context_parallel_sizes``), each naming the fields, the numbers and the fix."""

from __future__ import annotations


def cp_problems(p, heads: int, tp: int) -> list[str]:
    """What the CP fields of a parallel section get wrong, for a model of ``heads`` attention heads."""
    cp, kind, sizes = p.context_parallel_size, p.cp_comm_type, p.hierarchical_context_parallel_sizes
    if not isinstance(cp, int) or heads % tp:
        return []  # auto (checked per candidate) or a head count TP cannot split (reported already)
    local = heads // tp
    out = []
    if kind == "a2a" and cp > 1 and local % cp:
        out.append(f"parallel.cp_comm_type a2a splits each rank's attention heads over the CP group: "
                   f"model.num_attention_heads {heads} / tensor_model_parallel_size {tp} = {local} is not "
                   f"divisible by context_parallel_size {cp}; use cp_comm_type p2p or all_gather, or a cp that "
                   f"divides {local}")
    if kind == "a2a+p2p":
        if sizes is None or len(sizes) != 2 or any(s < 1 for s in sizes) or sizes[0] * sizes[1] != cp:
            out.append(f"parallel.cp_comm_type a2a+p2p needs parallel.hierarchical_context_parallel_sizes "
                       f"[a2a, p2p] whose product is context_parallel_size {cp}, got {sizes}; e.g. "
                       f"[{min(cp, 2)}, {cp // min(cp, 2)}]")
        elif local % sizes[0]:
            out.append(f"parallel.cp_comm_type a2a+p2p splits each rank's attention heads over its a2a group: "
                       f"model.num_attention_heads {heads} / tensor_model_parallel_size {tp} = {local} is not "
                       f"divisible by hierarchical_context_parallel_sizes[0] {sizes[0]}; use an a2a size that "
                       f"divides {local}")
    elif sizes is not None:
        out.append(f"parallel.hierarchical_context_parallel_sizes {sizes} goes with cp_comm_type a2a+p2p "
                   f"(not {kind}); set cp_comm_type: a2a+p2p or drop it")
    return out
