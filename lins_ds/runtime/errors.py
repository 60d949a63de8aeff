"""The runtime's errors, in one module that imports nothing of the runtime: the step machinery, offload and the
optimizer raise them without importing the config parser, relayout or the unit for a class."""

from __future__ import annotations

from ..plan import PlanError


class LinsConfigError(PlanError):
    """A bad ``lins`` block: raised on every rank before Lins makes a process group or issues a collective."""


class UnitStateError(RuntimeError):
    """A transition asked of a unit in a state it does not start from: a bug in who drives the unit."""


class RelayoutError(RuntimeError):
    """A plan could not take effect (asked inside an accumulation window, or building it failed on some rank); every
    rank is on the old plan, its state intact."""


class HostProtocolError(RuntimeError):
    """A step of the host-offload protocol asked out of order (``HostOffload``: drain_grads -> start_updates -> begin ->
    settle): a bug in who drives it, e.g. a host update about to read gradients not yet final."""
