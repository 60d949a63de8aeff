"""Built-in synthetic cluster models: a profile table made from link bandwidths, no hardware needed.

Model per collective on mesh (i ranks per node, j nodes, n = i*j), all L/i groups of a node at once:
    t = latency(op, i, j) + bus_factor(op, n) * bytes / busbw
    busbw = intra[op]                               if j == 1   (NVLink / NVSwitch)
          = min(intra[op], inter_per_gpu[op] * i)   if j > 1    (the node's NICs shared by L/i groups)
A ring (or NCCL's hierarchical variants) over several nodes is bound by the node's network share;
with i ranks of a group on each node, that share is i/L of the node's NICs.
Latency follows NCCL's algorithms: AllReduce may use a tree (start-up ~ log2 of the node count);
AllGather, ReduceScatter and Broadcast run as rings / chains, whose start-up grows with every one of
the n - 1 steps, each as slow as the slowest hop. This is what makes a 1024-rank AllGather of every
layer costly even when bandwidth alone says otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .profile_table import OPS, ProfileTable, Series, bus_factor
from .topology import Factor, PlanError


@dataclass(frozen=True)
class ClusterModel:
    name: str
    description: str
    gpus_per_node: int
    gpu_memory_gb: float
    peak_tflops: float  # dense bf16
    achievable_mfu: float  # compute efficiency the planner assumes for recompute cost
    memory_bandwidth_gbs: float  # what an element-wise optimizer update achieves (~60 % of HBM peak)
    intra_busbw: dict  # op -> GB/s
    inter_busbw_per_gpu: dict  # op -> GB/s, a GPU's share of its node's network
    step_latency_intra_s: float = 2e-6  # one ring step over NVLink
    step_latency_inter_s: float = 8e-6  # one ring step over the network
    tree_latency_s: float = 15e-6  # per tree level (log2 nodes) of an inter-node AllReduce
    base_latency_s: float = 8e-6  # kernel launch and protocol start-up

    def compute(self):
        from .solver import ComputeSpec

        return ComputeSpec(self.peak_tflops, self.achievable_mfu, self.memory_bandwidth_gbs)

    def busbw(self, op: str, mesh: Factor) -> float:
        if mesh.inter == 1:
            return self.intra_busbw[op] * 1e9
        return min(self.intra_busbw[op], self.inter_busbw_per_gpu[op] * mesh.intra) * 1e9

    def latency(self, op: str, mesh: Factor) -> float:
        step = self.step_latency_inter_s if mesh.inter > 1 else self.step_latency_intra_s
        ring = (mesh.size - 1) * step
        if op == "all_reduce":
            tree = 2 * (self.tree_latency_s * math.ceil(math.log2(mesh.inter)) + (mesh.intra - 1) * self.step_latency_intra_s)
            return self.base_latency_s + min(2 * ring, tree)
        return self.base_latency_s + ring

    def time(self, op: str, nbytes: float, mesh: Factor) -> float:
        return self.latency(op, mesh) + bus_factor(op, mesh.size) * nbytes / self.busbw(op, mesh)

    def table(self, meshes, sizes=None) -> ProfileTable:
        sizes = sizes or [2**k for k in range(10, 37)]  # 1 KiB .. 64 GiB
        series = {}
        for mesh in sorted(set(meshes)):
            if mesh.size == 1:
                continue
            for op in OPS:
                series[(op, mesh.intra, mesh.inter)] = Series(
                    tuple(sizes), tuple(self.time(op, s, mesh) for s in sizes))
        meta = {"source": f"synthetic:{self.name}", "description": self.description,
                "gpus_per_node": self.gpus_per_node, "device": self.name}
        return ProfileTable(meta, series)


CLUSTERS: dict[str, ClusterModel] = {
    # The paper's cluster: 8 x A800-80GB per node (NVLink 400 GB/s), 4 x HDR 200 Gb/s IB per node, no SHARP.
    # 4 x 25 GB/s = 100 GB/s per node, 12.5 GB/s per GPU. We assume 88 % of line rate for AllReduce, which
    # NCCL runs as the better of ring and double binary tree, and 80 % for the ring-only AllGather,
    # ReduceScatter and Broadcast.
    # Intra-node busbw: typical nccl-tests figures for A800 NVLink (8 GPUs).
    "a800-ib": ClusterModel(
        "a800-ib", "8 x A800-80GB per node, NVLink, 4 x HDR 200 Gb/s IB per node, no SHARP",
        gpus_per_node=8, gpu_memory_gb=80, peak_tflops=312.0, achievable_mfu=0.55, memory_bandwidth_gbs=1200.0,
        intra_busbw={"all_gather": 150.0, "reduce_scatter": 150.0, "all_reduce": 155.0, "broadcast": 150.0},
        inter_busbw_per_gpu={"all_gather": 10.0, "reduce_scatter": 10.0, "all_reduce": 11.0, "broadcast": 10.0},
    ),
    # docs/design.md §11: 2 x H200 on one host; virtual nodes via NCCL_HOSTID, tuned loopback sockets across them.
    # Measured busbw at 512 MiB: NVLink AR 312 / AG 265 / RS 262 / BC 362 GB/s; sockets 10.2 / 9.2 / 7.7 / 14.2.
    "h200-emulated": ClusterModel(
        "h200-emulated", "H200 host, virtual nodes over tuned loopback sockets (docs/design.md §11)",
        gpus_per_node=1, gpu_memory_gb=139, peak_tflops=989.0, achievable_mfu=0.35, memory_bandwidth_gbs=2900.0,
        intra_busbw={"all_gather": 265.0, "reduce_scatter": 262.0, "all_reduce": 312.0, "broadcast": 362.0},
        inter_busbw_per_gpu={"all_gather": 9.2, "reduce_scatter": 7.7, "all_reduce": 10.2, "broadcast": 14.2},
        step_latency_intra_s=3e-6, step_latency_inter_s=40e-6, tree_latency_s=60e-6,
    ),
}


def get_cluster(name: str) -> ClusterModel:
    try:
        return CLUSTERS[name]
    except KeyError:
        raise PlanError(f"--cluster {name!r}: unknown cluster (built-in: {', '.join(sorted(CLUSTERS))})") from None
