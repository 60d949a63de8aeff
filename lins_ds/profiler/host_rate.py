"""The host update's rate in training (issue 59; docs/design.md §13): the elements per second the host worker updated
over a run's steady steps, kept beside the host's bandwidth so that the next start-up on this host prices the update
at what a step ran, not at the start-up's own timing beside a stand-in thread. That timing flatters the host: on one
H100 host it gave 2.70-3.70 G elements/s where the same jobs' workers ran 2.2-2.7 in training, and the exposed host
time without clipping was predicted 0.27 s a step where the step waited 0.72 (bench/results/offload/
compute_rate_h100/). Rank 0 writes it after the steps ``HostTimeReport`` reads; every rank reads it in
``host_optimizer.measure``. Keyed as the bandwidth is (the CPU, its caches and memory, the threads, the node's
ranks, torch, lins_ds) and by the device, the host optimizer, its threads, the gradient's dtype and whether the
updates run inside the last backward; any other file, or one that does not parse, is not used.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Optional

from . import host_bandwidth
from .cache import cache_path, write_json_atomically

PREFIX = "host-update-rate"

def key(device_type: str, ranks_per_node: int, optimizer: str, threads: int, grad_dtype: str,
        in_backward: bool) -> dict:
    """``in_backward``: the updates ran inside the window's last backward (``gradient_clipping`` 0), beside the
    backward's host work, not after the step: on one H100 host 1.92-2.14 G elements/s against 2.63-3.28."""
    return {**host_bandwidth.host_key(ranks_per_node), "device": device_type, "optimizer": optimizer,
            "update_threads": int(threads), "grad_dtype": str(grad_dtype), "in_backward": bool(in_backward)}


def load(directory: Optional[str], this: dict) -> tuple:
    """(the kept rate in elements per second, its file) for this key, or (None, the file)."""
    path = cache_path(this, directory, PREFIX)
    try:
        with open(path) as f:
            stored = json.load(f)
        rate = float(stored["update_elems_per_s"])
        if stored.get("key") != this or not (math.isfinite(rate) and rate > 0):
            return None, path
        return rate, path
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, path


def save(directory: Optional[str], this: dict, rate: float, elements: int, min_elements: int) -> Optional[str]:
    """Keep ``rate`` (a run's worker, ``elements`` a step) for this key; the file written, or None where the run
    updated fewer elements than the start-up times (``min_elements``: a few small units' state stays in the
    last-level cache, and would flatter the rate) or the file could not be written (nothing depends on it)."""
    if elements < min_elements or not (math.isfinite(rate) and rate > 0):
        return None
    path = cache_path(this, directory, PREFIX)
    failed = write_json_atomically(path, {"key": this, "update_elems_per_s": rate, "elements": int(elements),
                                          "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid()})
    return None if failed is not None else path
