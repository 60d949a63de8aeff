"""The P chunks of the units whose parameters live on the host (docs/design.md §13): their pool in the offload tier
and the upload before each use (``HostParams``), through the tier's storage seam (``storage.Tier``)."""
from __future__ import annotations

from typing import Optional

import torch

from .host_memory import PinnedHost
from .storage import Copied, Tier

__all__ = ["HostParams"]


class HostParams:
    """The P chunks of the units whose parameters live on the host (the plan's ``placement.p``; only where s_p =
    s_os, so that the host optimizer writes the P chunk itself and no P-sync follows): in the tier, and before each
    use uploaded on a lane of their own — then all-gathered over the P group where s_p > 1 — into the unit's full
    buffer (docs/design.md §13). The host optimizer writes a unit's P chunk only after the step's events, which
    follow every use of its last upload."""

    def __init__(self, device: torch.device, tier: Optional[Tier] = None):
        """``tier``: where the chunks live (None: ``PinnedHost``)."""
        self.device = device
        self.tier = tier or PinnedHost(device)
        self._lane = self.tier.lane()

    @property
    def stream(self) -> Optional[torch.cuda.Stream]:
        """The uploads' stream; None where the tier is the device's own memory (a CPU device): the unit gathers
        straight from the chunk, nothing is uploaded."""
        return self._lane.stream

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A P chunk of ``n`` elements in the tier."""
        return self.tier.allocate(n, dtype)

    def upload(self, chunk: torch.Tensor, dst: Optional[torch.Tensor], then=None) -> Copied:
        """Launch the copy of the host ``chunk`` up, on this lane: into ``dst`` (the unit's full buffer, allocated
        by the caller), or into a device buffer of its own that ``then(src)`` (the unit's AllGather, where s_p > 1)
        reads on the same lane; a handle whose ``wait()`` orders the current stream after both. The collective
        is the caller's (``Unit``): this class only copies."""
        self._lane.follow()  # the full buffer's memory is free there
        if dst is not None:
            return self._lane.upload([(dst, chunk)])
        with self._lane.issuing():  # the gather's source is memory of the lane, freed after its gather there
            src = torch.empty(chunk.numel(), dtype=chunk.dtype, device=self.device)
        return self._lane.upload([(src, chunk)], then=lambda: then(src))
