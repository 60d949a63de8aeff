"""Communication profiler: measured tables, cached on disk, shared so every rank plans alike."""

from __future__ import annotations

import torch

from .. import comm
from ..plan import ProfileTable, Topology
from . import cache
from .measure import FULL, QUICK, measure


def obtain(topo: Topology, meshes, device: torch.device, *, quick: bool = True, max_bytes: int = 0,
           cache_dir=None, log=print) -> ProfileTable:
    """Rank 0's cached table when it matches this launch and covers ``meshes`` up to ``max_bytes``
    (e.g. the largest unit the model gathers); otherwise measured now by every rank (quick or full
    mode) and cached. Every rank returns rank 0's table, so every rank plans alike."""
    rank = comm.rank()
    key = cache.launch_key(topo, device)
    path = cache.cache_path(key, cache_dir)
    params = dict(QUICK if quick else FULL)
    if max_bytes:
        params["max_bytes"] = max(int(max_bytes), params["min_bytes"] * params["step"])
    found = None
    if rank == 0:
        table, reason = cache.load(path, key, meshes, params["max_bytes"])
        log(f"lins profile: {reason}" + ("" if table else "; measuring now"))
        found = None if table is None else table.to_json()
    found = comm.broadcast_object(found)
    if found is not None:
        return ProfileTable.from_json(found, origin=path)
    meta = {**key, "source": f"measured:{'quick' if quick else 'full'}"}
    if device.type == "cuda":
        meta["gpu_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    table = measure(topo, meshes, device, meta=meta, **params)
    if rank == 0:
        failed = cache.save(path, table)
        log(f"lins profile: saved {path}" if failed is None else
            f"lins profile: warning: not cached ({failed}); lins.profile_cache names a writable directory")
    return ProfileTable.from_json(comm.broadcast_object(table.to_json() if rank == 0 else None), origin="rank 0")
