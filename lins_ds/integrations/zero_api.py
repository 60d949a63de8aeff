"""DeepSpeed's parameter API on a Lins plan (docs/design.md §4, "What user code sees").

Code written for DeepSpeed asks a parameter for more than its ``.data``: ``deepspeed.utils.safe_get_full_*`` (and
``safe_set_full_*``) assemble the fp32 master, an optimizer state or the gradient of a parameter whose optimizer state
is partitioned (ZeRO-1/2's fragment mapping, ``_hp_mapping``), and ``deepspeed.zero.GatheredParameters`` gathers a
partitioned parameter (ZeRO-3's ``ds_id``, ``all_gather``, ``partition``). Lins answers both through its runtime's
verbs (``zero3_params``, ``show_zero3_status``, ``hold_params``, ``full_value``, ...; no unit is driven from here), so
that such code — DeepSpeed's helpers, transformers, TRL, PEFT, user scripts — works unchanged:

- every trainable parameter carries the fragment mapping. Full values are assembled by one world AllReduce to which
  the first OS replica of each chunk contributes (exact, and a collective: every rank calls it, as under ZeRO); the
  gradient is the window's, averaged over the ranks, between the backward that ends a window and ``step()``;
- every trainable parameter carries ZeRO-3's attributes (``ds_id``, ``ds_shape``, ``ds_numel``, ``all_gather``,
  ``partition``), on every plan: one of a unit that releases its full buffer (P sharded, or on the host) is, outside
  forward, an empty tensor; ``GatheredParameters`` gathers (or, where the unit keeps its parameters, waits for) the
  units of the parameters it is given, and only those — their last update and P-sync done — and, with
  ``modifier_rank``, after DeepSpeed's broadcast from that rank writes the values back into the P chunk and the fp32
  master, so that the change outlives the next step. A script means the same whichever plan the solver picks;
- ``zero_grad`` of the optimizer, of the engine or of a module (or a submodule) drops the gradients accumulated so far
  in the window (the submodule's only), as under ZeRO-1 (no collective);
- a module's ``parameters()``, ``named_parameters()`` and ``state_dict()`` called after ``step()`` see the updated
  values: the engine's modules are registered here, and those methods (patched once, process-wide) first make the last
  step's updates visible (``LinsRuntime.before_user_read``; this rank alone, no collective). Inside the engine's own
  forward, backward and step nothing waits, so the update still overlaps the next forward where nobody looks.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref

import torch
from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn

# module -> a weak reference to its LinsRuntime (the runtime holds the module: a strong one would keep both alive)
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
_metadata_reads = [0]  # > 0 while code that reads only shapes runs (num_parameters): no wait


class Mapping:
    """What ``_hp_mapping`` holds: the engine (DeepSpeed only tests that the attribute exists)."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)

    @property
    def engine(self):
        engine = self._engine()
        if engine is None or engine.lins is None or engine.lins.destroyed:
            raise RuntimeError("lins: this parameter's engine was destroyed; its sharded state is gone")
        return engine


def attach(engine) -> None:
    """Register the engine's modules for reads, and give each trainable parameter DeepSpeed's API (again after a
    re-layout: a unit may release its buffer under one plan and not under another). Where parameters are partitioned,
    generation keeps every rank in step: transformers' ``generate`` runs with ``synced_gpus``, as under ZeRO-3 (a rank
    that finished keeps joining the others' gathers)."""
    _install_read_hooks()
    rt = engine.lins
    partitioned = rt.partitions_params() and dist.get_world_size() > 1
    for m in engine.module.modules():  # every one: a PEFT model's generate runs the wrapped model's, whose own
        if partitioned:                # flag transformers reads (as the LayerDrop of its speech encoders)
            m._is_fsdp_managed_module = True  # transformers' test for synced_gpus (ds_compat lists it)
        elif m.__dict__.get("_is_fsdp_managed_module"):
            del m._is_fsdp_managed_module
    for m in engine.modules():
        _OWNERS[m] = weakref.ref(rt)
    mapping, z3 = Mapping(engine), Zero3Optimizer(engine)
    # ZeRO-3's API on every plan, not only where the unit releases its parameters: GatheredParameters then means one
    # thing whatever the solver picked (reads wait for the unit's update, a modifier_rank's write is broadcast and kept
    # in the masters); a parameter its unit keeps is always available
    rt.show_zero3_status(ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE)
    for ds_id, (p, shape, numel, released) in enumerate(rt.zero3_params()):
        p._hp_mapping = mapping  # GatheredParameters' methods find the engine here (forward-only ones too)
        if engine.optimizer is not None:
            for name, fn in (("get_full_hp_param", _get_full_hp_param), ("set_full_hp_param", _set_full_hp_param),
                             ("get_full_hp_grad", _get_full_hp_grad), ("set_full_hp_grad", _set_full_hp_grad)):
                setattr(p, name, types.MethodType(fn, p))
        p.ds_id, p.ds_shape, p.ds_numel = ds_id, shape, numel
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE if released and p.numel() == 0 else ZeroParamStatus.AVAILABLE
        p.ds_process_group = dist.get_world_group()
        p.all_gather, p.partition = types.MethodType(_all_gather, p), types.MethodType(_partition, p)
        p._z3_optimizer = z3


