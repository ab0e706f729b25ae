"""The link a data-parallel group's collectives run on: NVLink inside a node, rails across nodes.

The mesh is (dp, pp, cp, tp) from the outside in (``Layout.mesh``). A data-parallel group (the
gradient group dp x cp, or FSDP's sharding group) takes the CP ranks of a stage first, then its DP
replicas: its ranks sit ``tp`` apart within CP and ``pp x cp x tp`` apart across DP.

* **Inside one node** (the group's ranks span at most ``gpus_per_node``): the node's NVLink, at
  ``tp_bandwidth`` / ``tp_latency`` (the bus bandwidth NCCL reaches there; Hopper 370 GB/s).
* **Across nodes**: NCCL builds one ring (or tree) per NIC -- each GPU's rail -- so the group's
  collective moves its ranks-per-node shares in parallel; the bus bandwidth is one GPU's fabric
  rate (``allreduce_bandwidth``: one NIC) x the group's ranks per node, capped by NVLink, at
  ``allreduce_latency``. With TP 8 one rank per node is in the group: one NIC, as before.

Every DP collective asks :func:`group_link`: the DDP and ZeRO-1 gradient reductions and ZeRO-1's
parameter all-gather (``comm.py``) and FSDP's unit gathers and reduce-scatters (``fsdp.py``). Its
latency grows with the ring's steps where the cluster prices them (``nvlink_step_latency``,
``net_step_latency``: NCCL's own model of its ring, set by the GPU presets).
"""

from __future__ import annotations

from sparsebalance.simulator.config import ClusterConfig


def group_ranks_per_node(cluster: ClusterConfig, n: int) -> tuple[int, bool]:
    """(ranks of the group in one node, whether the whole group lies in one node) for the group of
    the first ``n`` of a stage's data-parallel ranks (CP first, then DP)."""
    c = cluster
    stride_cp, stride_dp = c.tp, c.pp * c.cp * c.tp
    if n <= c.cp:
        span = n * stride_cp
        per_node = max(1, min(n, c.gpus_per_node // stride_cp))
    else:
        span = (n // c.cp - 1) * stride_dp + c.cp * stride_cp
        per_node = max(1, min(c.cp, c.gpus_per_node // stride_cp) * min(n // c.cp, max(1, c.gpus_per_node // stride_dp)))
    return per_node, span <= c.gpus_per_node


COLLECTIVES = ("allgather", "reducescatter", "allreduce")


def ring_steps(n: int, nodes: int, collective: str) -> tuple[int, int]:
    """(steps inside a node, steps across nodes) of NCCL's ring ``collective`` over ``n`` ranks on
    ``nodes`` nodes, as NCCL's tuning model counts them (``src/graph/tuning.cc``): an all-gather or a
    reduce-scatter n - 1 steps, N - 1 of them across nodes; an all-reduce 2 (n - 1), 2 N across
    (none on one node)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective: must be one of {', '.join(COLLECTIVES)}, got {collective!r}")
    if n <= 1:
        return 0, 0
    if collective == "allreduce":
        total, inter = 2 * (n - 1), (2 * nodes if nodes > 1 else 0)
    else:
        total, inter = n - 1, nodes - 1
    inter = min(inter, total)
    return total - inter, inter


def ring_latency(cluster: ClusterConfig, n: int, nodes: int, collective: str) -> float:
    """Seconds of latency of a ring ``collective`` over ``n`` ranks on ``nodes`` nodes: the link's
    fixed latency (``tp_latency`` in one node, ``allreduce_latency`` across) + each ring step's
    (``nvlink_step_latency`` inside a node, ``net_step_latency`` across: :func:`ring_steps`), so a
    ring over many ranks pays for its steps."""
    intra, inter = ring_steps(n, nodes, collective)
    fixed = cluster.tp_latency if nodes == 1 else cluster.allreduce_latency
    return fixed + intra * cluster.nvlink_step_latency + inter * cluster.net_step_latency


def group_link(cluster: ClusterConfig, n: int, collective: str = "allreduce") -> tuple[float, float]:
    """(bus bytes/s, seconds of latency) of a ring ``collective`` over the first ``n`` data-parallel
    ranks of a stage (module docstring; latency: :func:`ring_latency`)."""
    per_node, inside = group_ranks_per_node(cluster, n)
    if inside:
        return cluster.tp_bandwidth, ring_latency(cluster, n, 1, collective)
    bandwidth = min(cluster.tp_bandwidth, per_node * cluster.allreduce_bandwidth)
    return bandwidth, ring_latency(cluster, n, -(-n // per_node), collective)
