"""MoBA (mixture of block attention) for packed variable-length sequences.

Implementations: ``naive`` (dense-mask reference), ``chunked`` (efficient PyTorch, CPU), ``triton_impl``
(GPU kernel), sharing the selection rule of ``gate``. ``api.moba_attention`` dispatches between them.
torch is imported lazily, so importing this package costs nothing without it.
"""

from sparsebalance.kernels.moba.api import moba_attention, moba_coverage

__all__ = ["moba_attention", "moba_coverage"]
