"""On-disk cache of measured profile tables, keyed by what the measurements depend on.

A cached table is reused only when its key matches this launch (world size, GPUs per node, nodes,
device, backend and its version, torch version) and it covers every mesh and size asked for; any
other file — another key, a truncated or corrupted file — is reported and measured anew.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import torch

from .. import comm
from ..plan import PlanError, ProfileTable, Topology

KEY_FIELDS = ("world_size", "gpus_per_node", "nodes", "device", "backend", "backend_version", "torch", "lins_ds")


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lins_ds", "profiles")


def launch_key(topo: Topology, device: torch.device) -> dict:
    backend = comm.backend()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        version = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else torch.__version__
    else:
        name, version = "cpu", torch.__version__
    from ..version import __version__

    return {"world_size": topo.world_size, "gpus_per_node": topo.gpus_per_node, "nodes": topo.nodes,
            "device": name, "backend": backend, "backend_version": version, "torch": torch.__version__,
            "lins_ds": __version__}


def cache_path(key: dict, directory: Optional[str] = None, prefix: str = "profile") -> str:
    """``<directory>/<prefix>-<digest of key>.json`` (the profiles' directory by default)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(directory or default_dir(), f"{prefix}-{digest}.json")


def covers(table: ProfileTable, meshes, max_bytes: int) -> Optional[str]:
    """None if ``table`` has every op on every mesh up to ``max_bytes``, else what is missing."""
    for m in meshes:
        if m.size == 1:
            continue
        for op in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
            s = table.series.get((op, m.intra, m.inter))
            if s is None:
                return f"no {op} on mesh {m}"
            if s.sizes[-1] < max_bytes:
                return f"{op} on mesh {m} measured only up to {s.sizes[-1]} bytes (< {max_bytes})"
    return None


def load(path: str, key: dict, meshes, max_bytes: int) -> tuple:
    """(table or None, reason it cannot be used)."""
    if not os.path.exists(path):
        return None, f"no cached profile at {path}"
    try:
        table = ProfileTable.load(path, key="cached profile")
    except PlanError as e:
        return None, f"cached profile {path} is unreadable ({e})"
    stored = {k: table.meta.get(k) for k in KEY_FIELDS}
    if stored != key:
        diff = {k: (stored[k], key[k]) for k in KEY_FIELDS if stored[k] != key[k]}
        return None, f"cached profile {path} was measured for another launch: {diff}"
    missing = covers(table, meshes, max_bytes)
    if missing:
        return None, f"cached profile {path} lacks measurements: {missing}"
    return table, "cache hit"


def save(path: str, table: ProfileTable) -> Optional[str]:
    """Write atomically: a crash leaves the old file or none, never half a table. A directory that cannot be written
    (a read-only home, a full disk) is not an error: the job goes on without the cache; returns why, or None."""
    return write_json_atomically(path, table.to_json())


def write_json_atomically(path: str, obj) -> Optional[str]:
    """``obj`` as JSON at ``path`` (a temporary file renamed into place); on an OSError, the reason, nothing raised and
    nothing left behind (the caller warns: a cache is an optimisation, never a reason to fail a job)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
        return None
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        return f"{type(e).__name__}: {e}"
