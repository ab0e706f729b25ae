"""Where the model lives on the cluster: the one home of the model's geometry.

A :class:`Layout` answers, for one (model, cluster): which decoder layers each virtual stage holds
(:func:`split_layers`, the one split rule), which device runs each virtual stage (:func:`placement`:
the schedule's loop or V placement) and which chunk of that device it is, which virtual stages a
device holds, the parameters each device holds, and a context-parallel rank's share: the CP degree
``cp``, the tokens one CP rank holds (:meth:`Layout.rank_tokens`, tokens / cp) and the inverse
(:meth:`Layout.group_tokens`, x cp), and the ranks that reduce a stage's gradients together
(:attr:`Layout.grad_group`, dp x cp). The latency model, the memory model, the executor, the
policies, the real run's stages and the stage check all ask it; none of them splits layers or
divides tokens by cp itself. The key blocks of a sequence are counted by ``data.sequence.blocks``
(in the lowest layer, so that data/ and kernels/ count them with the same function).

The mesh order is (dp, pp, cp, tp) from the outside in (:attr:`Layout.mesh`): global rank =
((d x pp + s) x cp + c) x tp + t, so TP ranks (the most traffic) are neighbours, then a stage's CP
group, then the stages of a replica, and DP crosses nodes first (:func:`mesh_rank`,
:func:`mesh_coords`, for any number of dimensions). The real run lays its ranks out with these
(``realrun/config.py``: (dp, pp, tp), a CP rank in the TP rank's place when tp = 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

import numpy as np

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import V_SCHEDULES, ClusterConfig, ModelConfig


def mesh_rank(coords: tuple[int, ...], inner: tuple[int, ...]) -> int:
    """Global rank of mesh coordinates (outermost first); ``inner`` = the sizes of every dimension
    but the outermost (e.g. (pp, tp))."""
    rank = coords[0]
    for c, size in zip(coords[1:], inner):
        rank = rank * size + c
    return rank


def mesh_coords(rank: int, inner: tuple[int, ...]) -> tuple[int, ...]:
    """Mesh coordinates (outermost first) of a global rank: the inverse of :func:`mesh_rank`."""
    out = []
    for size in reversed(inner):
        rank, c = divmod(rank, size)
        out.append(c)
    return (rank, *reversed(out))


def v_vstages(pp: int, device: int) -> tuple[int, int]:
    """The two virtual stages of ``device`` in the V placement: (chunk 0, chunk 1)."""
    return device, 2 * pp - 1 - device


def placement(schedule: str, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The device of every virtual stage, ``placement(...)[vs]``: under the loop placement of GPipe,
    1F1B, interleaved 1F1B and ZB-H1, vstage ``c * pp + s`` (chunk ``c``) lives on device ``s``; under
    the V placement of ZB-V and DualPipeV, device ``d`` holds vstages ``d`` and ``2 pp - 1 - d``
    (:func:`v_vstages`), so the first and the last vstage share device 0 and the two middle ones
    share device pp - 1 (their transfer is local: no P2P)."""
    if schedule in V_SCHEDULES:
        dev = [0] * (2 * pp)
        for d in range(pp):
            for vs in v_vstages(pp, d):
                dev[vs] = d
        return tuple(dev)
    return tuple(vs % pp for vs in range(pp * virtual_stages))


def split_layers(layers: int, chunks: int, end_fewer: int = 0) -> tuple[range, ...]:
    """``layers`` decoder layers in ``chunks`` contiguous ranges, as even as possible; when uneven
    the first ranges take one layer more (the last one already carries the LM head). With
    ``end_fewer`` (``cluster.end_stage_layers_fewer``) the first and the last range each hold that
    many layers fewer than such a split of ``layers + 2 x end_fewer`` would give them, for the
    embedding and the LM head they also carry (Llama 3, Grattafiori et al. 2024, section 3.3.2:
    126 layers on 16 x 2 virtual stages as 3, 4 x 30, 3)."""
    if not 1 <= chunks <= layers:
        raise ConfigError(f"cluster: pp x virtual_stages = {chunks} exceeds model.layers = {layers}; every "
                          "(virtual) stage needs at least one layer")
    if end_fewer:
        spread = split_layers(layers + 2 * end_fewer, chunks)
        sizes = [len(r) for r in spread]
        sizes[0] -= end_fewer
        sizes[-1] -= end_fewer
        if chunks < 2 or min(sizes) < 1:
            raise ConfigError(f"cluster.end_stage_layers_fewer: {end_fewer} fewer layers on the first and the "
                              f"last of {chunks} (virtual) stages leaves one without a layer ({layers} layers "
                              f"as {sizes}); it needs pp x virtual_stages >= 2 and a smaller value")
    else:
        base, extra = divmod(layers, chunks)
        sizes = [base + (v < extra) for v in range(chunks)]
    starts = list(accumulate(sizes, initial=0))
    return tuple(range(starts[v], starts[v + 1]) for v in range(chunks))


