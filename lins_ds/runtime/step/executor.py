"""The hooks that run a Lins plan inside forward and backward, and the order units are prefetched in
(docs/design.md §3). Every state change is the unit's own (``unit.py``); this file decides when, reading
where training is from ``Progress`` (which ``LinsRuntime`` alone writes).

Forward:  a layer unit is gathered before its module runs (s_p > 1) while the next layer's gather is
          already in flight (prefetch); it is released after its forward unless that forward is a
          recompute inside backward (activation checkpointing). The root unit is gathered before the
          model runs and kept until the end of backward.
Backward: hooks on a layer's outputs re-gather it (and prefetch the layer before it); units are
          reduced in one fixed order, the layers last to first, the root last (``reduction_order``): a
          unit's reduction starts (a ReduceScatter in flight when s_g > 1, completed
          ``IN_FLIGHT_REDUCE_SCATTERS`` units later at most) once every parameter of it has its gradient
          and every unit before it in that order has started; what is left starts, in order, when the
          backward ends. On the accumulation-boundary backward each G chunk's replica AllReduce starts as
          soon as it is final, so it overlaps the rest of backward.
After the optimizer: each unit's P-sync AllGather is launched and waited for by that unit's next use
          (broadcast-forward overlap, ``lins.overlap_param_sync``).
Arrival:  where P is partitioned, a forward, ``generate`` and ``state_dict()`` gather over the P group, so every rank
          of it must make them: each first meets the others (``comm.Arrival``: a few integers over a gloo group of
          its own), and a call some ranks make alone fails on every rank that came, naming the call and the fix,
          instead of waiting in a gather or being matched by another rank's (docs/design.md §4).

Async collectives return handles (``Work``); ``wait()`` orders the current CUDA stream after them
without blocking the host, and on gloo waits for the background thread.

Every rank issues the same collectives in the same order on each group, whatever its data leaves unused
(docs/design.md §3, "Parameters used on some ranks only"): the reduction order is fixed, so a unit whose
parameters got no gradient on this rank (a branch not taken, an expert no token was routed to)
contributes zeros at its place in that order, never at another time than on the other ranks. So that
such a unit does not hold back every unit after it until the backward ends, the first time in a backward
that a complete unit waits behind an incomplete one, autograd is asked which parameters this backward will
reach (as torch's ``register_multi_grad_hook`` does) and the others count as arrived. A static graph
completes the units in order and never asks.
"""

from __future__ import annotations

import enum
import functools
from collections import deque
from dataclasses import dataclass

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten

from ...plan.memory import IN_FLIGHT_REDUCE_SCATTERS, IN_FLIGHT_REPLICA_COPIES, PREFETCHED_LAYERS
from .unit import GradState, Unit

# what a call that gathers says to do when not every rank of the P group made it (comm.Arrival)
RUN_FIX = ("call it on every rank; to run the model on some ranks only, gather it on every rank first: `with "
           "deepspeed.zero.GatheredParameters(list(model.parameters())):` entered on every rank, the call inside on "
           "those ranks (it then gathers nothing)")
STATE_DICT_FIX = ("call it on every rank (accelerate's get_state_dict and the Trainer's save_model do) and write on "
                  "one, or read it inside `deepspeed.zero.GatheredParameters(list(model.parameters()))` entered on "
                  "every rank")


class Phase(enum.Enum):
    FORWARD = "forward"  # forwards run (training or evaluation); gradients accumulate in the window
    BACKWARD = "backward"  # a backward runs, its recomputed forwards included
    BOUNDARY = "boundary"  # the window's gradients are being made final, clipped and applied (the step)


@dataclass
class Progress:
    """Where training is: written only by ``LinsRuntime`` (one method per step), read by the hooks."""

    phase: Phase = Phase.FORWARD
    ends_window: bool = False  # the running backward ends an accumulation window (replica AllReduces start in it)
    window_done: bool = False  # a window's last backward has ended and its step has not run: its gradients are whole
    busy: int = 0  # the engine or the model is running (forward, backward, step): reads are its own, not the user's
    pending: bool = False  # a backward's gradients that no step has applied (or dropped) yet: a window is open


