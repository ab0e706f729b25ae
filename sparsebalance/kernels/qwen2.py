"""A Qwen2-architecture decoder (Hugging Face ``transformers``) whose attention is our MoBA op.

The model is ``transformers.Qwen2ForCausalLM`` unchanged, with ``attn_implementation = "moba"``
registered through ``transformers.AttentionInterface``; so a real checkpoint loads with
``load_qwen2(local_dir)`` (``from_pretrained``, never a download) and its weights keep their names.

Packed varlen micro-batches: one row of ``T`` tokens holding ``N`` sequences side by side, position
ids restarting at 0 per sequence, ``cu_seqlens`` (int32 [N + 1]) passed to the attention function in a
:class:`MobaArgs` keyword argument, which also carries the micro-batch's
:class:`~sparsebalance.simulator.budget.Budget` (uniform or per layer) and where to record gate coverage. No global state: every forward call says what it wants.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparsebalance.data.sequence import IGNORE_INDEX, blocks
from sparsebalance.kernels.moba.cp import CPContext
from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.config import ModelConfig

ATTN_NAME = "moba"


@dataclass(kw_only=True, slots=True)
class MobaArgs:
    """Per-call MoBA controls, passed as ``moba=`` through the HF decoder layers to the attention.

    Shapes: ``T`` tokens in the packed row, ``N`` sequences.
    """

    cu_seqlens: Any
    """int32 tensor [N + 1]: sequence boundaries in the packed row (0, l0, l0 + l1, ..., T)."""
    budget: Budget
    """The micro-batch's budget (every sequence in the packed row alike); global layer ``i`` runs
    the kernel at ``budget.at(i)`` key blocks. An int or a list of per-layer ints is taken as
    ``Budget.of`` it."""
    block_size: int = 64
    """MoBA key-block size in tokens."""
    backend: str = "auto"
    """moba_attention backend (auto, torch, naive, triton)."""
    coverage_layer: int | None = None
    """Global layer index whose q/k are kept for :meth:`coverage_curves` (None = none)."""
    captured: Any = None
    """(q [T, H, D], k [T, Hkv, D], cu_seqlens) of ``coverage_layer`` from the last forward, detached."""
    cp: CPContext | None = None
    """Under context parallelism, this rank's share of the micro-batch and its group
    (``kernels/moba/cp.py``); ``cu_seqlens`` stays the whole micro-batch's. None: no CP."""

    def __post_init__(self) -> None:
        self.budget = Budget.of(self.budget, "MobaArgs.budget")

    def coverage_curves(self) -> list[np.ndarray]:
        """Real gate coverage C(k), k = 1..n_blocks, of each sequence at ``coverage_layer``
        (float64 [n_blocks_i] per sequence), from the q/k of the last forward; [] if none was kept."""
        if self.captured is None:
            return []
        from sparsebalance.kernels import moba_coverage

        q, k, cu = self.captured
        nbs = [blocks(int(n), self.block_size) for n in (cu[1:] - cu[:-1]).tolist()]
        cov = moba_coverage(q, k, cu, self.block_size, list(range(1, max(nbs) + 1)))
        cov = np.asarray(cov.cpu(), dtype=np.float64)
        return [cov[i, :nb].copy() for i, nb in enumerate(nbs)]


def moba_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           moba: MobaArgs | None = None, **kwargs):
    """The function registered as ``attn_implementation = "moba"``.

    HF passes query [1, H, T, D], key/value [1, Hkv, T, D]; returns ([1, T, H, D], None). ``scaling``
    must be 1/sqrt(D), which is what Qwen2 uses and what the MoBA kernels assume.
    """
    from sparsebalance.kernels import moba_attention

    if moba is None:
        raise ValueError("moba attention: pass moba=MobaArgs(cu_seqlens=..., budget=...) to forward; "
                         "packed varlen input is required")
    if query.shape[0] != 1:
        raise ValueError(f"moba attention: expects one packed row (batch 1), got batch {query.shape[0]}")
    d = query.shape[-1]
    if scaling is not None and abs(scaling - d ** -0.5) > 1e-6:
        raise ValueError(f"moba attention: scaling {scaling} != 1/sqrt(head_dim); not supported")
    q = query[0].transpose(0, 1)  # [T, H, D]; the MoBA API takes grouped-query k/v as they are
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    cu = moba.cu_seqlens
    layer = int(getattr(module, "layer_idx", 0))
    if moba.cp is not None:  # this rank's share of every sequence on a context-parallel group
        from sparsebalance.kernels.moba.cp import moba_attention_cp
        from sparsebalance.kernels.moba.cp_ring import moba_attention_cp_ring

        fn = moba_attention_cp_ring if moba.cp.comm == "ring" else moba_attention_cp
        out = fn(q, k, v, moba.cp.index, cu, moba.block_size, moba.budget.at(layer), group=moba.cp.group)
        return out.unsqueeze(0), None
    # one int per layer: the kernel's API validates it and makes the tensor its backend needs
    out = moba_attention(q, k, v, cu, block_size=moba.block_size, topk=moba.budget.at(layer),
                         backend=moba.backend)
    if moba.coverage_layer is not None and layer == moba.coverage_layer:
        # keep q/k only; the gate scores are computed by coverage_curves() outside the timed forward
        moba.captured = (q.detach(), k.detach(), cu)
    return out.unsqueeze(0), None


