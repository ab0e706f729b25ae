"""The cluster simulator, in three parts over a shared base. Nothing here imports torch.

* base: ``config`` (model and cluster configs, presets), ``layout`` (where layers and parameters
  live), ``plan`` (plans, micro-batches, budgets);
* ``cost/``: the latency model, its stage cost, profiles (what an action takes);
* ``schedule/``: schedules as dependency graphs and the exact timing core (in what order, when);
* ``engine/``: ``simulate`` and its engines, the SimPy model, the executor, memory and trace (one
  iteration, end to end).

Import the modules themselves (``from sparsebalance.simulator.engine import simulate``); the rules
of who imports whom are in docs/architecture.md and enforced by tests/test_layering.py.
"""
