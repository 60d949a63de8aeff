"""LinsRuntime: a model's units, process groups and hooks under one plan; the only door into them for the
engine, the optimizer, the checkpoints and users (docs/design.md §4)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import comm
from ..plan import Plan
from ..plan.layout import is_first_replica
from .assign import assign_units, build_unit
from .executor import Executor
from .materialize import Materializer, is_deferred


class LinsRuntime:
    def __init__(self, module: torch.nn.Module, plan: Plan, param_groups: list, accum_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, unit_modules=None, overlap_param_sync: bool = True,
                 device: Optional[torch.device] = None, check_collectives: bool = False):
        self.plan, self.topo, self.layout = plan, plan.topology, plan.layout
        self.module, self.overlap_param_sync = module, overlap_param_sync
        self.groups = comm.Groups(self.topo, self.layout, check_order=check_collectives)
        self._checks = 0
        group_of = {}
        for gi, group in enumerate(param_groups):
            for p in group["params"]:
                if p.requires_grad:  # frozen parameters stay whole on every rank, outside any unit
                    group_of.setdefault(p, gi)
        # a model built without values (lins_ds.init, the meta device) gets them unit by unit, and the rest whole
        mat = Materializer(module, device) if is_deferred(module) else None
        self.units = [build_unit(name, mods, params, group_of, self.topo, self.layout, self.groups, accum_dtype,
                                 reduce_dtype, mat, device)
                      for name, mods, params in assign_units(module, group_of, unit_modules)]
        if mat is not None:
            _materialise_outside_units(module, mat, device)
        root = self.units[0] if self.units and self.units[0].name == "root" else None
        self.device = self.units[0].device if self.units else (device or torch.device("cpu"))
        self._executor = Executor(module, root, self.units[1:] if root is not None else self.units, reduce_dtype)
        self.os_replicas = self.topo.world_size // self.layout.os.size
        # one replica of every OS chunk writes it to a checkpoint: the ranks whose replica digits are 0
        self.is_checkpoint_writer = is_first_replica(self.topo, self.layout, self.groups.rank)

    @property
    def destroyed(self) -> bool:
        return self.groups.destroyed

    def layer_modules(self) -> list:
        """Each layer unit's modules, in order (what activation checkpointing applies to)."""
        return [u.modules for u in self._executor.layers]

    def unit_sizes(self) -> list:
        """(padded numel, is_root) per unit, as ``lins_ds.plan.cost.schedule`` takes them."""
        return [(u.spec.padded, u is self._executor.root) for u in self.units]

    # --- one backward ------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        """A backward starts; ``boundary``: it ends an accumulation window (replica AllReduces start in it)."""
        self._executor.begin_backward(boundary)

    def post_backward(self) -> None:
        """The backward ended: reduce what is left, release gathered units. Idempotent per backward."""
        if self._executor.in_backward:
            self._executor.post_backward()

    def reduce_at_boundary(self) -> None:
        """Every G chunk all-reduced over its replicas (launched during the last backward where possible)
        and waited for. Idempotent: the engine's boundary and the optimizer's step may both call it."""
        self._executor.drain()
        for unit in self._executor.order:
            self._executor.start_replica_reduce(unit)
        self._executor.finish_replica_reduces(self.units)

    def check_collectives(self) -> None:
        """With ``lins.check_collectives``: every rank issued the same collectives, in the same order on each
        group, since the last check (called by every rank at each optimizer step); else nothing."""
        if self.groups.issued is not None:
            self._checks += 1
            comm.check_order(self.groups, f"optimizer step {self._checks}")

    def zero_gradients(self) -> None:
        for unit in self.units:
            unit.reset_grads()

    def attach_grads(self) -> None:
        """Every .grad back on its accumulator view, or None (the optimizer's zero_grad)."""
        for unit in self.units:
            unit.attach_grads()

    # --- parameters ----------------------------------------------------------------------------
    @torch.no_grad()
    def sync_parameters(self) -> None:
        """After the update: gather each P chunk from the OS chunks of its P-sync group (asynchronously
        when overlapping; each unit's next use waits for its own gather)."""
        self.release_all()  # gathered copies are stale now
        for unit in self.units:
            unit.start_param_sync(async_op=self.overlap_param_sync)

    def gather_all(self) -> None:
        """Every unit's full parameters current (``state_dict``, evaluation outside forward)."""
        for unit in self.units:
            unit.wait_gather()

    def release_all(self) -> None:
        for unit in self.units:
            unit.release()

    def wait(self) -> None:
        """Wait for every collective still in flight (P-sync, prefetch, ReduceScatter, AllReduce); issues
        none. After it the parameters, P chunks and OS chunks may be read and written directly."""
        self._executor.drain()
        for unit in self.units:
            unit.wait_all()
        self._executor.finish_replica_reduces([])

    def destroy(self) -> None:
        """Idempotent; issues no collective (it runs from ``atexit`` and ``__del__`` too)."""
        if self.groups.destroyed:
            return
        self.wait()
        self._executor.remove_hooks()
        self.groups.destroy()
        if self.layout.p.size > 1:  # the module keeps only this rank's P chunks: refuse to run it
            self.module.register_forward_pre_hook(_sharded_after_destroy)


def _materialise_outside_units(module: torch.nn.Module, mat: Materializer, device: torch.device) -> None:
    """Frozen parameters (whole on every rank) and buffers of a deferred model, on the device."""
    for p in list(module.parameters()):
        if p.is_meta:
            mat.materialise_whole(p)
    mat.materialise_buffers()
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = b.to(device)


def _sharded_after_destroy(module, args):
    raise RuntimeError("lins: this model's parameters stay sharded across ranks after engine.destroy(); "
                       "load them from a checkpoint (or engine.module.state_dict() taken before destroy) "
                       "to use the model again")
