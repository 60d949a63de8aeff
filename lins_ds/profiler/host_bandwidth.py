"""This host's memory bandwidth (docs/design.md §13, issue 59): a STREAM-like copy and triad over fp32 host tensors,
timed on torch's intra-op threads (the pool the host optimizer's passes run on), best of a few repetitions, cached
beside the communication profiles. The host update is memory-bound, so this is the denominator of its floor
(``lins_ds.plan.host_update.floor_seconds``) and what its achieved bandwidth is judged against.

The arrays are ``LLC_MULTIPLE`` times the last-level cache the process may use, so that what is timed is memory, not
cache. Every rank of a node probes at once where the engine measures the host (``HostProbe``), so the figure is one
rank's share of the node's bandwidth while every rank updates: the share its host update gets. A cached figure is
used only where its key (the CPU, its caches and memory, the threads, the ranks sharing the node, the probe's
version, torch and lins_ds) is this launch's; any other file is measured anew, never misread.
"""

from __future__ import annotations

import glob
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from ..version import __version__
from . import cache
from .cache import write_json_atomically

PROBE_VERSION = 1  # what the probe measures and how: a change makes every older cached figure another key's
LLC_MULTIPLE = 4  # each array this many times the last-level cache, so the cache holds a negligible part of it
MIN_ARRAY_BYTES = 256 << 20
ASSUMED_LLC_BYTES = 256 << 20  # where sysfs does not say (not Linux): as large as today's server sockets' caches
MEMORY_SHARE = 1 / 8  # the probe's three arrays together take at most this share of the available memory
REPS = 4
COPY_BYTES, TRIAD_BYTES = 8, 12  # fp32 per element: a = b (read, write); a = b + s c (two reads, a write)


@dataclass(frozen=True)
class HostBandwidth:
    """Best-of GB/s (1e9 bytes) of a copy and a triad over ``array_bytes`` per array on ``threads`` threads."""

    copy_gbs: float
    triad_gbs: float
    array_bytes: int
    threads: int
    origin: str = "measured"  # "measured: <why the cache had none>" or "cached <path>"

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(obj: dict, origin: str) -> "HostBandwidth":
        """The stored record; KeyError or ValueError where a field is missing or not a positive finite number."""
        out = HostBandwidth(float(obj["copy_gbs"]), float(obj["triad_gbs"]), int(obj["array_bytes"]),
                            int(obj["threads"]), origin)
        if not all(math.isfinite(v) and v > 0 for v in (out.copy_gbs, out.triad_gbs, out.array_bytes, out.threads)):
            raise ValueError(f"not positive finite: {obj}")
        return out


def _size_bytes(text: str) -> int:
    """sysfs's cache size ("32768K", "32M") in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def _affinity() -> set:
    """The CPUs this process may run on (every CPU where the platform cannot say)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def last_level_cache_bytes(cpus: Optional[set] = None) -> int:
    """The last-level cache the CPUs this process may run on (``cpus``, by default its affinity) can fill: the
    highest level's instances they reach, each counted once (several sockets, or an AMD part's one L3 per CCD, add
    up). ``ASSUMED_LLC_BYTES`` where sysfs does not describe the caches."""
    cpus = cpus if cpus is not None else _affinity()
    found: dict = {}  # (level, the CPUs sharing it) -> bytes
    for cpu in sorted(cpus):
        for index in glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/cache/index*"):
            try:
                with open(os.path.join(index, "type")) as f:
                    if f.read().strip() == "Instruction":
                        continue
                with open(os.path.join(index, "level")) as f:
                    level = int(f.read())
                with open(os.path.join(index, "shared_cpu_list")) as f:
                    shared = f.read().strip()
                with open(os.path.join(index, "size")) as f:
                    found[(level, shared)] = _size_bytes(f.read())
            except (OSError, ValueError):
                continue
    if not found:
        return ASSUMED_LLC_BYTES
    top = max(level for level, _ in found)
    return sum(size for (level, _), size in found.items() if level == top)


