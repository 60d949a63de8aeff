"""Selective activation checkpointing: the first k of the N layer units recompute their forward in backward
(docs/design.md §8). The solver picks k; 0 and N are the all-or-nothing cases. Where the model checkpoints k units
already (``activation_checkpointing_enable``, every n-th with ``every_n_layers``), it keeps those.

Hugging Face layers (``GradientCheckpointingLayer``: a ``gradient_checkpointing`` flag and a
``_gradient_checkpointing_func``) are switched with their own flag, which also turns their cache off
under checkpointing. They run the checkpoint function the model was given (``activation_checkpointing_enable``:
its ``activation_checkpointing_kwargs``, and ``offload=True``, the saved activations in pinned host memory), else
``torch.utils.checkpoint`` (non-reentrant); any other module gets its forward wrapped in the latter.
Either way the module's hooks stay outside the checkpointed function, so Lins' gather hooks run once per
forward, and the unit is gathered again before its backward (and so before the recompute).

Activation offload (``offload_layers``, a set of checkpointed unit indices): those units' checkpoint function is
wrapped in ``activation_offload.OffloadedCheckpoint``, which holds the inputs the checkpoint saves on the host
between the forward and the recompute and brings them back one layer ahead. A Hugging Face layer gets it as its
``_gradient_checkpointing_func`` (around the model's own function); another module's checkpointed forward calls it in
place of ``torch.utils.checkpoint``. With no unit offloaded nothing of it is installed.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .activation_offload import ActivationOffload, OffloadedCheckpoint

_WRAPPED = "_lins_checkpointed_forward"
_FUNC = "_lins_checkpoint_func"  # a non-HF module's checkpoint function, where it is not torch's plain one


def _is_hf_layer(module: nn.Module) -> bool:
    return hasattr(type(module), "gradient_checkpointing") and hasattr(module, "gradient_checkpointing")


def checkpointed_units(layer_modules: list) -> list:
    """The indices of the layer units the model checkpoints already: every one after HF's
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``), every n-th with its ``every_n_layers``."""
    return [i for i, mods in enumerate(layer_modules)
            if all((_is_hf_layer(m) and m.gradient_checkpointing) or hasattr(m, _WRAPPED) for m in mods)]


_DEFAULT = functools.partial(checkpoint, use_reentrant=False)


def model_function(layer_modules: list):
    """The checkpoint function the model's Hugging Face layers were given, or None: what
    ``activation_checkpointing_enable`` built from its kwargs and ``offload`` (the same for every layer; it stays
    in a layer a plan has turned off). Not the engine's own, nor the bare ``checkpoint`` that
    ``activation_checkpointing_disable`` leaves behind."""
    for mods in layer_modules:
        for m in mods:
            func = getattr(m, "_gradient_checkpointing_func", None) if _is_hf_layer(m) else None
            func = func.inner if isinstance(func, OffloadedCheckpoint) else func
            if func is not None and func is not _DEFAULT and func is not checkpoint:
                return func
    return None


def _set(module: nn.Module, on: bool, func=None) -> None:
    """Checkpointing on or off; ``func`` (on) is the module's checkpoint function: a Hugging Face layer's keeps the
    one it has without one; another module runs ``func`` where it is given and not torch's plain one."""
    if _is_hf_layer(module):
        module.gradient_checkpointing = on
        if on and func is not None:
            module._gradient_checkpointing_func = func
        return
    if on and not hasattr(module, _WRAPPED):
        forward = module.forward

        @functools.wraps(forward)
        def checkpointed(*args, **kwargs):
            if module.training and torch.is_grad_enabled():
                return getattr(module, _FUNC, _DEFAULT)(forward, *args, **kwargs)
            return forward(*args, **kwargs)

        setattr(module, _WRAPPED, forward)
        module.forward = checkpointed
    elif not on and hasattr(module, _WRAPPED):
        module.forward = getattr(module, _WRAPPED)
        delattr(module, _WRAPPED)
    if on and func is not None and func is not _DEFAULT:
        setattr(module, _FUNC, func)
    elif hasattr(module, _FUNC) and (not on or func is not None):
        delattr(module, _FUNC)


@contextlib.contextmanager
def disabled(module: nn.Module):
    """``module`` runs without checkpointing inside the block (the memory probe measures both ways itself)."""
    hf = _is_hf_layer(module) and module.gradient_checkpointing
    wrapped = hasattr(module, _WRAPPED)
    func = getattr(module, _FUNC, None)  # an offloading one, kept for after
    _set(module, False)
    try:
        yield
    finally:
        if hf or wrapped:
            _set(module, True, func)


def checkpointed(layer_modules: list, k: int, keep_own: bool = False) -> list:
    """The layer units ``apply`` checkpoints for ``k`` and ``keep_own``, in order."""
    own = checkpointed_units(layer_modules)
    return sorted(own) if keep_own and len(own) == k else list(range(k))


def apply(layer_modules: list, k: int, keep_own: bool = False, offload_layers: Iterable[int] = (),
          offload: Optional[ActivationOffload] = None) -> Optional[ActivationOffload]:
    """Checkpoint ``k`` layer units (each a list of modules), not the others: the first ``k``, or with ``keep_own``
    those the model checkpoints already where they are ``k`` (a pattern such as HF's ``every_n_layers``). Every
    Hugging Face layer it checkpoints runs the checkpoint function the model was given, where it was given one.

    ``offload_layers``: the checkpointed units whose saved inputs are held on the host (``offload``'s, a new
    ``ActivationOffload`` without one); returns the ``ActivationOffload`` in use, None where no unit is offloaded."""
    units = set(checkpointed(layer_modules, k, keep_own))
    offloaded = _offloaded(offload_layers, units, len(layer_modules))
    if offloaded and offload is None:
        offload = ActivationOffload()
    func = model_function(layer_modules) or _DEFAULT
    for i, mods in enumerate(layer_modules):
        for m in mods:
            own_func = func if _is_hf_layer(m) else _DEFAULT
            _set(m, i in units, OffloadedCheckpoint(own_func, offload, i) if i in offloaded else own_func)
    return offload if offloaded else None


def _offloaded(offload_layers: Iterable[int], units: set, n: int) -> set:
    """The offloaded unit indices, each one checkpointed (only a checkpointed unit keeps just its inputs)."""
    offloaded = set(offload_layers)
    outside = sorted(i for i in offloaded if not 0 <= i < n)
    if outside:
        raise ValueError(f"lins: activation offload of layer units {outside}: the model has {n} (0 to {n - 1})")
    bare = sorted(offloaded - units)
    if bare:
        raise ValueError(f"lins: activation offload of layer units {bare}, which are not checkpointed (the "
                         f"checkpointed ones: {sorted(units)}): only a checkpointed unit's saved inputs can leave")
    return offloaded
