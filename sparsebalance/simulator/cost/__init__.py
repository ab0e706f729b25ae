"""What things cost: the latency model and its one stage-cost formula, the typed contract the
policies and the executor hold, profiles (format, analytical roofline of our kernel, calibration).
Imports the simulator's config, layout and plan only (``tests/test_layering.py``)."""
