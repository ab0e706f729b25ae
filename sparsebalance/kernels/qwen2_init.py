"""Build any part of a Qwen2 model without building the rest: the model skeleton on the meta device,
then only the chosen **pieces** (embedding, given decoder layers, final norm, LM head) materialised.

Why: a pipeline stage of a 3B/7B model needs 1/pp of the weights; building the whole model on every
rank first (and cutting it) needs the whole model's memory on every rank. Here a rank allocates its
own pieces only, one piece at a time.

Fresh weights are **seeded per parameter**: each parameter draws from its own generator, seeded by
(run seed, the parameter's Hugging Face name), with HF's Qwen2 rule (linear and embedding weights
normal(0, initializer_range), biases 0, norm weights 1, the padding row 0). So a piece's weights do
not depend on which other pieces are built: stage s of a PP run equals the same layers of the full
model built in one process (the single-process reference), which is what the tests compare. Draws
happen on the CPU in float32 (device- and dtype-independent numbers), then the piece moves to its
device and dtype. A tied LM head without the embedding on its stage gets the embedding's weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

EMBED, NORM, HEAD = "model.embed_tokens", "model.norm", "lm_head"
EMBED_WEIGHT = f"{EMBED}.weight"


def layer_piece(i: int) -> str:
    return f"model.layers.{i}"


def pieces(layers: Iterable[int], *, embed: bool, head: bool) -> list[str]:
    """Module paths of a stage: the embedding (first stage), its layers, final norm + LM head (last)."""
    out = [EMBED] if embed else []
    out += [layer_piece(i) for i in layers]
    return out + ([NORM, HEAD] if head else [])


def all_pieces(n_layers: int) -> list[str]:
    return pieces(range(n_layers), embed=True, head=True)


def skeleton(hf_config: Any) -> Any:
    """A ``Qwen2ForCausalLM`` on the meta device: module structure and shapes, no memory."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        net = Qwen2ForCausalLM(hf_config)
    return net


def param_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a hash of (run seed, HF parameter name)."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_fill(seed: int, std: float, padding_idx: int | None = None) -> Callable[[str, Any], None]:
    """``fill(name, tensor)`` writing the fresh-model value of parameter ``name`` into ``tensor``
    (float32, CPU) by HF's Qwen2 init rule, drawn from that parameter's own generator."""
    import torch

    def fill(name: str, t: Any) -> None:
        leaf = name.rsplit(".", 1)[-1]
        owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if leaf == "bias":
            t.zero_()
        elif "norm" in owner or "layernorm" in owner:
            t.fill_(1.0)
        else:
            # a tied head is filled from the embedding's name: both sides draw the same numbers
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            t.normal_(0.0, std, generator=gen)
            if name == EMBED_WEIGHT and padding_idx is not None:
                t[padding_idx].zero_()

    return fill


def materialize(net: Any, names: Iterable[str], fill: Callable[[str, Any], None], *,
                dtype: Any, device: Any) -> None:
    """Allocate and fill the parameters of the pieces ``names`` of a skeleton ``net``, one piece at a
    time (CPU float32, then moved to ``device`` / ``dtype``); the rotary embedding is rebuilt on
    ``device`` (its buffer is computed, not stored). A tied LM head whose embedding is not built
    is filled under the embedding's name; when both are built they share one Parameter."""
    import torch

    tied = bool(getattr(net.config, "tie_word_embeddings", False))
    names = list(names)
    for piece in names:
        mod = net.get_submodule(piece)
        mod.to_empty(device="cpu")
        with torch.no_grad():
            for pname, p in mod.named_parameters(prefix=piece, remove_duplicate=False):
                p.data = p.data.float()
                fill(EMBED_WEIGHT if (tied and pname == f"{HEAD}.weight") else pname, p.data)
        mod.to(device=device, dtype=dtype)
    if tied and EMBED in names and HEAD in names:
        net.lm_head.weight = net.model.embed_tokens.weight
    # float32 inverse frequencies whatever the dtype (HF casts them to float in forward anyway)
    net.model.rotary_emb = type(net.model.rotary_emb)(net.config).to(device)


def materialized_pieces(net: Any) -> list[str]:
    """The pieces of ``net`` whose parameters live off the meta device (for checks and tests)."""
    out = []
    for piece in all_pieces(net.config.num_hidden_layers):
        ps = list(net.get_submodule(piece).parameters())
        if ps and all(not p.is_meta for p in ps):
            out.append(piece)
    return out
