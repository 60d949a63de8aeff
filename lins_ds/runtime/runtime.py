"""LinsRuntime: a model's units, groups and executor under one plan; the engine and optimizer drive it."""

from __future__ import annotations

import torch

from ..plan import Plan
from . import comm
from .executor import Executor
from .units import assign_units, build_unit


class LinsRuntime:
    def __init__(self, module: torch.nn.Module, plan: Plan, param_groups: list, accum_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, unit_modules=None, overlap_param_sync: bool = True):
        self.plan, self.topo, self.layout = plan, plan.topology, plan.layout
        self.groups = comm.Groups(self.topo, self.layout)
        group_of = {}
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                if p.requires_grad:  # frozen parameters stay whole on every rank, outside any unit
                    group_of.setdefault(p, gi)
        units = [build_unit(name, mods, params, group_of, self.topo, self.layout, self.groups.rank, accum_dtype)
                 for name, mods, params in assign_units(module, group_of, unit_modules)]
        root = units[0] if units and units[0].name == "root" else None
        self.units = units
        self.device = units[0].device if units else torch.device("cpu")
        self.executor = Executor(module, root, units[1:] if root is not None else units, self.groups, reduce_dtype,
                                 overlap_param_sync)
        self.os_replicas = self.topo.world_size // self.layout.os.size

    def unit_sizes(self) -> list:
        """(padded numel, is_root) per unit, as ``lins_ds.plan.cost.schedule`` takes them."""
        return [(u.spec.padded, u is self.executor.root) for u in self.units]

    # --- called by the engine ---------------------------------------------------------------
    def post_backward(self) -> None:
        self.executor.post_backward()

    def reduce_at_boundary(self) -> None:
        """Every G chunk all-reduced over its replicas; idempotent (units track what was launched), so
        the engine's boundary and the optimizer's step may both call it."""
        self.executor.reduce_replicas()

    @torch.no_grad()
    def sync_parameters(self) -> None:
        """After the update: gather each P chunk from the OS chunks of its P-sync group (asynchronously
        when overlapping; each unit's next use waits for its own gather)."""
        self.executor.release_all()  # gathered copies are stale now
        self.executor.launch_param_sync()

    def zero_gradients(self) -> None:
        for unit in self.units:
            unit.g_acc.zero_()
        self.executor.reset_boundary()

    def destroy(self) -> None:
        """Idempotent; issues no collective (it runs from ``atexit`` and ``__del__`` too)."""
        if self.groups.destroyed:
            return
        self.executor.wait_all()
        self.executor.remove_hooks()
        self.groups.destroy()
        if self.layout.p.size > 1:  # the module keeps only this rank's P chunks: refuse to run it
            self.executor.module.register_forward_pre_hook(_sharded_after_destroy)


def _sharded_after_destroy(module, args):
    raise RuntimeError("lins: this model's parameters stay sharded across ranks after engine.destroy(); "
                       "load them from a checkpoint (or engine.module.state_dict() taken before destroy) "
                       "to use the model again")