def register_moba_attention() -> None:
    """Register ``"moba"`` in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, moba_attention_forward)


def check_qwen2_architecture(model: ModelConfig) -> None:
    """The real executors build a Qwen2 decoder: refuse, in one line, a model of another architecture
    (which the simulator prices, but no real run here can execute)."""
    from sparsebalance.errors import ConfigError

    # a position-table size means nothing without learned positions: not a difference by itself; how
    # the layer's elementwise ops run prices an analytical profile only (the real run runs its own)
    other = [f"{k} = {v!r}" for k, v in model.arch.items() if k not in ("max_positions", "layer_ops")]
    if other:
        raise ConfigError(f"model: the real run builds Qwen2-architecture decoders only (SwiGLU, QKV biases, "
                          f"RMSNorm, rotary positions); this model has {', '.join(other)}")


def qwen2_config(model: ModelConfig, *, max_position_embeddings: int = 131072,
                 rope_theta: float = 1_000_000.0):
    """A ``transformers.Qwen2Config`` with the dimensions of ``model`` and MoBA attention."""
    from transformers import Qwen2Config

    check_qwen2_architecture(model)
    register_moba_attention()
    return Qwen2Config(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=model.ffn,
        num_hidden_layers=model.layers, num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads, head_dim=model.head_dim,
        tie_word_embeddings=model.tie_embeddings, max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta, use_cache=False, attn_implementation=ATTN_NAME,
    )


def build_qwen2(model: ModelConfig, *, seed: int = 0, dtype: str = "float32", device: str = "cpu"):
    """A fresh ``Qwen2ForCausalLM``, weights seeded per parameter from ``seed`` (same seed -> same
    weights on every process; any subset built alone by :func:`build_qwen2_pieces` equals the same
    subset of this model)."""
    from sparsebalance.kernels.qwen2_init import all_pieces

    return build_qwen2_pieces(model, all_pieces(model.layers), seed=seed, dtype=dtype, device=device)


def build_qwen2_pieces(model: ModelConfig, names, *, seed: int = 0, dtype: str = "float32",
                       device: str = "cpu"):
    """A ``Qwen2ForCausalLM`` with only the pieces ``names`` (``qwen2_init.pieces``) materialised;
    the others stay on the meta device (no memory). Fresh weights seeded per parameter."""
    import torch

    from sparsebalance.kernels import qwen2_init as Q

    cfg = qwen2_config(model)
    net = Q.skeleton(cfg)
    Q.materialize(net, names, Q.seeded_fill(seed, cfg.initializer_range, cfg.pad_token_id),
                  dtype=getattr(torch, dtype), device=torch.device(device))
    net.train()
    return net


def load_qwen2(local_dir: str, *, dtype: str = "float32"):
    """Load a local checkpoint directory with MoBA attention (``local_files_only``: no download)."""
    import torch
    from transformers import Qwen2ForCausalLM

    register_moba_attention()
    return Qwen2ForCausalLM.from_pretrained(local_dir, attn_implementation=ATTN_NAME,
                                            torch_dtype=getattr(torch, dtype), local_files_only=True)


@dataclass(slots=True)
class PackedBatch:
    """One packed micro-batch as tensors (T tokens, N sequences)."""

    input_ids: Any
    """int64 [1, T] token ids."""
    labels: Any
    """int64 [1, T]: the next token of the same sequence, IGNORE_INDEX at each sequence's end."""
    position_ids: Any
    """int64 [1, T]: 0..len-1 restarting per sequence."""
    cu_seqlens: Any
    """int32 [N + 1] boundaries."""

    @property
    def label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def pack(token_lists: list[np.ndarray], device: str = "cpu", labels: list | None = None) -> PackedBatch:
    """Pack sequences (int token arrays) into one row with per-sequence positions and labels: the
    next token of the same sequence, or, for a sequence whose entry of ``labels`` is an int array of
    its length (IGNORE_INDEX where no loss, e.g. all but the answers), those labels."""
    import torch

    if not token_lists:
        raise ValueError("pack: a micro-batch needs at least one sequence")
    lens = [len(t) for t in token_lists]
    ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists])
    out = np.full_like(ids, IGNORE_INDEX)
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    given = labels if labels is not None else [None] * len(lens)
    if len(given) != len(lens):
        raise ValueError(f"pack: {len(given)} label arrays for {len(lens)} sequences")
    for (a, b), lab in zip(itertools.pairwise(cu), given, strict=True):
        if lab is None:
            out[a:b - 1] = ids[a + 1:b]
        elif len(lab) != b - a:
            raise ValueError(f"pack: a label array has {len(lab)} entries for a sequence of {b - a} tokens")
        else:
            out[a:b] = lab
    labels = out
    t = lambda x: torch.from_numpy(x).to(device)
    return PackedBatch(input_ids=t(ids)[None], labels=t(labels)[None], position_ids=t(pos)[None],
                       cu_seqlens=t(cu))


