"""Analysis of results and traces: timeline plots, predicted-vs-measured, sweep/ablation tables.

Imports no torch; reads trace tables (``sparsebalance.simulator.engine.trace.TRACE_COLUMNS``)."""
