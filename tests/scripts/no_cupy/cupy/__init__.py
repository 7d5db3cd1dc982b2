"""A `cupy` that fails on import: on the path, it shows whether anything imports cupy."""

raise ImportError("cupy was imported (tests/scripts/no_cupy)")
