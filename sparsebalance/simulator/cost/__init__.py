"""What things cost: the latency model (``latency.py``, a facade over ``tables.py``, ``cp/``, ``comm.py``),
``StageCost`` (``stagecost.py``: the one place a stage's or a micro-batch's time is summed, with its
pre-summed totals in ``presum.py``), memory per device (``memory.py``), the typed contract the policies
and the executor hold (``query.py``), profiles (format, catalog, checks, analytical roofline of our
kernel, calibration). Imports the simulator's base and schedule/ only (``tests/test_layering.py``)."""