def detach(engine) -> None:
    for m in list(engine.modules()):
        _OWNERS.pop(m, None)


# --- full values (collectives: every rank calls them) -------------------------------------------------------
def full_value(engine, param, key=None) -> torch.Tensor:
    """The fp32 master of ``param`` (``key`` None) or its element-wise optimizer state ``key``, whole, on every rank."""
    return engine.lins.full_value(param, key)


def set_full_value(engine, param, value: torch.Tensor, key=None) -> None:
    """Write ``value`` (the whole parameter, the same on every rank) into the fp32 master or state ``key`` of every
    slice this rank holds, and, for the master, into the parameter this rank holds; no collective."""
    engine.lins.write_value(param, value, key)


def full_grad(engine, param) -> torch.Tensor:
    """``param``'s gradient for the window just ended, averaged over the ranks (and unscaled), whole, on every rank."""
    return engine.lins.full_grad(param, engine.optimizer.cur_scale)


def set_full_grad(engine, param, value: torch.Tensor) -> None:
    """Make ``value`` (averaged over the ranks, as ``full_grad`` gives it) the window's gradient of ``param`` in this
    rank's G accumulator; no collective."""
    engine.lins.write_grad(param, value, engine.optimizer.cur_scale)


# --- the methods DeepSpeed's helpers call on a parameter ------------------------------------------------------
def _get_full_hp_param(self, optim_state_key=None):
    return full_value(self._hp_mapping.engine, self, optim_state_key)


def _set_full_hp_param(self, value, optim_state_key=None):
    set_full_value(self._hp_mapping.engine, self, value, optim_state_key)


def _get_full_hp_grad(self):
    return full_grad(self._hp_mapping.engine, self)


def _set_full_hp_grad(self, value):
    set_full_grad(self._hp_mapping.engine, self, value)


class Zero3Optimizer:
    """``param._z3_optimizer``: what DeepSpeed's helpers ask of a ZeRO-3 parameter's optimizer."""

    def __init__(self, engine):
        self._mapping = Mapping(engine)

    def get_full_hp_param(self, param, optim_state_key=None):
        return full_value(self._mapping.engine, param, optim_state_key)

    def set_full_hp_param(self, value, param, optim_state_key=None):
        set_full_value(self._mapping.engine, param, value, optim_state_key)

    def get_fp32_grad_for_param(self, param):
        return full_grad(self._mapping.engine, param)

    def set_fp32_grad_for_param(self, value, param):
        set_full_grad(self._mapping.engine, param, value)

    def update_fp32_grad_for_param_vectorized(self, update_func, params):
        """``safe_update_full_grad_vectorized``: each full gradient through ``update_func``, as ZeRO-1/2 do it."""
        engine = self._mapping.engine
        for p in params:
            set_full_grad(engine, p, update_func(full_grad(engine, p), p))

    def _local(self, *args, **kwargs):
        raise NotImplementedError(
            "lins: DeepSpeed's safe_get_local_* / safe_set_local_* read ZeRO-3's own partition of a parameter; a Lins "
            "plan partitions P, G and OS by factors of its own, so there is no such partition to hand out. Use "
            "safe_get_full_* / safe_set_full_* (every rank calls them), which mean the same on every plan")

    get_local_fp32_param = set_local_hp_param = get_local_fp32_grad_for_param = set_local_grad_for_param = _local


