"""Hooks that run a Lins plan inside forward and backward (DESIGN §3, steps 1-3).

Forward:  a layer unit is gathered before its module runs (s_p > 1) and released after it, unless the
          forward is a recompute inside backward (activation checkpointing). The root unit is gathered
          before the model runs and kept until the end of backward.
Backward: hooks on a layer's outputs re-gather it before its backward; when every parameter of a unit
          has its gradient, the unit is reduced: ReduceScatter into the G chunk (s_g > 1) or local
          accumulation (s_g = 1). The root unit is reduced at the end of backward.
Boundary: AllReduce of each G chunk over its replica group (``reduce_replicas``).

Collectives are synchronous for now; every call site is per unit, which is where side streams and
prefetch attach on GPUs.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from . import comm
from .units import FlatUnit, UnitState


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Executor:
    def __init__(self, module: torch.nn.Module, root, layers: list, groups: comm.Groups,
                 reduce_dtype: torch.dtype):
        self.module, self.root, self.layers, self.groups = module, root, layers, groups
        self.units = ([root] if root is not None else []) + layers
        self.reduce_dtype = reduce_dtype
        self.world = groups.topo.world_size
        self._handles = []
        self._staging = None
        self._register()

    # --- hooks -----------------------------------------------------------------------------
    def _register(self) -> None:
        h = self._handles
        h.append(self.module.register_forward_pre_hook(self._root_pre_forward))
        h.append(self.module.register_forward_hook(self._root_post_forward))
        for unit in self.layers:
            for m in unit.modules:
                h.append(m.register_forward_pre_hook(lambda mod, args, u=unit: self.gather(u)))
                h.append(m.register_forward_hook(lambda mod, args, out, u=unit: self._layer_post_forward(u, out)))
        for unit in self.units:
            for slot in unit.slots:
                h.append(slot.param.register_post_accumulate_grad_hook(
                    lambda p, u=unit: self._on_grad(u, p)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _root_pre_forward(self, module, args):
        if self.root is not None:
            self.gather(self.root)

    def _root_post_forward(self, module, args, out):
        if self.root is None:
            return
        tensors, _ = tree_flatten(out)
        if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)):
            self.root.release()  # no backward will follow

    def _layer_post_forward(self, unit: FlatUnit, out):
        if not unit.sharded_p:
            return
        if not in_backward():
            unit.release()
        tensors, _ = tree_flatten(out)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, u=unit: (self.gather(u), grad)[1])

    # --- P: gather and release -------------------------------------------------------------
    def gather(self, unit: FlatUnit) -> None:
        if unit.state is UnitState.GATHERED:
            return
        full = unit.materialise()
        comm.all_gather(self.groups, "p", full, unit.p_shard)
        unit.state = UnitState.GATHERED

    def release_all(self) -> None:
        for unit in self.units:
            unit.release()

    # --- G: reduction -----------------------------------------------------------------------
    def _on_grad(self, unit: FlatUnit, param) -> None:
        unit.pending.add(param)
        if unit is not self.root and len(unit.pending) == len(unit.slots):
            self.reduce_unit(unit)

    def _staging_buffer(self, n: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < n:
            size = max(u.spec.padded for u in self.units)
            self._staging = torch.empty(size, dtype=self.reduce_dtype, device=self.units[0].device)
        return self._staging[:n]

    def reduce_unit(self, unit: FlatUnit) -> None:
        """Move the unit's fresh gradients into its G accumulation (ReduceScatter when s_g > 1)."""
        flat = self._staging_buffer(unit.spec.padded)
        flat.zero_()
        for s in unit.slots:
            if s.param.grad is not None:
                flat[s.offset:s.offset + s.numel].copy_(s.param.grad.reshape(-1))
                s.param.grad = None
        if unit.sharded_g:
            out = torch.empty(unit.spec.g_size, dtype=self.reduce_dtype, device=unit.device)
            comm.reduce_scatter(self.groups, "g", out, flat)
            unit.g_acc.add_(out)
        else:
            unit.g_acc.add_(flat)
        unit.pending.clear()
        unit.reduced = True
        if unit is not self.root:
            unit.release()

    def post_backward(self) -> None:
        """End of one backward: reduce every unit not reduced yet (the root unit; units with unused
        parameters), so each unit is reduced exactly once per backward on every rank; release all."""
        for unit in self.units:
            if not unit.reduced:
                self.reduce_unit(unit)
            unit.reduced = False
        self.release_all()

    def reduce_replicas(self) -> None:
        """Accumulation boundary: AllReduce every G chunk over its replica group."""
        for unit in self.units:
            if self.groups.size("g_replica") == 1:
                return
            if unit.g_acc.dtype == self.reduce_dtype:
                comm.all_reduce(self.groups, "g_replica", unit.g_acc)
            else:
                tmp = unit.g_acc.to(self.reduce_dtype)
                comm.all_reduce(self.groups, "g_replica", tmp)
                unit.g_acc.copy_(tmp)
