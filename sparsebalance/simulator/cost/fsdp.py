"""FSDP / ZeRO-3 (and ZeRO-2) priced unit by unit: each decoder layer's parameters gathered before it
runs and its gradient reduce-scattered after its backward, overlapped with compute where it fits.

**Units** of a virtual stage (``Layout.vstage_ranges``; one TP shard, so parameters / tp): a *root*
unit holding what is not a decoder layer (the embedding on virtual stage 0; the final norm and the
LM head on the last) and one unit per decoder layer. The root is gathered at the start of every
forward and, as FSDP2 does for its root, kept until the backward has run (no gather there); its
gradient is reduce-scattered last. The action's compute (``StageCost``'s seconds) is spread evenly
over the layer units; the root computes nothing of its own (the lookup and the head run inside the
first / last layer's share).

**Collectives** over the sharding group of n ranks (``cluster.fsdp_group``), on the link of that
group (:func:`.link.group_link`: the node's NVLink when the group fits in one node; across nodes
one ring per NIC, so the fabric rate x the group's ranks per node, capped by NVLink):

    AG_u = latency + (n - 1) / n x P_u x param_gather_bytes / bandwidth
    RS_u = latency + (n - 1) / n x P_u x grad_reduce_bytes / bandwidth

**Timeline** of one action (a stage's forward or backward of one micro-batch; seconds from its
start), the link serving one collective at a time in issue order, as one NCCL communicator does
(with ``fsdp_grad_sync = "last"`` only the first micro-batch's forward gathers and only the last
one's backward reduce-scatters, the units staying gathered in between):

* forward (zero2 and zero3): a unit's gather is issued once the previous gather is done and the
  previous unit has started computing (at most two units gathered at once: FSDP's
  ``limit_all_gathers``, FSDP2's implicit prefetch): ``ag_end(u) = max(ag_end(u-1), start(u-1)) +
  AG_u``, ``start(u) = max(end(u-1), ag_end(u))``, ``end(u) = start(u) + f_u``.
* backward, units in reverse: zero3 gathers the first at the action's start and, with
  ``fsdp_backward_prefetch = "pre"``, the next one as a unit's gradient computation starts (ahead of
  its reduce-scatter), with ``post`` after it (behind the reduce-scatter); zero2 gathers nothing.
  Each unit's reduce-scatter is issued when its computation ends. The action ends when both its
  compute and its last reduce-scatter are done: gradients are reduced at every micro-batch
  (FSDP's default under gradient accumulation), so what the link cannot hide is exposed. Reduced
  once a step with pp > 1 they run behind the pipeline instead and the step's end waits for them
  (:attr:`FsdpPricing.background`); under torch's pipelining all after the backward, waited for
  (:attr:`FsdpPricing.reduce_after`). Under a multi-stage torch or Llama 3 pipeline a device gathers
  its first virtual stages from the step's start (:attr:`FsdpPricing.ahead`).

**Lock-step across the group.** A collective completes only when every rank of the sharding group
has joined it, and each rank joins unit u + 1's gather as it starts unit u: the group's ranks walk
through an action's units together, so an action whose collectives run takes, on every rank, the
compute of the group's slowest rank for that micro-batch (:meth:`FsdpPricing.lockstep`; the units'
compute shares are the same on every rank, so the sum over units of the per-unit maximum is the
maximum of the sums). Under FSDP micro-batch j's balance across the DP ranks matters, not only each
rank's total.

The exposed part (action time - compute) is what the executor adds to each F and B action; the
policies balance compute (``StageCost``) and do not see it. With hybrid sharding (``fsdp_shard`` <
dp x cp) the shards' gradients are all-reduced across replicas after the last backward
(:meth:`FsdpPricing.replica_allreduce`). The optimizer steps 1/n of the parameters
(``comm.optimizer_time``); memory: ``cost/memory.py``. Sources and hand calculations:
docs/costmodel.md, 'FSDP / ZeRO-3'; tests/simulator/test_fsdp.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.link import group_link, ring_latency
from sparsebalance.simulator.layout import Layout

AHEAD_STAGES = 3
"""Virtual stages a device gathers ahead (torch's ``_add_unshard_reshard(max_active_stages=3)``)."""


@dataclass(frozen=True, slots=True)
class Units:
    """The units of one virtual stage (parameters per TP rank)."""

    root: int
    """Parameters of the root unit on this virtual stage (0 when it holds no embedding or head)."""
    layers: int
    """Decoder layers (one unit each)."""
    per_layer: int
    """Parameters of one layer unit."""

    @property
    def params(self) -> int:
        return self.root + self.layers * self.per_layer


@dataclass(frozen=True, slots=True)
class Event:
    """One collective of an action's timeline (seconds from the action's start)."""

    op: str
    """``AG`` (all-gather) or ``RS`` (reduce-scatter)."""
    unit: int
    """-1 for the root, else the layer's index within the virtual stage."""
    start: float
    end: float
    nbytes: float
    """Bytes of the unit's whole tensor (what the group gathers or reduces)."""


class FsdpPricing:
    """Unit gathers and reduce-scatters of one (model, cluster) under ``dp_mode`` zero2 / zero3."""

    def __init__(self, model: ModelConfig, cluster: ClusterConfig, layout: Layout) -> None:
        self.model, self.cluster, self.layout = model, cluster, layout
        self.n = cluster.fsdp_group
        self.gather_bytes = cluster.param_gather_bytes or model.dtype_bytes
        self.reduce_bytes = cluster.grad_reduce_bytes or model.dtype_bytes
        self.bandwidth, self.latency = self.link()
        self.once = cluster.fsdp_grad_sync == "last"
        """Whether a step gathers once (first micro-batch's forward) and reduce-scatters once (last
        micro-batch's backward), the units kept gathered in between (``fsdp_grad_sync = "last"``)."""
        self.regather = cluster.dp_mode == "zero3" and not self.once
        """Whether the backward gathers again (zero3 at every micro-batch); zero2 keeps the forward's units."""
        self.post = cluster.fsdp_backward_prefetch == "post"
        self.reduce_after = self.once and cluster.pp_impl == "torch"
        """Whether a stage's last backward reduce-scatters only once it is done, every unit back to
        back, and its device waits for them: torch.distributed.pipelining runs every backward of an
        FSDP stage with gradient sync off and reduces in ``perform_reduce_grad`` after the stage's
        last backward, whose final callback makes the compute stream wait (torch 2.13 ``stage.py``
        L843-847, L1164-1191; ``schedules.py`` L1177 and REDUCE_GRAD). Elsewhere a unit's
        reduce-scatter starts as its gradient is done, under the rest of the backward."""
        self.background = self.once and cluster.pp > 1 and not self.reduce_after
        """Whether a stage's once-a-step reduce-scatters run behind the pipeline: each unit's issued as
        its gradient is done in the virtual stage's last backward, on the device's one link, and only
        the step's end (the optimizer) waits for them, so the backward's gradient goes to the stage
        before at once (:meth:`tail_exposed`); FSDP's post-backward hooks reduce on their own stream,
        and with PP that backward is not the device's last action."""
        self.ahead = self.once and cluster.pp_impl in ("torch", "meta") and cluster.virtual_stages > 1
        """Whether a device's first :data:`AHEAD_STAGES` virtual stages are gathered ahead, from the
        step's start, instead of when their first forward starts: torch.distributed.pipelining's
        multi-stage (runtime) schedules insert an UNSHARD (``unshard(async_op=True)`` of every FSDP
        unit) for the next ``max_active_stages = 3`` stages before a device's first action (torch
        2.13 ``schedules.py``, ``_add_unshard_reshard``); Llama 3's pipeline is assumed to do the same."""
        self._ahead: set[int] | None = None
        """:meth:`ahead_vstages`, once found."""
        last = len(layout.vstage_ranges) - 1
        tp = cluster.tp
        self.units: list[Units] = []
        for vs, layers in enumerate(layout.vstage_ranges):
            root = 0
            if vs == 0:
                root += model.embedding_params
            if vs == last:
                # a tied head is a second copy only on another device (as Layout.device_params counts it)
                copy = not model.tie_embeddings or layout.devices[0] != layout.devices[last]
                root += model.norm_params + (model.head_params if copy else 0)
            self.units.append(Units(root=round(root / tp), layers=len(layers),
                                    per_layer=round(model.params_per_layer / tp)))

    def link(self) -> tuple[float, float]:
        """(bus bytes/s, seconds of latency) of the sharding group's collectives (:func:`.comm.group_link`)."""
        return group_link(self.cluster, self.n, "allgather")  # a reduce-scatter takes the same ring steps

    def _collective(self, params: float, nbytes: int) -> float:
        if self.n == 1 or params == 0:
            return 0.0
        return self.latency + (self.n - 1) / self.n * params * nbytes / self.bandwidth

    def gather(self, params: float) -> float:
        """Seconds of one unit's all-gather (``params`` per TP rank)."""
        return self._collective(params, self.gather_bytes)

    def vstage_gather(self, vstage: int) -> float:
        """Seconds of all the unit gathers of virtual stage ``vstage``, back to back (root + layers)."""
        u = self.units[vstage]
        return self.gather(u.root) + u.layers * self.gather(u.per_layer)

    def reduce_scatter(self, params: float) -> float:
        """Seconds of one unit's gradient reduce-scatter."""
        return self._collective(params, self.reduce_bytes)

    def replica_allreduce(self, stage: int) -> float:
        """Seconds of hybrid sharding's all-reduce of device ``stage``'s gradient shard across the
        dp x cp / n replicas (ring, on the fabric); 0 without replicas."""
        c = self.cluster
        r = c.dp * c.cp // self.n
        if r == 1:
            return 0.0
        nbytes = self.layout.device_params(stage) / c.tp / self.n * self.reduce_bytes
        latency = ring_latency(c, r, r, "allreduce")  # one replica per node: every step crosses nodes
        return latency + 2 * (r - 1) / r * nbytes / c.allreduce_bandwidth

    # -- one action's timeline ----------------------------------------------------------------------
    def action(self, compute, vstage: int, *, backward: bool, events: list[Event] | None = None,
               lead=None):
        """Seconds of one action whose compute takes ``compute`` seconds (numpy-broadcastable), with
        its collectives as the module docstring's timeline runs them; ``events`` (scalar ``compute``
        only) collects them for the trace. ``lead`` (a forward gathered ahead, :attr:`ahead`): the
        unit gathers were all issued, back to back, ``lead`` seconds before the action's start
        (negative: after it, behind other stages' gathers); each unit computes once it is gathered."""
        u = self.units[vstage]
        c = np.asarray(compute, dtype=float)
        if self.n == 1:
            return c
        f = c / u.layers
        ag_layer, ag_root = self.gather(u.per_layer), self.gather(u.root)
        rs_layer, rs_root = self.reduce_scatter(u.per_layer), self.reduce_scatter(u.root)
        pb, gb, rb = u.per_layer * self.gather_bytes, u.root * self.gather_bytes, self.reduce_bytes

        def note(op, unit, a, b, nbytes):
            if events is not None and float(b) > float(a):
                events.append(Event(op, unit, float(a), float(b), float(nbytes)))

        zero = np.zeros_like(c)
        if not backward and lead is not None:
            link = zero + ag_root - lead
            note("AG", -1, -lead, link, gb)
            end = np.maximum(zero, link)
            for i in range(u.layers):
                a, link = link, link + ag_layer
                note("AG", i, a, link, pb)
                end = np.maximum(end, link) + f
            return end
        if not backward:
            link = zero + ag_root  # the root first, then each layer; compute waits for its unit
            note("AG", -1, 0.0, link, gb)
            start = end = link
            for i in range(u.layers):
                a = np.maximum(link, start) if i else link
                link = a + ag_layer
                note("AG", i, a, link, pb)
                start = np.maximum(end, link)
                end = start + f
            return end
        if self.reduce_after:  # every unit's reduce-scatter after the whole backward, waited for
            link = c
            for i in reversed(range(u.layers)):
                a, link = link, link + rs_layer
                note("RS", i, a, link, u.per_layer * rb)
            if u.root:
                a, link = link, link + rs_root
                note("RS", -1, a, link, u.root * rb)
            return link
        link, end = zero, zero
        gathered = zero
        if self.regather:
            gathered = link = zero + ag_layer
            note("AG", u.layers - 1, 0.0, link, pb)
        for i in reversed(range(u.layers)):
            start = np.maximum(end, gathered)
            nxt = self.regather and i > 0
            if nxt and not self.post:
                a = np.maximum(link, start)
                gathered = link = a + ag_layer
                note("AG", i - 1, a, link, pb)
            end = start + f
            a = np.maximum(link, end)
            link = a + rs_layer
            note("RS", i, a, link, u.per_layer * rb)
            if nxt and self.post:
                a = link
                gathered = link = a + ag_layer
                note("AG", i - 1, a, link, pb)
        if u.root:
            a = np.maximum(link, end)
            link = a + rs_root
            note("RS", -1, a, link, u.root * rb)
        return np.maximum(end, link)

    def events(self, compute: float, vstage: int, *, backward: bool, lead: float | None = None) -> list[Event]:
        """The collectives of one action (the trace's AG / RS rows), in issue order."""
        out: list[Event] = []
        self.action(compute, vstage, backward=backward, events=out, lead=lead)
        return out

    def ahead_vstages(self) -> set[int]:
        """The virtual stages gathered ahead (:attr:`ahead`): on each device the first
        :data:`AHEAD_STAGES` of its virtual stages in the order its schedule first runs them (found
        once: a property of the schedule, asked at every pass of every iteration)."""
        from sparsebalance.simulator.schedule.schedules import fewest_microbatches, stage_orders

        if self._ahead is None:
            c = self.cluster
            self._ahead = set()
            orders = stage_orders(c.schedule, c.pp, fewest_microbatches(c.schedule, c.pp), c.virtual_stages)
            for order in orders if self.ahead else []:
                first = list(dict.fromkeys(vs for kind, vs, _ in order if kind == "F"))
                self._ahead.update(first[:AHEAD_STAGES])
        return self._ahead

    def leads(self, forward_start: np.ndarray) -> np.ndarray:
        """[V, dp] ``lead`` of each virtual stage's first forward (:meth:`action`) from
        ``forward_start`` [dp, V, m] (the engine's, from a pass with those gathers free): a device
        issues the gathers of its :meth:`ahead_vstages` at the step's start, one stage after another
        in first-use order; NaN for the stages gathered when their forward starts."""
        dp, nv, _ = forward_start.shape
        out = np.full((nv, dp), np.nan)
        ahead = self.ahead_vstages()
        for d in range(self.cluster.pp):
            mine = sorted((vs for vs in self.layout.vstages_of(d) if vs in ahead),
                          key=lambda vs: forward_start[:, vs, 0].min())
            issued = 0.0
            for vs in mine:
                out[vs] = forward_start[:, vs, 0] - issued
                issued += self.vstage_gather(vs)
        return out

    def pays(self, j: int, m: int, *, backward: bool) -> bool:
        """Whether micro-batch ``j`` (of ``m`` per replica) runs collectives in its forward / backward:
        every one, or with ``fsdp_grad_sync = "last"`` the first forward and the last backward."""
        return not self.once or j == (m - 1 if backward else 0)

    def _paying(self, cols: int, m: int, *, backward: bool) -> np.ndarray:
        """[cols] mask of the replica-major columns whose actions run collectives (:meth:`pays`)."""
        j = np.arange(cols) % m
        return np.ones(cols, dtype=bool) if not self.once else j == (m - 1 if backward else 0)

    def reduce_queue(self, start: np.ndarray, end: np.ndarray) -> list[tuple[int, int, Event]]:
        """(replica, virtual stage, RS event in step seconds) of every once-a-step reduce-scatter run
        behind the pipeline (:attr:`background`), from the engine's ``start`` and ``end`` [dp, V] of
        each virtual stage's last backward: each unit's issued as its gradient is done (the action's
        compute spread evenly over its layers, last layer first, the root last) and run one at a time
        on its device's link in issue order, so one virtual stage's wait behind another's on the same
        device shows (what :meth:`tail_exposed` prices, and the trace's RS rows)."""
        out: list[tuple[int, int, Event]] = []
        rb = self.reduce_bytes
        for d in range(self.cluster.pp):
            for r in range(start.shape[0]):
                issued: list[tuple[float, float, int, int, float]] = []  # (issue, seconds, vs, unit, bytes)
                for vs in self.layout.vstages_of(d):
                    u, s, e = self.units[vs], float(start[r, vs]), float(end[r, vs])
                    issued += [(s + (e - s) * (k + 1) / u.layers, self.reduce_scatter(u.per_layer), vs,
                                u.layers - 1 - k, u.per_layer * rb) for k in range(u.layers)]
                    if u.root:
                        issued.append((e, self.reduce_scatter(u.root), vs, -1, u.root * rb))
                link = 0.0
                for t, dur, vs, unit, nbytes in sorted(issued, key=lambda x: (x[0], x[1])):
                    a = max(link, t)
                    link = a + dur
                    out.append((r, vs, Event("RS", unit, a, link, float(nbytes))))
        return out

    def tail_exposed(self, start: np.ndarray, end: np.ndarray, finish: np.ndarray) -> np.ndarray:
        """[pp] seconds each device's step end waits for its reduce-scatters (:attr:`background`):
        the last of its :meth:`reduce_queue` past ``finish`` [dp, pp], the end of each device's last
        action; the most over replicas. ``start``, ``end`` as :meth:`reduce_queue`."""
        out = np.zeros(self.cluster.pp)
        devices = self.layout.devices
        for r, vs, e in self.reduce_queue(start, end):
            d = devices[vs]
            out[d] = max(out[d], e.end - float(finish[r, d]))
        return np.maximum(out, 0.0)

    def lockstep(self, times: np.ndarray, m: int, *, backward: bool) -> np.ndarray:
        """[V, dp x m] compute seconds with each action whose collectives run (:meth:`pays`) raised to
        the slowest of its sharding group's DP replicas for the same (virtual stage, micro-batch)
        (module docstring). The group of ``fsdp_group`` ranks takes the CP ranks of a stage first
        (they run inside one replica's action), then ``fsdp_group // cp`` consecutive DP replicas."""
        v, cols = times.shape
        dp = cols // m
        g = min(max(1, self.n // self.cluster.cp), dp)  # columns holding fewer replicas: one group
        if g == 1 or dp % g:
            return times
        grouped = times.reshape(v, dp // g, g, m)
        synced = np.broadcast_to(grouped.max(axis=2, keepdims=True), grouped.shape).reshape(v, cols)
        return np.where(self._paying(cols, m, backward=backward), synced, times)

    def actions(self, times: np.ndarray, m: int, *, backward: bool, leads: np.ndarray | None = None) -> np.ndarray:
        """[V, dp x m] seconds of each action from its compute ``times`` [V, dp x m] (virtual stage
        by row; columns replica-major, ``m`` micro-batches per replica): in lock-step across the
        sharding group (:meth:`lockstep`), + what the collectives leave exposed. ``leads`` [V, dp]
        (forward, :meth:`leads`): the first forwards' gathers issued that far ahead (NaN: not)."""
        synced = self.lockstep(times, m, backward=backward)

        if backward and self.background:  # reduced behind the pipeline: the step's end pays (tail_exposed)
            return synced

        def lead(vs: int):
            if backward or leads is None or np.isnan(leads[vs]).any():
                return None
            return np.repeat(leads[vs], m)

        out = np.stack([self.action(row, vs, backward=backward, lead=lead(vs)) for vs, row in enumerate(synced)])
        return np.where(self._paying(times.shape[1], m, backward=backward), out, times)


def fsdp_rows(fsdp: FsdpPricing, compute: dict[str, np.ndarray], layout: Layout, plan, mean_budget: np.ndarray, *,
              kinds: list[str], start: np.ndarray, end: np.ndarray, iteration: int, columns: tuple[str, ...],
              leads: np.ndarray | None = None):
    """Trace rows (``columns``: the trace schema) of every unit gather (``AG``) and reduce-scatter
    (``RS``) inside each F and B action, placed from the action's start (``start`` [dp, kinds, V, m],
    the engine's) by the action's own timeline from its compute ``compute`` [dp, V, m] per mode;
    the reduce-scatters run behind the pipeline (:attr:`FsdpPricing.background`) where their
    device's link ran them (:meth:`FsdpPricing.reduce_queue`, from the last backwards' ``start``
    and ``end``), past their action's end where they queue. ``tokens`` holds the micro-batch's
    tokens, ``budget`` its mean budget, as on the action's row; ``leads`` [V, dp]
    (:meth:`FsdpPricing.leads`) places the gathers issued ahead before their forward."""
    import pandas as pd

    devices = layout.devices
    out: dict[str, list] = {c: [] for c in columns}
    cache: dict[tuple[float, int, bool, float | None], list[Event]] = {}  # equal actions recur
    queued: dict[tuple[int, int], list[Event]] = {}
    if fsdp.background and "B" in kinds and "B" in compute:
        kb, last = kinds.index("B"), compute["B"].shape[2] - 1
        for r, vs, e in fsdp.reduce_queue(start[:, kb, :, last], end[:, kb, :, last]):
            queued.setdefault((r, vs), []).append(e)

    def add(r: int, vs: int, j: int, mb, e: Event, t0: float) -> None:
        for col, val in (("iteration", iteration), ("dp_rank", r), ("stage", devices[vs]), ("microbatch", j),
                         ("op", e.op), ("start_s", t0 + e.start), ("end_s", t0 + e.end), ("tokens", mb.tokens),
                         ("budget", float(mean_budget[r, j]))):
            out[col].append(val)

    for kind in ("F", "B"):
        if kind not in kinds or kind not in compute:
            continue
        ki = kinds.index(kind)
        m = compute[kind].shape[2]
        for r, j, mb in plan.microbatches():
            if not fsdp.pays(j, m, backward=kind == "B"):
                continue
            for vs in range(len(devices)):
                if kind == "B" and fsdp.background:  # in step seconds already
                    for e in queued.get((r, vs), []):
                        add(r, vs, j, mb, e, 0.0)
                    continue
                sec = float(compute[kind][r, vs, j])
                lead = None if leads is None or kind == "B" or np.isnan(leads[vs, r]) else float(leads[vs, r])
                key = (sec, vs, kind == "B", lead)
                if key not in cache:
                    cache[key] = fsdp.events(sec, vs, backward=kind == "B", lead=lead)
                t0 = float(start[r, ki, vs, j])
                for e in cache[key]:
                    add(r, vs, j, mb, e, t0)
    return pd.DataFrame(out, columns=list(columns))