def array_bytes_for(llc_bytes: int, available_bytes: float, ranks_per_node: int = 1) -> int:
    """Bytes per probe array: ``LLC_MULTIPLE`` times the last-level cache (at least ``MIN_ARRAY_BYTES``), within
    ``MEMORY_SHARE`` of the available memory for the three arrays of each of the node's ``ranks_per_node`` ranks
    (they probe at once); a multiple of 4 KiB."""
    want = max(MIN_ARRAY_BYTES, LLC_MULTIPLE * llc_bytes)
    cap = int(available_bytes * MEMORY_SHARE / 3 / max(1, ranks_per_node))
    return max(1 << 12, min(want, cap)) // 4096 * 4096


def _best_seconds(work, reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``work``, after one untimed (page faults, thread pool start)."""
    work()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(array_bytes: int, reps: int = REPS) -> HostBandwidth:
    """Copy (a = b) and triad (a = b + 3 c) over fp32 arrays of ``array_bytes``, best of ``reps``, on torch's
    intra-op threads. Counted as STREAM counts: each element read or written once, no write-allocate reads."""
    n = max(1, array_bytes // 4)
    a, b, c = torch.zeros(n), torch.ones(n), torch.ones(n).add_(1.0)  # every page touched before timing
    copy_s = _best_seconds(lambda: a.copy_(b), reps)
    triad_s = _best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), reps)
    return HostBandwidth(COPY_BYTES * n / copy_s / 1e9, TRIAD_BYTES * n / triad_s / 1e9, 4 * n,
                         torch.get_num_threads())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def host_key(ranks_per_node: int = 1, array_bytes: Optional[int] = None) -> dict:
    """What the bandwidth depends on: the CPU and the CPUs this process may use, their last-level cache, the
    node's memory, torch's threads, how many ranks of the node probe (and update) at once, the arrays' size where it
    is given (else "auto": ``array_bytes_for``), and the code."""
    import psutil

    cpus = _affinity()
    return {"cpu": _cpu_model(), "cpus": os.cpu_count(), "usable_cpus": len(cpus),
            "llc_bytes": last_level_cache_bytes(cpus), "memory_bytes": psutil.virtual_memory().total,
            "threads": torch.get_num_threads(), "ranks_per_node": int(ranks_per_node),
            "array_bytes": int(array_bytes) if array_bytes is not None else "auto",
            "probe": PROBE_VERSION, "torch": torch.__version__, "lins_ds": __version__}


def cache_path(key: dict, directory: Optional[str] = None) -> str:
    return cache.cache_path(key, directory, "host-bandwidth")


def load(path: str, key: dict) -> tuple:
    """(the cached figure or None, why it is not used: "" for a hit)."""
    if not os.path.exists(path):
        return None, f"no cached host bandwidth at {path}"
    try:
        with open(path) as f:
            stored = json.load(f)
        if stored.get("key") != key:
            return None, f"cached host bandwidth {path} was measured for another host or launch"
        return HostBandwidth.from_json(stored["bandwidth"], f"cached {path}"), ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"cached host bandwidth {path} is unreadable ({type(e).__name__}: {e})"


def obtain(directory: Optional[str] = None, ranks_per_node: int = 1, array_bytes: Optional[int] = None,
           reps: int = REPS) -> HostBandwidth:
    """The cached figure for this host and launch (``origin`` "cached <path>"), else measured now and cached
    (``origin`` says why it was measured, and whether it could not be cached). ``array_bytes``: the arrays' size, by
    default ``array_bytes_for`` this process's last-level cache and available memory."""
    import psutil

    key = host_key(ranks_per_node, array_bytes)
    path = cache_path(key, directory)
    found, why = load(path, key)
    if found is not None:
        return found
    size = array_bytes if array_bytes is not None else array_bytes_for(key["llc_bytes"],
                                                                       psutil.virtual_memory().available,
                                                                       ranks_per_node)
    found = measure(size, reps)
    failed = write_json_atomically(path, {"key": key, "bandwidth": found.to_json()})
    return replace(found, origin=f"measured: {why}" + ("" if failed is None else f"; not cached ({failed})"))
