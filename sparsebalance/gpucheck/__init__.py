"""``gpu-check``: everything this project can only check on a GPU, made to fit a lent machine.

A lent GPU comes for minutes, offline, with its own torch and triton, and gives back a few flat
files. So: ``steps.py`` holds the steps, most valuable first (compiled-kernel accuracy on every
path, kernel speed, single-GPU stage validation, CUDA profiles, the ``gpu`` pytest tests, NCCL
validation with 2+ GPUs); ``python -m sparsebalance.gpucheck STEP`` runs one step in a process of
its own, so that a deadline can stop it and a crashed CUDA context cannot take the next step with
it; ``report.py`` records the environment, writes ``summary.md`` after every step and keeps the
results folder within what comes back (at most 8 files, 2 folders deep). The verb
(``commands/gpu_check.py``) runs the steps under their deadlines; ``scripts/gpu-check.sh`` runs the
verb on a bare machine with its system ``python3``.
"""
