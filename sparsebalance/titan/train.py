"""``python -m sparsebalance.titan.train --module sparsebalance.titan --config NAME [overrides]``:
torchtitan's own ``train`` entry point, with torchtitan imported for this machine's device first
(``compat.import_torchtitan``; on a CPU-only machine torchtitan would otherwise pick CUDA). Under
torchrun: ``torchrun --nproc-per-node N -m sparsebalance.titan.train ...``."""

from __future__ import annotations


def main() -> None:
    from sparsebalance.titan.compat import import_torchtitan

    import_torchtitan()
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