def grad_tensors(out, depth: int = 3) -> list:
    """The tensors in a forward's output that a backward can start from: through pytree's containers (tuples,
    lists, dicts, HF's ``ModelOutput``) and, ``depth`` levels down, the attributes of other objects (a
    ``SimpleNamespace`` or a plain dataclass holding the loss), which pytree and DeepSpeed do not look into."""
    found = []
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                found.append(leaf)
        elif depth > 0 and hasattr(leaf, "__dict__") and not isinstance(leaf, (torch.nn.Module, type)):
            found += grad_tensors(list(vars(leaf).values()), depth - 1)
    return found



def will_get_grad(param) -> bool:
    """Inside a backward: whether it reaches ``param`` (its gradient accumulator is in the running graph)."""
    return torch._C._will_engine_execute_node(get_gradient_edge(param).node)


def reduction_order(root, layers: list) -> list:
    """The one order every rank reduces its units in: the layers last to first (the order a backward
    completes them), then the root, whose parameters stay gathered until the backward ends."""
    return list(reversed(layers)) + ([root] if root is not None else [])


class Executor:
    def __init__(self, module: torch.nn.Module, root, layers: list, reduce_dtype: torch.dtype, progress: Progress,
                 gradients: bool = True, on_final=None, before_forward=None):
        """``gradients`` False: forward only (an engine without an optimizer): no backward hooks. ``on_final(unit)``:
        called as each unit's G chunk becomes final inside a backward that ends the window (its host update may
        start: ``HostOffload.final``). ``before_forward()``: called as an outermost forward starts (it may refuse it:
        ``LinsRuntime.refuse_ahead``)."""
        self.module, self.root, self.layers, self.progress = module, root, layers, progress
        self.gradients, self._on_final, self._before_forward = gradients, on_final, before_forward
        self.units = ([root] if root is not None else []) + layers
        self.position = {id(u): i for i, u in enumerate(layers)}
        self.reduce_dtype = reduce_dtype
        self.order = reduction_order(root, layers)
        self._next = 0  # position in ``order`` of the next unit to reduce in this backward
        self._reach_known = False  # this backward's unreachable parameters are counted as arrived
        self._handles = []
        self._forwards = 0  # root forwards running (their pre-hook ran, their end not yet)
        self._reducing: deque = deque()  # (unit, staging) with a ReduceScatter in flight, oldest first
        self._copies: deque = deque()  # units whose replica AllReduce runs on a reduce-dtype copy, oldest first
        self._free_staging: list = []  # staging buffers of a layer unit's size, reused within a backward
        self._pool_size = max((u.spec.padded for u in (layers or self.units)), default=0)
        self._generate = None  # (the instance's own generate or None, the wrapper that replaced it)
        self._generating = 0  # generate() calls running (their steps' forwards need no check of their own)
        self._check_training = True  # the next training forward meets the other ranks (_arrive_forward)
        self._register()

    @property
    def _in_backward(self) -> bool:
        return self.progress.phase is Phase.BACKWARD

    # --- hooks -----------------------------------------------------------------------------
    def _register(self) -> None:
        h = self._handles
        h.append(self.module.register_forward_pre_hook(self._root_pre_forward))
        h.append(self.module.register_state_dict_pre_hook(self._before_state_dict))
        self._wrap_generate()
        h.append(self.module.register_forward_hook(self._root_post_forward))
        h.append(self.module.register_forward_hook(self._root_forward_ends, always_call=True))
        for unit in self.layers:
            for m in unit.modules:
                h.append(m.register_forward_pre_hook(lambda mod, args, u=unit: self._layer_pre_forward(u)))
                h.append(m.register_forward_hook(lambda mod, args, out, u=unit: self._layer_post_forward(u, out)))
        for unit in self.units if self.gradients else []:
            for slot in unit.slots:
                h.append(slot.param.register_post_accumulate_grad_hook(lambda p, u=unit: self._on_grad(u, p)))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._generate is not None and self.module.__dict__.get("generate") is self._generate[1]:
            if self._generate[0] is None:
                del self.module.__dict__["generate"]
            else:
                self.module.__dict__["generate"] = self._generate[0]
        self._generate = None

    # --- every rank at a call that gathers (P partitioned: comm.Arrival, docs/design.md §4) ---------------------
    @property
    def _arrival(self):
        return self.units[0].groups.arrival if self.units else None

    def _gathers(self) -> bool:
        """Whether a forward or a state_dict() now gathers over the P group: P partitioned, and not every unit held
        gathered (``deepspeed.zero.GatheredParameters`` on every rank: then one rank may run the model alone)."""
        return self._arrival is not None and not all(u.held for u in self.units)

    def _wrap_generate(self) -> None:
        """The model's ``generate`` (an instance attribute over the class's, removed with the hooks): under a plan that
        partitions P every rank meets there first, before transformers' own per-token AllReduce of ``synced_gpus``
        (which a rank alone would wait in, outside Lins); where every unit is held gathered, nothing is gathered and
        generation needs no ranks in step: ``synced_gpus`` defaults to False."""
        original = getattr(self.module, "generate", None)
        if self._arrival is None or not callable(original):
            return

        @functools.wraps(original)
        def generate(*args, **kwargs):
            if self._gathers():
                self._arrival.check(self._arrival.GENERATE, RUN_FIX)
                self._check_training = True
            else:
                kwargs.setdefault("synced_gpus", False)
            self._generating += 1  # its steps' forwards need no check of their own: synced_gpus keeps ranks in step
            try:
                return original(*args, **kwargs)
            finally:
                self._generating -= 1

        self._generate = (self.module.__dict__.get("generate"), generate)
        self.module.__dict__["generate"] = generate

    def _arrive_forward(self, module) -> None:
        """A training forward (train mode, gradients on: a backward follows) meets the others once per optimizer step,
        its first (``finish_window`` re-arms it), or after a call of another kind: one-rank calls come between steps
        (an evaluation, a generation, a save), and what every rank does between two checks is the same schedule, so
        the ranks' exchanges stay paired. Any other forward meets them every time (``generate``'s steps excepted)."""
        a = self._arrival
        if self.gradients and torch.is_grad_enabled() and module.training:
            if self._check_training:
                a.check(a.TRAINING, RUN_FIX)
                self._check_training = False
        else:
            a.check(a.FORWARD, RUN_FIX)
            self._check_training = True

    def _before_state_dict(self, module, prefix, keep_vars):
        """``state_dict()`` reads every parameter whole: every rank of the P group there first, then every unit gathered
        (the engine's state_dict hook copies the values out and releases them)."""
        if self._gathers():
            self._arrival.check(self._arrival.STATE_DICT, STATE_DICT_FIX)
            self._check_training = True
        for unit in self.units:
            unit.wait_gather()

    def _root_pre_forward(self, module, args):
        if self._before_forward is not None and not (self._forwards or self._in_backward):
            self._before_forward()
        if not (self._forwards or self._generating or self._in_backward) and self._gathers():  # outermost, no recompute
            self._arrive_forward(module)
        self.progress.busy += 1  # until _root_forward_ends, which runs even where the forward raises
        self._forwards += 1
        if self.root is not None:
            self.root.wait_gather()

    def _root_forward_ends(self, module, args, out):
        if self._forwards:  # not where a pre-hook before this one raised: this one never ran
            self._forwards -= 1
            self.progress.busy -= 1

    def _root_post_forward(self, module, args, out):
        if self.root is None:
            return
        if not (self.gradients and torch.is_grad_enabled() and grad_tensors(out)):
            self.root.release()  # no backward will follow
        elif self.root.releases:  # a backward Lins was not told of (a second plain loss.backward() over this forward)
            for t in grad_tensors(out, depth=0):  # finds the root released: gathered again before autograd reads it,
                if t.grad_fn is not None:         # so that _on_grad can say what happened (never a leaf's hook: it
                    t.register_hook(self._root_pre_backward)  # would outlive this forward)

    def _root_pre_backward(self, grad):
        self.root.wait_gather()  # nothing to do in a backward the engine began: the root is gathered then
        return grad

    def _prefetch(self, unit: Unit, direction: int) -> None:
        """Start gathering the ``PREFETCHED_LAYERS`` layer units after ``unit`` in ``direction`` (+1: the
        forward's order, -1: the backward's), as the memory model counts them."""
        i = self.position.get(id(unit))
        for k in range(1, PREFETCHED_LAYERS + 1) if i is not None else ():
            if 0 <= i + direction * k < len(self.layers):
                self.layers[i + direction * k].start_gather()

    def _layer_pre_forward(self, unit: Unit):
        unit.wait_gather()
        self._prefetch(unit, -1 if self._in_backward else 1)  # a recompute inside backward goes down

    def _layer_post_forward(self, unit: Unit, out):
        if not unit.releases:
            return
        if not self._in_backward:
            unit.release()
        # pytree's containers only: a layer's output may hold a shared object (an older transformers' DynamicCache)
        # whose attributes are every earlier layer's K/V; hooking those would re-gather this unit in their backward
        for t in grad_tensors(out, depth=0) if self.gradients else []:
            t.register_hook(lambda grad, u=unit: (self._pre_backward(u), grad)[1])

    def _pre_backward(self, unit: Unit):
        unit.wait_gather()
        self._prefetch(unit, -1)

    def _on_grad(self, unit: Unit, param) -> None:
        if not self._in_backward:
            raise RuntimeError(
                "lins: a gradient arrived outside a backward the engine was told of: a second loss.backward() over "
                "one forward (DeepSpeed announces only the first), or a backward of engine.module's output called "
                "without engine.backward. Call engine.backward(loss) for every backward (retain_graph=True on all "
                "but the last over one forward); its gradients are then summed, as torch sums them")
        if not unit.grad_arrived(param):
            return
        self._reduce_ready()
        if unit is not self.root and unit.grad_state is GradState.ACCUMULATING:
            unit.release()  # its backward is done; its reduction waits for a unit before it in ``order``
            if not self._reach_known:  # which may be waiting for gradients that will not come
                self._count_unreachable()
                self._reduce_ready()

    def _count_unreachable(self) -> None:
        """Once per backward, from inside it, when a complete unit waits behind an incomplete one: in each layer
        unit this backward reaches, the parameters it does not reach will get no gradient; count them as
        arrived. A unit it reaches not at all is left alone (a reentrant checkpoint hides a whole layer from
        the outer graph until its backward recomputes it)."""
        self._reach_known = True
        for unit in self.layers:
            reached = [will_get_grad(s.param) for s in unit.slots]
            if any(reached) and not all(reached):
                unit.expect_no_grad([s.param for s, r in zip(unit.slots, reached) if not r])

    def _reduce_ready(self) -> None:
        """Reduce, in ``order``, each unit whose gradients are complete, up to the first that is not."""
        while self._next < len(self.order):
            unit = self.order[self._next]
            if unit is self.root or not unit.grads_complete:
                return
            self._next += 1
            self.reduce(unit)

    # --- driven by LinsRuntime, one method per step -------------------------------------------
    def begin_backward(self) -> None:
        """A backward starts, before any gradient of it arrives (``LinsEngine.backward`` begins it by a hook on the
        loss, since DeepSpeed's output hook announces only the first backward over a forward). Another backward over
        the same forward (``engine.backward(l1, retain_graph=True); engine.backward(l2)``) finds the root released
        and, after a backward that ended the window, the replica AllReduces in flight: those are completed (each unit
        keeps the window's sum on one replica, ``Unit.begin_backward``) and the root gathered again, since autograd's
        saved views of its parameters point into its full buffer. Otherwise both are no-ops; called twice in one
        backward (DeepSpeed's hook, then the engine's) before any gradient arrived, the second call changes nothing."""
        self._next, self._reach_known = 0, False
        if any(u.grad_state is GradState.REPLICA_REDUCING for u in self.units):
            self.complete_reductions()
        if self.root is not None:
            self.root.wait_gather()
        for unit in self.units:
            unit.begin_backward()

    def end_backward(self) -> None:
        """Reduce, in ``order``, every unit not reduced yet (the root; units with parameters that got no
        gradient on this rank), so every rank reduces each unit exactly once per backward, in the same order;
        complete the ReduceScatters (their G chunks are final at a window's end: the replica AllReduces start)
        and release every unit."""
        for unit in self.order[self._next:]:
            self.reduce(unit)
        self._next = len(self.order)
        self._complete_reduce_scatters()
        self._free_staging.clear()  # freed between backwards: the forward and the optimizer step need none
        for unit in self.units:
            unit.release()

    def finish_window(self) -> None:
        """The window's gradients final on every unit: replica AllReduces started where the last backward did
        not (it did not end the window: ``no_sync``, or a step without a backward), then all waited for. The next
        training forward meets the other ranks again (``_arrive_forward``)."""
        self._check_training = True
        self._complete_reduce_scatters()
        for unit in self.order:
            if unit.grad_state in (GradState.REDUCED, GradState.ACCUMULATING):
                self._start_replica_reduce(unit)
        for unit in self.order:
            if unit.grad_state is GradState.REPLICA_REDUCING:
                unit.finish_replica_reduce()
        self._copies.clear()

    def complete_reductions(self) -> None:
        """Every gradient reduction in flight completed; issues none."""
        self._complete_reduce_scatters()
        for unit in self.order:
            if unit.grad_state is GradState.REPLICA_REDUCING:
                unit.finish_replica_reduce()
        self._copies.clear()

    def complete_in_flight(self) -> None:
        """Every collective still in flight completed; issues none (``LinsRuntime.wait``)."""
        self._complete_reduce_scatters()
        for unit in self.units:
            unit.wait_all()
        self._copies.clear()

    # --- reductions -----------------------------------------------------------------------------
    def reduce(self, unit: Unit) -> None:
        """Start the unit's reduction; release its parameters (the root's stay until the backward ends)."""
        staging = None if unit.in_place else self._staging(unit)
        in_flight = unit.start_reduce(staging)
        if unit is not self.root:
            unit.release()
        if in_flight:
            self._reducing.append((unit, staging))
            self._complete_reduce_scatters(keep=IN_FLIGHT_REDUCE_SCATTERS)
        else:
            self._recycle(unit, staging)
            self._after_reduce(unit)

    def _complete_reduce_scatters(self, keep: int = 0) -> None:
        """Complete ReduceScatters, oldest first, until ``keep`` are in flight."""
        while len(self._reducing) > keep:
            unit, staging = self._reducing.popleft()
            unit.finish_reduce()
            self._recycle(unit, staging)
            self._after_reduce(unit)

    def _after_reduce(self, unit: Unit) -> None:
        if self.progress.ends_window:  # the G chunk is final: its replica AllReduce overlaps the rest of backward
            self._start_replica_reduce(unit)
            if self._on_final is not None and unit.grad_state is GradState.FINAL:  # one replica: final already
                self._on_final(unit)

    def _start_replica_reduce(self, unit: Unit) -> None:
        """Launch the unit's replica AllReduce; copies in the reduce dtype are bounded in number."""
        if unit.start_replica_reduce():
            self._copies.append(unit)
            while len(self._copies) > IN_FLIGHT_REPLICA_COPIES:
                self._copies.popleft().finish_replica_reduce()

    def _staging(self, unit: Unit) -> torch.Tensor:
        """A buffer for the unit's flat gradients: from the pool of layer-sized buffers, or, for a larger unit
        (the root, reduced when the backward ends) or one whose staged gradients go down to its G accumulator on
        the host (a copy still reads them after the reduction), its own, freed when that is done."""
        if unit.spec.padded > self._pool_size or self._goes_down(unit):
            return torch.empty(unit.spec.padded, dtype=self.reduce_dtype, device=unit.device)
        if self._free_staging:
            return self._free_staging.pop()
        return torch.empty(self._pool_size, dtype=self.reduce_dtype, device=unit.device)

    @staticmethod
    def _goes_down(unit: Unit) -> bool:
        return unit.host_grads is not None and not unit.sharded_g

    def _recycle(self, unit: Unit, staging) -> None:
        if staging is not None and staging.numel() == self._pool_size and not self._goes_down(unit):
            self._free_staging.append(staging)
