"""Pipeline schedules as dependency graphs: per-device action orders (GPipe, 1F1B, interleaved,
ZB-H1, ZB-V, DualPipeV), the graph, the exact timing core, level cuts and single-micro-batch what-ifs.
Imports the simulator's base only (config, and layout for the stage placement; ``tests/test_layering.py``)."""
