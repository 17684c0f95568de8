"""The cluster figures the cost model predicts for: vendor accelerators, the simulated CPU cluster, and a spec's ``resources`` as a :class:`Cluster`.

``resources.gpu_type`` picks the vendor figures below; ``gpu_memory_gb``, ``gpu_peak_tflops``,
``intra_node_bandwidth_gbps``, ``inter_node_bandwidth_gbps`` give them one by one (bandwidths may
override a type's: fabrics differ). ``gpu_type: cpu``, and the default when no peak is given, is
the simulated CPU cluster (``--simulate``, local processes: gloo over loopback on one machine),
whose ranks share the machine's cores: its figures (:data:`CPU_FIGURES`) are measured by
bench/cpu_calibrate.py, and its step time is :mod:`service.spec.cost_cpu`'s (the machine's work
summed over ranks, per-message latency, no bubble) instead of :func:`service.spec.cost.step_time`.
Pure, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9

# Vendor figures per accelerator (SXM parts): dense bf16 TFLOP/s (without sparsity), memory in GB,
# NVLink one direction (NVIDIA quotes both directions together: 600 / 900 / 900 / 1800 GB/s), and one
# InfiniBand NIC per GPU one direction (HDR 200 Gb/s = 25 GB/s; NDR 400 Gb/s = 50 GB/s).
# A100: A100 datasheet (312 TFLOPS bf16, 80 GB HBM2e, NVLink 600 GB/s); DGX A100: 8x HDR.
# H100: H100 datasheet (989 TFLOPS bf16 dense = 1,979 with sparsity / 2, 80 GB, NVLink 900 GB/s); DGX H100: 8x NDR.
# H200: H200 datasheet (989 TFLOPS bf16 dense, 141 GB HBM3e, NVLink 900 GB/s); 8x NDR.
# B200: HGX B200 datasheet (2.25 PFLOPS bf16 dense = 4.5 sparse / 2, 180 GB HBM3e, NVLink 5 1,800 GB/s); DGX B200: 8x NDR.
GPU_FIGURES: dict[str, dict[str, float]] = {
    "A100": {"memory_gb": 80, "peak_tflops": 312, "intra_gbps": 300, "inter_gbps": 25},
    "H100": {"memory_gb": 80, "peak_tflops": 989, "intra_gbps": 450, "inter_gbps": 50},
    "H200": {"memory_gb": 141, "peak_tflops": 989, "intra_gbps": 450, "inter_gbps": 50},
    "B200": {"memory_gb": 180, "peak_tflops": 2250, "intra_gbps": 900, "inter_gbps": 50},
}
RAY_ACCELERATORS = {"A100": "A100", "A100-80G": "A100", "H100": "H100", "H200": "H200", "B200": "B200"}
"""Ray's ``accelerator_type`` labels (ray.util.accelerators) of the accelerators :data:`GPU_FIGURES`
holds, to their ``gpu_type`` (an A100 of 40 GB is not among them: its memory is not the A100's 80)."""


def gpu_type_of(accelerators) -> str | None:
    """The ``gpu_type`` of GPU nodes whose Ray labels are ``accelerators``: their common type when
    every node reports the same one :data:`GPU_FIGURES` knows; None for none, an unknown or a mixed
    cluster (the spec's own figures, or the simulated CPU cluster's, apply then)."""
    kinds = {RAY_ACCELERATORS.get(a) if a else None for a in accelerators}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


SIMULATED_CPU = {"memory_gb": 16, "peak_tflops": 0.1, "intra_gbps": 2, "inter_gbps": 1}
"""Figures a cluster described by ``gpu_peak_tflops`` without a type falls back on (memory, bandwidths)."""
# The simulated CPU cluster (``gpu_type: cpu``, and the default): ranks are single-threaded
# processes sharing one machine's cores (:mod:`service.spec.cost_cpu`). Measured on the 2-core dev
# VM by bench/cpu_calibrate.py with 8 ranks (the 2 x 4 simulated cluster): the machine's fp32 GEMM
# rate over all cores (peak_tflops: an achieved rate, no EFFICIENCY applied), gloo's loopback
# throughput of all ranks together (intra/inter: one machine), the wait per message of a collective
# per group size with every rank busy (hop_latency_s), the machine's memory bandwidth (a large add).
# Medians of 4-5 calibrations at load 9-18 (README "Auto layout" gives the spread); 16 GB assumed.
# process_mb: what a rank process adds whatever the model (a negligible one, measured in every layout
# of bench/auto_layout_bench.py at 35.7-37.6 MB): the modules it imports as it builds and steps
# (numpy.random alone ~14 MB), its process groups, autograd's and OpenMP's threads, first-use buffers.
CPU_FIGURES = {"memory_gb": 16, "peak_tflops": 0.1, "intra_gbps": 4.2, "inter_gbps": 4.2, "cores": 2,
               "hop_latency_s": {2: 0.00016, 4: 0.0009, 8: 0.002}, "memory_gbps": 13.6, "process_mb": 37}

@dataclass(frozen=True)
class Cluster:
    """The figures the cost model uses, in bytes and seconds."""

    name: str
    memory_bytes: float
    peak_flops: float
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    cores: int = 0
    """0: each rank has its own accelerator; n: the ranks share n cores (:mod:`service.spec.cost_cpu`;
    then peak and bandwidths are the whole machine's)."""
    hop_latency_s: tuple[tuple[int, float], ...] = ()
    """Shared cores: (group size, seconds per message of a collective in a group of that size: a
    receiver woken and scheduled), per measured group size."""
    memory_bytes_per_s: float = 0.0
    """Shared cores: the machine's memory bandwidth (the optimizer's update streams through it)."""
    process_bytes: float = 0.0
    """Shared cores: what a rank process holds whatever the model (counted in its peak). On an
    accelerator that is the CUDA context and NCCL's buffers, outside the device budget the peak is
    checked against (:data:`MEMORY_MARGIN` leaves room for them): 0."""

    def as_dict(self) -> dict:
        out = {"name": self.name, "memory_gb": self.memory_bytes / GB, "peak_tflops": self.peak_flops / 1e12,
               "intra_node_bandwidth_gbps": self.intra_bytes_per_s / GB,
               "inter_node_bandwidth_gbps": self.inter_bytes_per_s / GB}
        if self.cores:
            out.update(shared_cores=self.cores, hop_latency_s={str(g): t for g, t in self.hop_latency_s},
                       memory_bandwidth_gbps=self.memory_bytes_per_s / GB, process_mb=self.process_bytes / 2**20)
        return out


def cluster_of(resources) -> Cluster:
    """The cluster figures of a spec's ``resources`` section (validated: a type excludes memory and peak).
    ``gpu_type: cpu``, or no type and no ``gpu_peak_tflops``, is the simulated CPU cluster (shared cores)."""
    shared = resources.gpu_type == "cpu" or (resources.gpu_type is None and resources.gpu_peak_tflops is None)
    if shared:
        return _shared_cluster(resources)
    base = GPU_FIGURES[resources.gpu_type] if resources.gpu_type else SIMULATED_CPU
    name = resources.gpu_type or "simulated-cpu"
    given = {"memory_gb": resources.gpu_memory_gb, "peak_tflops": resources.gpu_peak_tflops,
             "intra_gbps": resources.intra_node_bandwidth_gbps, "inter_gbps": resources.inter_node_bandwidth_gbps}
    f = {k: (v if v is not None else base[k]) for k, v in given.items()}
    if any(v is not None for v in given.values()):
        name += " (as given)" if not resources.gpu_type else " (bandwidth as given)"
    return Cluster(name, f["memory_gb"] * GB, f["peak_tflops"] * 1e12, f["intra_gbps"] * GB, f["inter_gbps"] * GB)



def _shared_cluster(resources) -> Cluster:
    """The simulated CPU cluster's figures (:data:`CPU_FIGURES`), memory and bandwidths as given."""
    f = CPU_FIGURES
    given = {"memory_gb": resources.gpu_memory_gb, "intra_gbps": resources.intra_node_bandwidth_gbps,
             "inter_gbps": resources.inter_node_bandwidth_gbps}
    v = {k: (x if x is not None else f[k]) for k, x in given.items()}
    name = "simulated-cpu" + (" (as given)" if any(x is not None for x in given.values()) else "")
    return Cluster(name, v["memory_gb"] * GB, f["peak_tflops"] * 1e12, v["intra_gbps"] * GB, v["inter_gbps"] * GB,
                   cores=f["cores"], hop_latency_s=tuple(sorted(f["hop_latency_s"].items())),
                   memory_bytes_per_s=f["memory_gbps"] * GB, process_bytes=f["process_mb"] * 2**20)
