"""The cluster simulator, four parts in a row: base <- schedule <- cost <- engine (each imports
only itself and the parts before it; nothing here imports torch).

* base: ``config`` (model and cluster configs, presets), ``layout`` (the model's geometry: layers per
  virtual stage, the schedules' stage placement, parameters per device, a CP rank's share of the
  tokens and the gradient group), ``plan`` (plans, micro-batches, budgets), ``budget``, ``flops``,
  ``hfconfig``;
* ``schedule/``: schedules as dependency graphs and the exact timing core (in what order, when);
* ``cost/``: what an action takes: the latency model (a facade over its tables, CP pricing and
  communication), ``StageCost`` (the one sum), memory per device, context parallelism (``cost/cp/``),
  profiles;
* ``engine/``: ``simulate`` and its engines, the SimPy model, the executor and trace (one iteration,
  end to end).

Policies may import base, schedule and cost, never engine. Import the modules themselves
(``from sparsebalance.simulator.engine import simulate``); the rules are drawn in
docs/architecture.md and enforced by tests/test_layering.py.
"""
