"""Host memory a run takes from its machine: ``/proc/meminfo``'s MemTotal - MemAvailable, sampled by a thread.

Pinned memory (``cudaHostAlloc``, what offload keeps its state in) does not reliably show in a process's RSS,
but it does leave MemAvailable; on a machine the run has to itself, the rise over the run is what it needs of
the host: its pinned tensors, the model built on the host, the CUDA runtime's and Python's own.
"""

from __future__ import annotations

import threading
from typing import Optional

MEMINFO = "/proc/meminfo"


def used_gb() -> Optional[float]:
    """MemTotal - MemAvailable in GiB, None where /proc/meminfo is not there."""
    try:
        with open(MEMINFO) as f:
            kib = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[0] in ("MemTotal:", "MemAvailable:")}
    except OSError:
        return None
    return (kib["MemTotal"] - kib["MemAvailable"]) / 2**20


class HostMemory:
    """The used memory when made (the baseline) and its peak until ``stop()``, sampled every ``interval`` s."""

    def __init__(self, interval: float = 0.05):
        self.before = used_gb()
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True, name="host-memory")
        if self.before is not None:
            self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, used_gb())

    def stop(self) -> Optional[dict]:
        """{"before_gb", "peak_gb", "rise_gb"} (None without /proc/meminfo)."""
        if self.before is None:
            return None
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, used_gb())
        return {"before_gb": self.before, "peak_gb": self.peak, "rise_gb": self.peak - self.before}
