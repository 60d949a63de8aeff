"""Memory: the activation probe the solver prices with at start-up, and the guard that holds the measured peak to the
plan's prediction after the second step (docs/design.md §8)."""
