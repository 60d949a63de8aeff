"""Fitting helpers shared by the calibration (``bench/calibrate.py``) and the shape grid (``bench/shapes.py``):
neither imports the other for them."""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares (Lawson and Hanson's active set), columns scaled to unit norm."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, bool)
    for _ in range(3 * n):
        w = a.T @ (b - a @ x)
        if passive.all() or np.max(np.where(passive, -np.inf, w)) <= 1e-12:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            neg = passive & (z <= 0)
            x = x + np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300)) * (z - x)
            passive &= x > 1e-15
    return x / norms
