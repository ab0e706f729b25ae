"""SparseBalance inside torchtitan (extra ``[titan]``): SAB + DST where people train.

``--module sparsebalance.titan --config NAME`` (presets in :mod:`sparsebalance.titan.config_registry`),
started with ``python -m sparsebalance.titan.train`` (torchrun for several processes) so that torchtitan
is imported for this machine's device first (:mod:`sparsebalance.titan.compat`). The parts:
``loader`` (the plan's micro-batches), ``attention`` (MoBA as torchtitan's varlen inner attention),
``trainer`` (routes the budgets), ``setup`` (the job's SparseBalance side and its checks), ``model``,
``tokenizer``, ``compat`` (torch 2.13 / CPU gaps), ``measure`` (predicted vs measured).

Importing this package imports nothing heavy: torch and torchtitan load with the submodules.
"""
