"""The cluster simulator: configs, plans, latency model, schedules and their graphs, the timing core,
the SimPy model, the memory model, executor, trace. Nothing here imports torch. Import the modules
themselves (``from sparsebalance.simulator.engine import simulate``); see docs/architecture.md.
"""