def cp_slice(batch: PackedBatch, index: Any) -> PackedBatch:
    """This context-parallel rank's share of a packed micro-batch: its tokens' ids, labels and
    positions (``index``: packed positions, ``kernels/moba/cp.cp_token_index``); the labels are the
    next tokens of the whole sequence and the positions its own, so RoPE and the loss are unchanged by
    the split. ``cu_seqlens`` stays the whole micro-batch's."""
    return PackedBatch(input_ids=batch.input_ids[:, index], labels=batch.labels[:, index],
                       position_ids=batch.position_ids[:, index], cu_seqlens=batch.cu_seqlens)


def lm_loss_sum(logits, labels):
    """Summed next-token cross entropy over labelled tokens, shape [] (float32 at least)."""
    import torch
    import torch.nn.functional as F

    x = logits[0] if logits.dtype in (torch.float32, torch.float64) else logits[0].float()
    return F.cross_entropy(x, labels[0], ignore_index=IGNORE_INDEX, reduction="sum")


def run_layers(net, hidden, batch: PackedBatch, moba: MobaArgs, layers=None, impl: str = "eager"):
    """Run decoder ``layers`` (default: all) of ``net`` (a Qwen2ForCausalLM or a stage holding
    ``model.layers`` and ``model.rotary_emb``) on hidden [1, T, hidden]; ``impl`` eager (the HF
    modules) or compiled (``kernels/fastlayer.py``, the same weights)."""
    inner = net.model
    pe = inner.rotary_emb(hidden, batch.position_ids)
    if impl == "compiled":
        from sparsebalance.kernels.fastlayer import layer_forward

        for layer in (inner.layers if layers is None else layers):
            hidden = layer_forward(layer, hidden, pe, moba=moba)
        return hidden
    for layer in (inner.layers if layers is None else layers):
        hidden = layer(hidden, attention_mask=None, position_ids=batch.position_ids,
                       position_embeddings=pe, moba=moba)
    return hidden


def head_loss(norm, lm_head, hidden, labels, impl: str = "eager"):
    """Final norm + LM head + summed loss of hidden [1, T, hidden] (float32 at least, shape []):
    eager, the whole logits (:func:`lm_loss_sum`); compiled, the norm compiled and the chunked
    linear cross-entropy of ``kernels/lmhead.py`` (the same value and gradients, no [T, vocab] fp32)."""
    if impl != "compiled":
        return lm_loss_sum(lm_head(norm(hidden)), labels)
    from sparsebalance.kernels.fastlayer import compiled, mark_tokens_dynamic, rms_norm
    from sparsebalance.kernels.lmhead import linear_cross_entropy

    mark_tokens_dynamic(hidden)
    h = compiled(rms_norm)(hidden, norm.weight, norm.variance_epsilon)
    return linear_cross_entropy(h[0], lm_head.weight, labels[0], compile_=True)


def warm_up(layers, head=None, tokens: int = 64) -> None:
    """Compile what ``impl = "compiled"`` runs before anything is timed: the regions of the first of
    ``layers`` (the others have its shapes and reuse its graphs) and, with ``head`` = (final norm, LM
    head), the head's norm and chunk kernels; one forward + backward on seeded random input each, the
    gradients cleared after. Any later token count reuses these graphs (dynamic token dimension)."""
    import torch

    from sparsebalance.kernels.fastlayer import warm_up as warm_layer

    layers = list(layers)
    if layers:
        warm_layer(layers[0], tokens)
    if head is None:
        return
    norm, lm_head = head
    w = lm_head.weight
    gen = torch.Generator(device=w.device).manual_seed(0)
    h = torch.randn(1, tokens, w.shape[1], generator=gen, device=w.device, dtype=w.dtype, requires_grad=True)
    labels = torch.randint(0, w.shape[0], (1, tokens), generator=gen, device=w.device)
    labels[0, -1] = IGNORE_INDEX
    with torch.enable_grad():
        head_loss(norm, lm_head, h, labels, "compiled").backward()
    for p in [*norm.parameters(), *lm_head.parameters()]:
        p.grad = None


def full_forward_loss(net, batch: PackedBatch, moba: MobaArgs, impl: str = "eager"):
    """Summed LM loss of ``batch`` through the whole model (the single-process reference path)."""
    h = net.model.embed_tokens(batch.input_ids)
    h = run_layers(net, h, batch, moba, impl=impl)
    return head_loss(net.model.norm, net.lm_head, h, batch.labels, impl)
