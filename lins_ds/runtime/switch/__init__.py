"""Switching plans while training: re-layout (state staged, rebuilt, written back, agreed) and the tuner that times
candidates and moves (docs/design.md §14)."""
