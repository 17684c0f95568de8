"""All local experts' SwiGLU MLPs in one grouped GEMM per projection, not one GEMM per expert.

The dispatcher hands the experts ``x [R, h]``: one contiguous run of rows per local expert.
Expert i's rows meet only expert i's weights, so the three projections are *grouped* GEMMs:

* ``torch._grouped_mm`` (CUTLASS, one kernel for all groups) on CUDA sm90+ in bf16, with
  ``offs`` the int32 cumulative row counts; it reads the runs in place. In bf16 the runs need
  no row padding (torchtitan dropped its 8-row alignment for bf16; fp8 would need 16).
* Elsewhere (CPU, fp32, older GPUs) one ``torch.bmm`` over ``[E, M, h]``: each run is copied
  into a zero-padded slab of ``M = max run`` rows, the SwiGLU runs on all slabs at once, and
  the real rows are read back. A row's output depends on that row and its expert's weights
  alone, so the padding changes no real row; padded rows are zero, so they add exact zeros to
  the weight gradients. Up to GEMM blocking order the result is the per-expert loop's.

Both take the run lengths twice: as host ints (the only host sync of the MoE layer made them,
in the dispatcher; they size the padding) and as a device tensor (the same counts, never
copied to the host; they build the offsets and row indices), so neither path syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertRuns:
    """Rows per local expert of the expert input, in expert order.

    Attributes:
        counts: host ints (from the dispatcher's single device-to-host copy).
        counts_device: the same counts, ``[E_local]`` int64 on the rows' device.
    """

    counts: list[int]
    counts_device: torch.Tensor

    @property
    def num_rows(self) -> int:
        return sum(self.counts)


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run these operands (else the bmm path runs).

    It needs CUDA sm90+ and bf16 operands whose row strides are 16-byte aligned (a multiple
    of 8 bf16 elements); older GPUs would get its slow per-group fallback, which syncs.
    """
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if any(t.dtype != torch.bfloat16 for t in (x, *weights)):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(d % 8 == 0 for w in weights for d in w.shape[1:])


def swiglu_experts(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, runs: ExpertRuns,
    *, use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """``y = W_down (silu(W_gate x) * W_up x)`` with run i of ``x`` through expert i.

    Args:
        x: ``[R, h]`` expert input, one run per local expert in order.
        w_gate, w_up: ``[E, f, h]``.
        w_down: ``[E, h, f]``.
        runs: the run lengths (``sum == R``, one per expert; zero-length runs allowed).
        use_grouped_mm: force a path (tests); ``None`` picks ``_grouped_mm`` when supported.

    Returns:
        ``[R, h]`` in ``x``'s row order.
    """
    assert len(runs.counts) == w_gate.shape[0] and runs.num_rows == x.shape[0], (runs.counts, x.shape)
    if runs.num_rows == 0:
        # No rows at all: still touch every weight, so each gets a (zero) gradient and the
        # trainer's grad reduction sees the same tensors on every rank.
        return x + 0.0 * (w_gate.sum() + w_up.sum() + w_down.sum())
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x, w_gate, w_up, w_down)
    if use_grouped_mm:
        return _swiglu_grouped_mm(x, w_gate, w_up, w_down, runs)
    return _swiglu_padded_bmm(x, w_gate, w_up, w_down, runs)


def _swiglu_grouped_mm(x, w_gate, w_up, w_down, runs: ExpertRuns) -> torch.Tensor:
    # offs[i] is the end row of expert i's run; the kernel reads it on the device (no sync).
    offs = runs.counts_device.cumsum(0).to(torch.int32)
    # [E, f, h] -> [E, h, f] as a view: _grouped_mm accepts column-major mat2, so no copy.
    gate = torch._grouped_mm(x, w_gate.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, w_up.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)


def padded_slots(runs: ExpertRuns, max_rows: int) -> torch.Tensor:
    """``[R]`` slot of each row in the flattened ``[E, max_rows]`` padded layout.

    Row r of expert e's run, j-th in that run, goes to ``e * max_rows + j``; built on the
    device from ``counts_device`` (``output_size`` from the host ints spares
    ``repeat_interleave`` its own sync).
    """
    counts = runs.counts_device
    num_experts, num_rows = counts.shape[0], runs.num_rows
    expert = torch.arange(num_experts, device=counts.device)
    row_expert = torch.repeat_interleave(expert, counts, output_size=num_rows)
    run_start = counts.cumsum(0) - counts
    within = torch.arange(num_rows, device=counts.device) - run_start[row_expert]
    return row_expert * max_rows + within


def _swiglu_padded_bmm(x, w_gate, w_up, w_down, runs: ExpertRuns) -> torch.Tensor:
    num_experts, hidden = w_gate.shape[0], x.shape[1]
    max_rows = max(runs.counts)
    if min(runs.counts) == max_rows:
        # Balanced runs are already the padded layout: a view, no copies.
        slab = x.view(num_experts, max_rows, hidden)
        return _swiglu_bmm(slab, w_gate, w_up, w_down).reshape(-1, hidden)
    slots = padded_slots(runs, max_rows)
    slab = x.new_zeros(num_experts * max_rows, hidden).index_copy(0, slots, x)
    out = _swiglu_bmm(slab.view(num_experts, max_rows, hidden), w_gate, w_up, w_down)
    return out.reshape(-1, hidden).index_select(0, slots)


def _swiglu_bmm(slab: torch.Tensor, w_gate, w_up, w_down) -> torch.Tensor:
    """``[E, M, h] -> [E, M, h]``; ``transpose`` views, so bmm reads the weights in place."""
    hidden = F.silu(torch.bmm(slab, w_gate.transpose(1, 2))) * torch.bmm(slab, w_up.transpose(1, 2))
    return torch.bmm(hidden, w_down.transpose(1, 2))
