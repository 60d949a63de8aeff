"""Hooks that run a Lins plan inside forward and backward (DESIGN §3), with communication overlapped.

Forward:  a layer unit is gathered before its module runs (s_p > 1) while the next layer's gather is
          already in flight (prefetch); it is released after its forward unless that forward is a
          recompute inside backward (activation checkpointing). The root unit is gathered before the
          model runs and kept until the end of backward.
Backward: hooks on a layer's outputs re-gather it (and prefetch the layer before it); when every
          parameter of a unit has its gradient, the unit's ReduceScatter (s_g > 1) is launched
          asynchronously and accumulated into the G chunk when it completes, two units later at most;
          on the accumulation-boundary micro-batch each G chunk's replica AllReduce is launched as soon
          as the chunk is final, so it overlaps the rest of backward.
After the optimizer: each unit's P-sync AllGather is launched asynchronously and waited for by that
          unit's next use (broadcast-forward overlap, ``lins.overlap_param_sync``).

Async collectives return handles (``Work``); ``wait()`` orders the current CUDA stream after them
without blocking the host, and on gloo waits for the background thread. Every rank issues the same
collectives in the same order, which the ordering of these hooks guarantees for a static graph.
"""

from __future__ import annotations

from collections import deque

import torch
from torch.utils._pytree import tree_flatten

from . import comm
from .units import FlatUnit, UnitState

