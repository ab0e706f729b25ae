"""SparseBalance: load-balanced long-context training with dynamic sparse attention.

Sub-packages (see docs/architecture.md): ``data`` (sequences, loaders), ``simulator`` (latency model,
SimPy PP x DP model, traces), ``policies`` (batching and sparsity tuning), ``kernels`` (MoBA attention,
profiler; needs torch), ``realrun`` (torch.distributed executor; needs torch), ``analysis``.
torch and triton are imported lazily: the base install runs without them.
"""

__version__ = "0.1.0"
