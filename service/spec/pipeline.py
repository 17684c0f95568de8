"""The rules of ``parallel.pipeline_schedule``, each one line naming the fields, the numbers and
the fix; and the bubble each schedule leaves (:func:`bubble_fraction`, for the cost model)."""

from __future__ import annotations


def pipeline_problems(p, m, t, dp: int | None) -> list[str]:
    """What ``parallel.pipeline_schedule`` gets wrong with the other fields (``dp``: the
    data-parallel size, None when the grid is invalid)."""
    name, pp, vpp = p.pipeline_schedule, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if name is None or not isinstance(pp, int) or not isinstance(vpp, (int, type(None))):
        return []  # the default (today's choice by vpp), or auto sizes (checked per candidate)
    chunks = vpp or 1
    if name in ("zb-h1", "zbv") and pp == 1:
        return [f"parallel.pipeline_schedule {name} needs parallel.pipeline_model_parallel_size > 1 (got 1): unset "
                "pipeline_schedule or raise pipeline_model_parallel_size"]
    if name == "1f1b" and chunks > 1:
        return [f"parallel.pipeline_schedule 1f1b runs one chunk per stage, not virtual_pipeline_model_parallel_size "
                f"{vpp}: use pipeline_schedule interleaved (or unset it), or unset vpp"]
    if name == "interleaved" and chunks == 1:
        return ["parallel.pipeline_schedule interleaved needs parallel.virtual_pipeline_model_parallel_size > 1: "
                "set vpp (e.g. 2) or use pipeline_schedule 1f1b"]
    if name == "zb-h1" and chunks > 1:
        return [f"parallel.pipeline_schedule zb-h1 runs one chunk per stage, not virtual_pipeline_model_parallel_size "
                f"{vpp}: unset vpp, or use pipeline_schedule zbv with vpp 2"]
    out = []
    if name == "zbv":
        if vpp != 2:
            out.append(f"parallel.pipeline_schedule zbv needs parallel.virtual_pipeline_model_parallel_size 2 (got "
                       f"{vpp}): set vpp to 2, or use pipeline_schedule zb-h1")
        if not m.untie_embeddings_and_output_weights:
            out.append("parallel.pipeline_schedule zbv puts the embedding and the output layer on stage 0 as two "
                       "chunks, which cannot share a tied weight: set model.untie_embeddings_and_output_weights: "
                       "true, or use pipeline_schedule zb-h1")
        if getattr(m, "mtp_num_layers", None):
            out.append(f"parallel.pipeline_schedule zbv puts the MTP modules (model.mtp_num_layers "
                       f"{m.mtp_num_layers}) and the embedding their copy shares on stage 0 as two chunks: unset "
                       "mtp_num_layers, or use pipeline_schedule zb-h1")
        mbs = t.micro_batch_size
        if dp and isinstance(mbs, int) and t.global_batch_size // (mbs * dp) < 2 * pp:
            n = t.global_batch_size // (mbs * dp)
            out.append(f"parallel.pipeline_schedule zbv needs at least 2 x pipeline_model_parallel_size = {2 * pp} "
                       f"microbatches, got training.global_batch_size {t.global_batch_size} / (micro_batch_size "
                       f"{mbs} x dp {dp}) = {n}: raise global_batch_size to {2 * pp * mbs * dp}, or use zb-h1")
    return out


def bubble_fraction(name: str | None, pp: int, vpp: int | None, num_microbatches: int) -> float:
    """Idle time over work of one stage, with a microbatch's forward, input gradient and weight
    gradient costing alike (F = B = W): 1F1B ``(pp - 1) / m``, interleaved ``(pp - 1) / (vpp m)``,
    ZB-H1 a third of 1F1B's (``(pp - 1)(F + B - W)`` of ``3 m`` units), ZBV a sixth (``pp - 1``
    half-stage units of ``6 m``), as :func:`workers.parallel.pipeline_check.simulate` counts them."""
    if pp == 1:
        return 0.0
    if name == "zb-h1":
        return (pp - 1) / (3 * num_microbatches)
    if name == "zbv":
        return (pp - 1) / (6 * num_microbatches)
    return (pp - 1) / ((vpp or 1) * num_microbatches)