IN_FLIGHT_RS = 2  # ReduceScatters allowed in flight before the oldest is accumulated


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Executor:
    def __init__(self, module: torch.nn.Module, root, layers: list, groups: comm.Groups,
                 reduce_dtype: torch.dtype, overlap_param_sync: bool = True):
        self.module, self.root, self.layers, self.groups = module, root, layers, groups
        self.units = ([root] if root is not None else []) + layers
        self.position = {id(u): i for i, u in enumerate(layers)}
        self.reduce_dtype, self.overlap_param_sync = reduce_dtype, overlap_param_sync
        self.boundary = False  # set by the engine before each backward
        self._handles = []
        self._pending_rs: deque = deque()  # (work, out, staging, unit)
        self._pending_ar: list = []  # (work, unit, tmp or None)
        self._free_staging: list = []
        self._register()

    # --- hooks -----------------------------------------------------------------------------
    def _register(self) -> None:
        h = self._handles
        h.append(self.module.register_forward_pre_hook(self._root_pre_forward))
        h.append(self.module.register_forward_hook(self._root_post_forward))
        for unit in self.layers:
            for m in unit.modules:
                h.append(m.register_forward_pre_hook(lambda mod, args, u=unit: self._layer_pre_forward(u)))
                h.append(m.register_forward_hook(lambda mod, args, out, u=unit: self._layer_post_forward(u, out)))
        for unit in self.units:
            for slot in unit.slots:
                h.append(slot.param.register_post_accumulate_grad_hook(lambda p, u=unit: self._on_grad(u, p)))

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

    def _neighbour(self, unit: FlatUnit, step: int):
        i = self.position.get(id(unit))
        j = None if i is None else i + step
        return self.layers[j] if j is not None and 0 <= j < len(self.layers) else None

    def _layer_pre_forward(self, unit: FlatUnit):
        self.gather(unit)
        nxt = self._neighbour(unit, -1 if in_backward() else 1)
        if nxt is not None:
            self.prefetch(nxt)

    def _layer_post_forward(self, unit: FlatUnit, out):
        if not unit.sharded_p:
            return
        if not in_backward():
            unit.release()
        tensors, _ = tree_flatten(out)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, u=unit: (self._pre_backward(u), grad)[1])

    def _pre_backward(self, unit: FlatUnit):
        self.gather(unit)
        prev = self._neighbour(unit, -1)
        if prev is not None:
            self.prefetch(prev)

    # --- P: gather, prefetch, release; P-sync ------------------------------------------------------
    def _wait_sync(self, unit: FlatUnit) -> None:
        if unit.sync_work is not None:
            unit.sync_work.wait()
            unit.sync_work = None

    def prefetch(self, unit: FlatUnit) -> None:
        """Launch the unit's AllGather without waiting (a no-op unless it is sharded and released)."""
        self._wait_sync(unit)
        if unit.state is not UnitState.SHARDED:
            return
        full = unit.materialise()
        unit.gather_work = comm.all_gather(self.groups, "p", full, unit.p_shard, async_op=True)
        unit.state = UnitState.GATHERING

    def gather(self, unit: FlatUnit) -> None:
        """Make the unit's full parameters current and usable on this stream."""
        self._wait_sync(unit)
        if unit.state is UnitState.SHARDED:
            self.prefetch(unit)
        if unit.state is UnitState.GATHERING:
            if unit.gather_work is not None:
                unit.gather_work.wait()
            unit.gather_work = None
            unit.state = UnitState.GATHERED

    def release_all(self) -> None:
        for unit in self.units:
            if unit.state is UnitState.GATHERING:
                self.gather(unit)  # never free memory a collective still writes into
            unit.release()

    def launch_param_sync(self) -> None:
        """After the optimizer: every unit's P chunk from the OS chunks of its P-sync group."""
        for unit in self.units:
            work = comm.all_gather(self.groups, "p_sync", unit.p_storage, unit.os_params(),
                                   async_op=self.overlap_param_sync)
            unit.sync_work = work if self.overlap_param_sync else None

    def wait_param_sync(self) -> None:
        for unit in self.units:
            self._wait_sync(unit)

    # --- G: reduction -----------------------------------------------------------------------
    def _on_grad(self, unit: FlatUnit, param) -> None:
        unit.pending.add(param)
        if unit is not self.root and len(unit.pending) == len(unit.slots):
            self.reduce_unit(unit)

    def _staging(self) -> torch.Tensor:
        if self._free_staging:
            return self._free_staging.pop()
        size = max(u.spec.padded for u in self.units)
        return torch.empty(size, dtype=self.reduce_dtype, device=self.units[0].device)

    def reduce_unit(self, unit: FlatUnit) -> None:
        """Move the unit's fresh gradients towards its G accumulation: ReduceScatter launched now
        and accumulated later when s_g > 1, local accumulation when s_g = 1 (in place where the
        gradients are views into the accumulator)."""
        if unit.grad_views is not None:
            unit.adopt_grads()
            self._mark_reduced(unit)
            self._after_accumulate(unit)
            return
        staging = self._stage(unit)
        self._mark_reduced(unit)
        if unit.sharded_g:
            out = torch.empty(unit.spec.g_size, dtype=self.reduce_dtype, device=unit.device)
            work = comm.reduce_scatter(self.groups, "g", out, staging[:unit.spec.padded], async_op=True)
            self._pending_rs.append((work, out, staging, unit))
            self._drain_rs(keep=IN_FLIGHT_RS)
        else:
            unit.g_acc.add_(staging[:unit.spec.padded])
            self._free_staging.append(staging)
            self._after_accumulate(unit)

    def _mark_reduced(self, unit: FlatUnit) -> None:
        unit.pending.clear()
        unit.reduced = True
        if unit is not self.root:
            unit.release()

    def _stage(self, unit: FlatUnit) -> torch.Tensor:
        """A staging buffer whose first ``padded`` elements hold the unit's gradients in the reduce
        dtype (the .grads are cleared)."""
        staging = self._staging()
        flat = staging[:unit.spec.padded]
        flat[unit.numel:].zero_()  # padding; every parameter range is written below
        for s in unit.slots:
            dest = flat[s.offset:s.offset + s.numel]
            if s.param.grad is None:
                dest.zero_()  # unused in this backward
            else:
                dest.copy_(s.param.grad.reshape(-1))
                s.param.grad = None
        return staging

    def _drain_rs(self, keep: int = 0) -> None:
        while len(self._pending_rs) > keep:
            work, out, staging, unit = self._pending_rs.popleft()
            if work is not None:
                work.wait()
            unit.g_acc.add_(out)
            self._free_staging.append(staging)
            self._after_accumulate(unit)

    def _after_accumulate(self, unit: FlatUnit) -> None:
        """On the boundary micro-batch a G chunk is final now: start its replica AllReduce."""
        if self.boundary:
            self._launch_replica_reduce(unit)

    def _launch_replica_reduce(self, unit: FlatUnit) -> None:
        if unit.replica_reduced or self.groups.size("g_replica") == 1:
            unit.replica_reduced = True
            return
        tmp = None if unit.g_acc.dtype == self.reduce_dtype else unit.g_acc.to(self.reduce_dtype)
        work = comm.all_reduce(self.groups, "g_replica", unit.g_acc if tmp is None else tmp, async_op=True)
        self._pending_ar.append((work, unit, tmp))
        unit.replica_reduced = True

    def post_backward(self) -> None:
        """End of one backward: reduce every unit not reduced yet (the root unit; units with unused
        parameters), so each unit is reduced exactly once per backward on every rank; release all."""
        for unit in self.units:
            if not unit.reduced:
                self.reduce_unit(unit)
            unit.reduced = False
        self._drain_rs()
        self.release_all()

    def reduce_replicas(self) -> None:
        """Accumulation boundary: every G chunk all-reduced over its replica group (launched during the
        last backward where possible), and waited for."""
        self._drain_rs()
        for unit in self.units:
            self._launch_replica_reduce(unit)
        self._wait_replica_reduces()

    def wait_all(self) -> None:
        """Wait for every collective still in flight (P-sync, prefetch, ReduceScatter, AllReduce);
        issues none."""
        for unit in self.units:
            self._wait_sync(unit)
            if unit.state is UnitState.GATHERING:
                self.gather(unit)
        self._drain_rs()
        self._wait_replica_reduces()

    def _wait_replica_reduces(self) -> None:
        for work, unit, tmp in self._pending_ar:
            if work is not None:
                work.wait()
            if tmp is not None:
                unit.g_acc.copy_(tmp)
        self._pending_ar.clear()

    def reset_boundary(self) -> None:
        for unit in self.units:
            unit.replica_reduced = False
