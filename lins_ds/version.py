"""The lins_ds version, in a module that imports nothing (caches and checkpoints are keyed by it)."""

__version__ = "0.1.0"
