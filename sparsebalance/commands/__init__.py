"""One module per CLI verb: ``add_arguments(parser)`` and ``run(args) -> int`` (see cli.py)."""
