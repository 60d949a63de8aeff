"""lins_ds: Lins sharding (independent P/G/OS meshes) for DeepSpeed."""

__version__ = "0.1.0"
