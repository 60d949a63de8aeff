"""Layout-independent checkpoints: save per rank, load into any plan or world size, consolidate."""