@dataclass(frozen=True, slots=True)
class Layout:
    """The geometry of ``model`` on ``cluster`` (build it with :func:`layout_of`: cached)."""

    model: ModelConfig
    """The model whose layers are placed."""
    cluster: ClusterConfig
    """The parallel plan they are placed on."""
    vstage_ranges: tuple[range, ...] = field(init=False)
    """Global layer indices of each virtual stage, vs = 0 .. pp x virtual_stages - 1."""
    devices: tuple[int, ...] = field(init=False)
    """The pipeline device (stage) of each virtual stage: the schedule's placement."""

    def __post_init__(self) -> None:
        c = self.cluster
        object.__setattr__(self, "vstage_ranges", split_layers(self.model.layers, c.pp * c.virtual_stages,
                                                                c.end_stage_layers_fewer))
        object.__setattr__(self, "devices", placement(c.schedule, c.pp, c.virtual_stages))

    @property
    def layer_counts(self) -> np.ndarray:
        """Decoder layers of each virtual stage, float [pp x virtual_stages] (a factor of the per-layer costs)."""
        return np.array([len(r) for r in self.vstage_ranges], dtype=float)

    @property
    def mesh(self) -> tuple[int, int, int, int]:
        """Sizes of the mesh dimensions, outermost first: (dp, pp, cp, tp)."""
        c = self.cluster
        return c.dp, c.pp, c.cp, c.tp

    # -- context parallelism: a CP rank's share of the tokens, and who reduces gradients together --
    @property
    def cp(self) -> int:
        """Ranks of a stage's context-parallel group (1: none)."""
        return self.cluster.cp

    @property
    def grad_group(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients together: the DP replicas
        x the CP ranks of a stage (each CP rank runs the whole stage on its share of the tokens)."""
        return self.cluster.dp * self.cluster.cp

    def rank_tokens(self, tokens):
        """What one CP rank holds of ``tokens`` (the group's): tokens / cp (as they are without
        CP); its P2P sends, TP all-reduces and activations are of this many."""
        return tokens / self.cluster.cp if self.cluster.cp > 1 else tokens

    def group_tokens(self, tokens):
        """The inverse: ``tokens`` held by one CP rank x cp. With CP the latency model's per-token
        tables are read at a micro-batch's tokens (their token axis stretched by cp when folded,
        ``cost/cp/pricing.py``), so a rank's share is priced at this count."""
        return tokens * self.cluster.cp

    def stage_layers(self, stage: int, chunk: int = 0) -> range:
        """Layers of model chunk ``chunk`` on pipeline stage ``stage``: virtual stage chunk x pp + stage
        (the interleaved numbering of Megatron and torch.distributed.pipelining)."""
        pp, v = self.cluster.pp, self.cluster.virtual_stages
        if not (0 <= stage < pp and 0 <= chunk < v):
            raise ConfigError(f"latency: stage must be in 0..{pp - 1} and chunk in 0..{v - 1}, "
                              f"got stage {stage}, chunk {chunk}")
        return self.vstage_ranges[chunk * pp + stage]

    def vstages_of(self, device: int) -> tuple[int, ...]:
        """The virtual stages device ``device`` runs, in model order."""
        return tuple(vs for vs, d in enumerate(self.devices) if d == device)

    def device_params(self, device: int) -> int:
        """Parameters device ``device`` holds before TP splitting: its virtual stages' layers, the
        embedding where virtual stage 0 lives, final norm + LM head where the last one lives (a tied
        head counted again when that is another device: Megatron keeps a copy there)."""
        m, dev = self.model, self.devices
        params = sum(len(r) for r, d in zip(self.vstage_ranges, dev) if d == device) * m.params_per_layer
        if device == dev[0]:
            params += m.embedding_params
        if device == dev[-1]:
            params += m.norm_params  # the final norm
            if not m.tie_embeddings or dev[0] != dev[-1]:
                params += m.head_params
        return params


@lru_cache(maxsize=64)
def layout_of(model: ModelConfig, cluster: ClusterConfig) -> Layout:
    """The (cached) :class:`Layout` of ``model`` on ``cluster``."""
    return Layout(model, cluster)
