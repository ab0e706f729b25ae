"""The accuracy experiment: a tiny MoBA Qwen2 trained on a long-context recall task under the same
policy objects as the simulator and realrun (``sparsebalance accuracy``; docs/accuracy.md)."""
