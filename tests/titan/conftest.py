"""torchtitan is imported through sparsebalance.titan.compat before any test module imports it (a
plain ``import torchtitan`` first would fix its device to CUDA on this CPU)."""

import importlib.util

if importlib.util.find_spec("torchtitan") is not None:
    from sparsebalance.titan.compat import import_torchtitan

    import_torchtitan()
