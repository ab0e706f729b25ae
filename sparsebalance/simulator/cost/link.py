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
parameter all-gather (``comm.py``) and FSDP's unit gathers and reduce-scatters (``fsdp.py``).
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


def group_link(cluster: ClusterConfig, n: int) -> tuple[float, float]:
    """(bus bytes/s, seconds of fixed latency) of a collective over the first ``n`` data-parallel ranks
    of a stage (module docstring)."""
    per_node, inside = group_ranks_per_node(cluster, n)
    if inside:
        return cluster.tp_bandwidth, cluster.tp_latency
    return min(cluster.tp_bandwidth, per_node * cluster.allreduce_bandwidth), cluster.allreduce_latency
