"""One pipeline stage of the Qwen2 model: which layers it holds and its forward.

Each rank builds only its own stage (:func:`build_stage_module`): the model skeleton on the meta
device, then the stage's pieces materialised, from the local checkpoint (HF safetensors/bin, read
tensor by tensor) or from the run seed (weights seeded per parameter, so they equal the same layers
of the full model built in one process). The first stage holds the embedding, the last the final
norm + LM head + loss, every stage a contiguous slice of decoder layers (``simulator/layout.py``'s split, the latency
model's, so predicted and measured stages hold the same layers). Layers keep their global ``layer_idx``, so
per-layer budgets and the coverage layer address the same layer whatever the split.
"""

from __future__ import annotations

from typing import Any


def build_stage_module(cfg: Any, rr: Any, stage: int, pp: int, device: Any):
    """This rank's :class:`StageModule`, without building the rest of the model: ``cfg`` a RunConfig,
    ``rr`` its RealrunConfig (checkpoint, dtype, layer_impl). Peak memory is the stage's weights plus
    one piece."""
    import torch

    from sparsebalance.kernels import qwen2_init as Q
    from sparsebalance.kernels.qwen2 import build_qwen2_pieces
    from sparsebalance.simulator.layout import split_layers

    layers = split_layers(cfg.model.layers, pp, cfg.cluster.end_stage_layers_fewer)[stage]
    names = Q.pieces(layers, embed=stage == 0, head=stage == pp - 1)
    if rr.checkpoint:
        from sparsebalance.realrun.checkpoint import CheckpointReader, hf_config

        directory = cfg.resolve(rr.checkpoint)
        net = Q.skeleton(hf_config(directory))
        reader = CheckpointReader(directory)
        Q.materialize(net, names, reader, dtype=getattr(torch, rr.dtype), device=device)
        reader.close()
        net.train()
    else:
        net = build_qwen2_pieces(cfg.model, names, seed=cfg.seed, dtype=rr.dtype, device=device)
    from sparsebalance.realrun.config import layer_impl

    return StageModule(net, stage, pp, layers, layer_impl(cfg, rr))


def build_stage(net: Any, stage: int, pp: int, layer_range: range, layer_impl: str = "eager"):
    """Cut ``net`` (a Qwen2ForCausalLM, whole or with at least this stage's pieces materialised) to
    the modules of ``stage``; returns a :class:`StageModule`."""
    return StageModule(net, stage, pp, layer_range, layer_impl)


def _module_base():
    import torch

    return torch.nn.Module


class StageModule(_module_base()):  # type: ignore[misc]
    """The modules of one stage; ``forward`` returns hidden states [1, T, hidden] or, on the last
    stage, the summed LM loss (a scalar) of the micro-batch. With virtual stages (interleaved 1F1B)
    a device holds one StageModule per model chunk: ``stage`` / ``pp`` are then the virtual stage
    and their count, and ``simulator.layout.split_layers`` with them gives the chunk's layers.
    ``layer_impl``: eager or compiled (``kernels/fastlayer.py``), how its layers and head run."""

    def __init__(self, net: Any, stage: int, pp: int, layer_range: range, layer_impl: str = "eager") -> None:
        import torch

        super().__init__()
        self.stage, self.pp = stage, pp
        self.layer_impl = layer_impl
        self.first, self.last = stage == 0, stage == pp - 1
        self.layer_range = layer_range
        inner = torch.nn.Module()
        inner.layers = torch.nn.ModuleList([net.model.layers[i] for i in layer_range])
        inner.rotary_emb = net.model.rotary_emb
        if self.first:
            inner.embed_tokens = net.model.embed_tokens
        if self.last:
            inner.norm = net.model.norm
            # a tied LM head shares the embedding Parameter only when both live on this stage
            self.lm_head = net.lm_head
        self.model = inner
        self.config = net.config
        self.score = False
        """Last stage: also count the labels its forward predicts exactly (``realrun.score_labels``)."""
        self.hits = (0, 0)
        """(labels predicted exactly (argmax), labels) of the last forward, when ``score``."""

    def forward(self, hidden: Any, batch: Any, moba: Any) -> Any:
        from sparsebalance.kernels.qwen2 import head_loss, lm_loss_sum, run_layers

        if self.first and hidden is None:  # a given hidden: the embedding ran apart (split backward)
            hidden = self.model.embed_tokens(batch.input_ids)
        hidden = run_layers(self, hidden, batch, moba, impl=self.layer_impl)
        if self.last:
            if not self.score:
                return head_loss(self.model.norm, self.lm_head, hidden, batch.labels, self.layer_impl)
            # scoring needs the logits themselves: the whole-logits head (the accuracy runs are eager)
            import torch

            from sparsebalance.kernels.qwen2 import IGNORE_INDEX

            logits = self.lm_head(self.model.norm(hidden))
            with torch.no_grad():
                m = batch.labels[0] != IGNORE_INDEX
                self.hits = (int((logits[0][m].argmax(-1) == batch.labels[0][m]).sum()), int(m.sum()))
            return lm_loss_sum(logits, batch.labels)
        return hidden

    def warm_up(self) -> None:
        """Compile a compiled stage's regions before the first timed action (no-op when eager)."""
        if self.layer_impl == "compiled":
            from sparsebalance.kernels.qwen2 import warm_up

            warm_up(self.model.layers, (self.model.norm, self.lm_head) if self.last else None)

    def global_state_dict(self) -> dict[str, Any]:
        """This stage's weights under the full model's (Hugging Face) names: layer i is
        ``model.layers.<global i>``, so stages' dicts merge into one checkpoint."""
        out = {}
        lo = self.layer_range.start
        for name, t in self.state_dict().items():
            if name.startswith("model.layers."):
                idx, rest = name.removeprefix("model.layers.").split(".", 1)
                name = f"model.layers.{lo + int(idx)}.{rest}"
            if hasattr(t, "full_tensor"):  # a tensor-parallel shard: the whole tensor
                t = t.full_tensor()
            out[name] = t.detach().clone()
        return out

    def tied_parameter(self) -> Any:
        """The embedding (first stage) or LM head (last stage) weight that a tied model must keep
        equal across the two stages; None when untied or when both live on this one stage."""
        if not getattr(self.config, "tie_word_embeddings", False) or (self.first and self.last):
            return None
        if self.first:
            return self.model.embed_tokens.weight
        if self.last:
            return self.lm_head.weight
        return None
