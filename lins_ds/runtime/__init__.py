"""Lins runtime: process groups, flat unit buffers, hooks, sharded optimizer, LinsEngine (needs torch)."""
