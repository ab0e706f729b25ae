"""Real PP x DP execution of a policy's plans with torch.distributed (Qwen2 + MoBA), measured trace.

Entry: ``torchrun --nproc-per-node N -m sparsebalance.realrun --config RUN.toml``; see docs/realrun.md.
torch is imported lazily, so importing this package (e.g. for the config) needs no torch.
"""