def _all_gather(self, param_list=None, async_op=False, hierarchy=None):
    """ZeRO-3's ``param.all_gather``: the units of ``param_list`` gathered and held (every rank, the same list)."""
    params = param_list if param_list is not None else [self]
    self._hp_mapping.engine.lins.hold_params(params)  # ds_status follows (LinsRuntime.show_zero3_status)
    return None


def _partition(self, param_list=None, hierarchy=None, has_been_updated=False, free_data=True):
    """ZeRO-3's ``param.partition``: held units released; with ``has_been_updated`` (``GatheredParameters`` with a
    ``modifier_rank``, after its broadcast) the values written back into the P chunk and the fp32 master first."""
    params = param_list if param_list is not None else [self]
    engine = self._hp_mapping.engine
    if has_been_updated:
        for p in params:  # forward only, the parameters are all there is (``LinsRuntime.write_value``)
            set_full_value(engine, p, p.data.float())
    engine.lins.unhold_params(params)


# --- reads through a module ------------------------------------------------------------------------------------
def _install_read_hooks() -> None:
    """Once per process: ``named_parameters`` (which ``parameters`` calls) and ``state_dict`` of a registered module
    make the last step's updates visible before reading, and its ``zero_grad`` drops what Lins accumulated; one dictionary lookup for any other module. transformers'
    ``num_parameters`` (the Trainer calls it after every micro-step, for its FLOP count) reads only shapes: it waits
    for nothing, and counts a partitioned parameter by its ``ds_numel``."""
    if not getattr(nn.Module.named_parameters, "_lins_reads", False):
        for name in ("named_parameters", "state_dict"):
            setattr(nn.Module, name, _before_read(getattr(nn.Module, name)))
    if not getattr(nn.Module.zero_grad, "_lins_drops", False):
        nn.Module.zero_grad = _dropping(nn.Module.zero_grad)
    hf = sys.modules.get("transformers.modeling_utils")
    if hf is not None and not getattr(hf.PreTrainedModel.num_parameters, "_lins_reads", False):
        hf.PreTrainedModel.num_parameters = _shapes_only(hf.PreTrainedModel.num_parameters)


def _before_read(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if _OWNERS and not _metadata_reads[0] and not torch.compiler.is_compiling():
            ref = _OWNERS.get(self)
            rt = ref() if ref is not None else None
            if rt is not None and not rt.destroyed:
                rt.before_user_read()
        return method(self, *args, **kwargs)

    wrapper._lins_reads = True
    return wrapper


def _dropping(zero_grad):
    """``module.zero_grad()`` on an engine's module (or one of its submodules) drops the gradients its parameters
    accumulated in the window, as under ZeRO-1, where they live in ``.grad``: Lins keeps them in its accumulators."""
    @functools.wraps(zero_grad)
    def wrapper(self, set_to_none: bool = True):
        if _OWNERS and not torch.compiler.is_compiling():
            ref = _OWNERS.get(self)
            rt = ref() if ref is not None else None
            if rt is not None and not rt.destroyed:
                rt.drop_gradients(list(self.parameters()))
        return zero_grad(self, set_to_none)

    wrapper._lins_drops = True
    return wrapper


def _shapes_only(num_parameters):
    @functools.wraps(num_parameters)
    def wrapper(self, only_trainable: bool = False, exclude_embeddings: bool = False):
        if _OWNERS.get(self) is None:
            return num_parameters(self, only_trainable, exclude_embeddings)
        _metadata_reads[0] += 1
        try:  # a partitioned parameter counts whole, as ZeRO-3's (transformers asks ds_numel only under ZeRO-3)
            skip = ({f"{n}.weight" for n, m in self.named_modules() if isinstance(m, nn.Embedding)}
                    if exclude_embeddings else set())
            return sum(int(getattr(p, "ds_numel", p.numel())) for n, p in self.named_parameters()
                       if n not in skip and (p.requires_grad or not only_trainable))
        finally:
            _metadata_reads[0] -= 1

    wrapper._lins_reads = True
    return wrapper
